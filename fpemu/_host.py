"""What a recorded run's numerics depend on besides package versions: the CPU, Python and flags.

Only traces of real implementations carry this; reference traces carry nothing of the host.
"""

from __future__ import annotations

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


def host_provenance() -> dict:
    """The host facts a recorded trace keeps: platform, machine, Python, numeric CPU features, the
    numerics-changing environment variables that are set and, where torch is imported, its CPU tiers."""
    flags = cpu_flags()
    tiers = torch_cpu_tiers()
    return {"platform": platform.platform(), "machine": platform.machine(),
            "python": sys.version.split()[0],
            "cpu_features": sorted(f for f in NUMERIC_CPU_FEATURES if f in flags),
            "flags": {name: os.environ[name] for name in NUMERIC_FLAGS if name in os.environ},
            **({"torch_cpu": tiers} if tiers is not None else {})}
