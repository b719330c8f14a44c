"""What a run's numerics depend on: the installed packages' versions, and for recorded runs the host (the
CPU, Python, the numerics-changing flags and the kernel tiers XLA and torch run in).

Only traces of real implementations carry the host; reference traces carry nothing of it.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
import sys

# CPU features that decide which kernels XLA, oneDNN and torch compile to (FMA contraction, f16 and
# bf16 arithmetic, vector width).
# (Linux's names: avx512_fp16, not avx512fp16, which no /proc/cpuinfo lists.)
NUMERIC_CPU_FEATURES = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512_bf16",
                        "avx512_fp16", "amx_bf16", "amx_fp16", "amx_tile", "asimd", "asimdhp", "sve")
# Environment variables that change what the frameworks compute.
# ONEDNN_MAX_CPU_ISA picks XLA's (and torch's) oneDNN kernels, ATEN_CPU_CAPABILITY torch's, NPY_DISABLE_CPU_FEATURES numpy's.
NUMERIC_FLAGS = ("XLA_FLAGS", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "NPY_DISABLE_CPU_FEATURES",
                 "JAX_ENABLE_X64", "JAX_DEFAULT_MATMUL_PRECISION", "TF_ENABLE_ONEDNN_OPTS",
                 "NVIDIA_TF32_OVERRIDE", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "CUBLAS_WORKSPACE_CONFIG",
                 "KERAS_BACKEND", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_CORETYPE")


def cpu_flags() -> frozenset:
    """This CPU's feature flags as Linux lists them (empty where /proc/cpuinfo is unreadable)."""
    try:
        with open("/proc/cpuinfo") as info:
            line = next((line for line in info if line.startswith(("flags", "Features"))), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


def installed_versions(packages) -> dict:
    """Each package's version as installed in this process's environment ("not installed" where absent)."""
    versions = {}
    for package in packages:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = "not installed"
    return versions


def torch_cpu_tiers() -> dict | None:
    """The CPU kernel tiers of the imported torch (None where torch is not imported): ATen's capability
    (ATEN_CPU_CAPABILITY caps it) and whether oneDNN computes bfloat16 (ONEDNN_MAX_CPU_ISA caps it),
    which decide the bits of some ops (fpemu/emulate/_torch_kernels.py)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    return {"aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "onednn_bf16": torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())}


@functools.lru_cache(maxsize=None)
def xla_cpu_tier() -> str:
    """Which of ``XLA_CPU_TIERS`` this process's XLA:CPU computes in, read from two probe programs
    rather than from /proc/cpuinfo, since caps decide it as much as the CPU does:
    ``ONEDNN_MAX_CPU_ISA`` picks oneDNN's sgemm kernel, ``--xla_cpu_max_isa`` what LLVM emits.
    Both of fpemu.adapters.jax_step's flag modes share the answer (they differ in excess precision only).
    The tiers are fpemu.steps.semantics.XLA_CPU_TIERS; jax is imported here.

    Raises:
      RuntimeError: a combination no preset models (f16 FMAs with oneDNN capped to AVX2).
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    f32 = np.float32
    cpu = jax.devices("cpu")[0]  # the programs run where their operands are committed
    # x @ w = 4 * 1.5 * 2^125 + 4 * -2^126: AVX2's paired order rounds the second product alone
    # (-inf); AVX-512's one FMA chain gives -2^126.
    w = np.zeros((4, 4), f32)
    w[0, 0], w[1, 0] = np.ldexp(f32(1.5), 125), np.ldexp(f32(-1.0), 126)
    dot = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    product = dot(jax.device_put(np.full((2, 4), 4, f32), cpu), jax.device_put(w, cpu))
    avx512_sgemm = bool(np.isfinite(np.asarray(product)[0, 0]))
    # (1 + 2^-10)^2 + 2^-11 in f16: one FMA rounds up to 1 + 3 * 2^-10, a multiply then an add to 1 + 2^-9.
    x, b = (jax.device_put(np.array([v], np.float16), cpu) for v in (1 + 2.0 ** -10, 2.0 ** -11))
    fused = jax.jit(lambda a, c: a * a + c)(x, b)
    fp16_fma = float(fused[0]) == 1 + 3 * 2.0 ** -10
    if fp16_fma and not avx512_sgemm:
        raise RuntimeError("XLA fuses f16 multiply-adds here but oneDNN runs its AVX2 sgemm (ONEDNN_MAX_CPU_ISA "
                           "capped?): no preset models that combination; cap both or neither")
    return "avx512fp16" if fp16_fma else "avx512" if avx512_sgemm else "avx2"


def _xla_cpu_tier_or_why() -> str:
    try:
        return xla_cpu_tier()
    except RuntimeError as unmodelled:  # a recording states it rather than failing
        return f"unmodelled: {unmodelled}"


def host_provenance(packages=None) -> dict:
    """The host facts a recorded trace keeps: platform, machine, Python, numeric CPU features, the
    numerics-changing environment variables that are set and, where torch or jax is imported, the CPU
    tiers their kernels run in.  ``packages``: the distributions the run used (an adapter's versions); then
    only their tiers (torch's for torch, XLA's for jax), so that what else this process imported before
    (another job's framework) is no part of the trace; None: every imported framework's."""
    flags = cpu_flags()
    tiers = torch_cpu_tiers() if packages is None or "torch" in packages else None
    xla = ({"xla_cpu_tier": _xla_cpu_tier_or_why()}
           if "jax" in sys.modules and (packages is None or "jax" in packages) else {})
    return {"platform": platform.platform(), "machine": platform.machine(),
            "python": sys.version.split()[0],
            "cpu_features": sorted(f for f in NUMERIC_CPU_FEATURES if f in flags),
            "flags": {name: os.environ[name] for name in NUMERIC_FLAGS if name in os.environ},
            **({"torch_cpu": tiers} if tiers is not None else {}), **xla}
