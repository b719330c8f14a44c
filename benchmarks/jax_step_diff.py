"""Does the emulation compute seed 002's step as jax.jit does on this CPU?  Every shape, format, mode.

The XLA presets' orders depend on the shape (B, D, K in 1..4), so this sweeps all 64 shapes for
bf16, fp16, fp8_e4m3fn and fp8_e5m2 in both XLA flag modes (one compile per shape, format and
mode: a few minutes), which the tests cannot afford; they pin one shape per class.  Each shape
gets ``fpemu.steps.probes.edge_cases``: magnitudes that reach overflow and underflow with +-0
and subnormals, and probe cases whose products overflow, underflow or are signed zeros, the
inputs that tell the dot orders apart.  Counts per output the cases whose float32 bits
differ (NaN-aware) from ``fpemu.adapters.jax_step.host_semantics(mode)``.  Writes
reports/jax_step.md and .json.

Run: python -m benchmarks.jax_step_diff [--cases N]
"""

from __future__ import annotations

import argparse
import zlib

import numpy as np

from benchmarks._common import write_report
from benchmarks.torch_compile_diff import ALL_SHAPES
from fpemu.steps import mixed_precision_step
from fpemu.steps.probes import edge_cases

FORMATS = ("bf16", "fp16", "fp8_e4m3fn", "fp8_e5m2")
MODES = ("jax_cpu", "jax_cpu_strict")
OUTPUTS = ("loss", "w", "b", "loss_scale", "grads_finite")
def _differs(a, b) -> bool:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return bool(np.any((a.view(np.uint32) != b.view(np.uint32)) & ~(np.isnan(a) & np.isnan(b))))


def _mismatches(emulated, real) -> dict:
    pairs = {"loss": (emulated["loss"], real["loss"]), "w": (emulated["params"]["w"], real["params"]["w"]),
             "b": (emulated["params"]["b"], real["params"]["b"]),
             "loss_scale": (emulated["loss_scale"], real["loss_scale"])}
    found = {name: _differs(*pair) for name, pair in pairs.items()}
    found["grads_finite"] = bool(emulated["grads_finite"]) != bool(real["grads_finite"])
    return found


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=30, help="cases per shape, format and mode")
    args = parser.parse_args(argv)
    import jax
    from fpemu.host import cpu_flags
    from fpemu.adapters.jax_step import host_semantics, run_jax_steps
    rows = []
    for mode in MODES:
        semantics = host_semantics(mode)
        for compute in FORMATS:
            counts = {name: 0 for name in OUTPUTS}
            failing = []
            for shape in ALL_SHAPES:
                drawn = edge_cases(shape, args.cases, seed=zlib.crc32(f"{shape}{compute}{mode}".encode()))
                for case, real in zip(drawn, run_jax_steps(drawn, mode=mode, compute=compute)):
                    with np.errstate(all="ignore"):
                        found = _mismatches(mixed_precision_step(**case, mode=semantics, compute=compute), real)
                    for name, differs in found.items():
                        counts[name] += differs
                    if any(found.values()) and "x".join(map(str, shape)) not in failing:
                        failing.append("x".join(map(str, shape)))
            rows.append({"mode": mode, "semantics": semantics, "compute": compute, "cases": args.cases * 64,
                         **counts, "shapes_differing": ", ".join(failing) or "none"})
            print(rows[-1], flush=True)
    isa = "avx512fp16" if "avx512fp16" in cpu_flags() else "avx512f" if "avx512f" in cpu_flags() else "avx2"
    columns = [("mode", "XLA flags"), ("semantics", "preset"), ("compute", "compute"), ("cases", "cases")] + [
        (name, name) for name in OUTPUTS] + [("shapes_differing", "shapes with a mismatch")]
    notes = ["Cases whose float32 bits differ (NaN-aware) between jax.jit and the emulation, over all 64 shapes "
             "with B, D, K in 1..4; fpemu.steps.probes.edge_cases: random data and, every third case, probe "
             "data (products that overflow, underflow or give signed zeros), growth intervals 1..3.",
             f"Run: python -m benchmarks.jax_step_diff --cases {args.cases} (jax {jax.__version__}, XLA:CPU, "
             f"widest vector ISA {isa})."]
    result = {"rows": rows}
    write_report("jax_step", "jax.jit vs the emulation, every shape", result, rows, columns, notes)
    return result


if __name__ == "__main__":
    main()
