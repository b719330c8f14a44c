"""Does torch.compile compute seed 002's step like torch eager?  Compare both with the emulation.

torch.compile (inductor, CPU) takes 5-20 s to compile each shape, so by default this runs one
shape per shape class of docs/steps.md (inductor's code depends on which of B, D, K are 1),
and lives here rather than in the tests; ``--all`` runs all 64 shapes with B, D, K in 1..4.
For each shape it draws seeded cases (magnitudes that reach overflow and underflow, +-0,
subnormals), runs the eager and the compiled step, and counts per output the cases whose
float32 bits differ (NaN-aware) from the ``torch_cpu`` emulation (eager and compiled) and from
the ``torch_cpu_compiled`` emulation (compiled).  Writes reports/torch_compile.md and .json.

Run: python -m benchmarks.torch_compile_diff [--cases N] [--all]
"""

from __future__ import annotations

import argparse

import numpy as np

from benchmarks._common import write_report
from fpemu.steps import mixed_precision_step

# One shape per class (docs/steps.md): B, D, K >= 2 (ATen addmm/mm), then the decomposed ones.
SHAPES = [(2, 3, 2), (4, 4, 4), (3, 2, 1), (4, 1, 1), (3, 1, 2), (2, 1, 3),
          (1, 1, 1), (1, 1, 3), (1, 3, 1), (1, 2, 3), (1, 4, 4)]
ALL_SHAPES = [(b, d, k) for b in range(1, 5) for d in range(1, 5) for k in range(1, 5)]
OUTPUTS = ("loss", "w", "b", "loss_scale")
EDGES = np.array([0.0, -0.0, 1.0, -3.0, 2.0 ** 100, -2.0 ** 120, 2.0 ** -100, -2.0 ** -130, 1e-40, -3e-39, 3.3e38],
                 np.float32)
RANGES = [(-30, 30), (-140, 127), (-5, 5), (-130, -100), (60, 127)]  # log2 magnitudes, one per case in turn


def _cases(shape, count: int, seed: int):
    rng = np.random.default_rng(seed)
    batch, features, outputs = shape
    for index in range(count):
        low, high = RANGES[index % len(RANGES)]

        def draw(*dims):
            normal = rng.standard_normal(dims) * np.exp2(rng.uniform(low, high, dims))
            normal = np.clip(normal, -3.4e38, 3.4e38).astype(np.float32)
            return np.where(rng.random(dims) < 0.2, rng.choice(EDGES, dims), normal).astype(np.float32)
        yield dict(params={"w": draw(features, outputs), "b": draw(outputs)}, x=draw(batch, features),
                   y=draw(batch, outputs), loss_scale=np.float32(2.0 ** rng.integers(-10, 100)), good_steps=0,
                   lr=np.float32(0.01), growth_interval=2)


def _outputs(result) -> dict:
    return {"loss": result["loss"], "w": result["params"]["w"], "b": result["params"]["b"],
            "loss_scale": result["loss_scale"]}


def _differs(a, b) -> bool:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return bool(np.any((a.view(np.uint32) != b.view(np.uint32)) & ~(np.isnan(a) & np.isnan(b))))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=None, help="cases per shape (default 200, 50 with --all)")
    parser.add_argument("--all", action="store_true", help="all 64 shapes with B, D, K in 1..4")
    args = parser.parse_args(argv)
    cases = args.cases or (50 if args.all else 200)
    import torch
    from fpemu.adapters.torch_step import torch_step
    rows = []
    impls = ("eager", "compiled", "compiled_vs_preset")
    for shape in ALL_SHAPES if args.all else SHAPES:
        torch._dynamo.reset()  # one compiled graph per shape; dynamo's recompile limit is 8
        counts = {f"{impl}_{out}": 0 for impl in impls for out in OUTPUTS}
        counts["grads_finite"] = 0
        for case in _cases(shape, cases, seed=sum(shape) + 100 * shape[0] + 10 * shape[1]):
            with np.errstate(all="ignore"):
                expected = _outputs(mixed_precision_step(**case, mode="torch_cpu"))
                compiled_result = mixed_precision_step(**case, mode="torch_cpu_compiled")
            compiled_expected = _outputs(compiled_result)
            for impl, compiled in (("eager", False), ("compiled", True)):
                result = torch_step(**case, compiled=compiled)
                got = _outputs(result)
                for out in OUTPUTS:
                    counts[f"{impl}_{out}"] += _differs(expected[out], got[out])
                    if compiled:
                        counts[f"compiled_vs_preset_{out}"] += _differs(compiled_expected[out], got[out])
                if compiled:
                    counts["grads_finite"] += bool(compiled_result["grads_finite"]) != bool(result["grads_finite"])
        rows.append({"shape": "x".join(map(str, shape)), "cases": cases, **counts})
        print(rows[-1], flush=True)
    labels = {"eager": "eager vs torch_cpu", "compiled": "compiled vs torch_cpu",
              "compiled_vs_preset": "compiled vs torch_cpu_compiled"}
    columns = [("shape", "B x D x K"), ("cases", "cases")] + [
        (f"{impl}_{out}", f"{labels[impl]}: {out}") for impl in impls for out in OUTPUTS] + [
        ("grads_finite", "compiled vs torch_cpu_compiled: grads_finite")]
    notes = ["Cases whose float32 bits differ (NaN-aware) from fpemu's emulation of seed 002's bf16 "
             "step; data normal * 2^U(lo, hi) with (lo, hi) cycling through (-30, 30), (-140, 127), (-5, 5), "
             "(-130, -100), (60, 127), each element replaced with probability 0.2 by one of +-0, 1, -3, "
             "2^100, -2^120, 2^-100, -2^-130, 1e-40, -3e-39, 3.3e38; scales 2^-10..2^99.",
             "eager vs torch_cpu should be 0 (fitted to torch eager).  compiled vs torch_cpu shows where "
             "inductor's generated code computes something else: with B, D, K >= 2 bf16 addmm with the bias "
             "fused before the one rounding, a 16-lane butterfly loss sum, and a bias gradient left in float32; "
             "with a dimension of 1 the decomposed matmuls also skip the bf16 rounding of x, w, b, the "
             "prediction or the cotangent, depending on the shape class (docs/steps.md).",
             "compiled vs torch_cpu_compiled should be 0 for every shape (grads_finite: cases whose "
             "overflow verdict differs).",
             f"Run: python -m benchmarks.torch_compile_diff{' --all' if args.all else ''} --cases {cases} "
             f"(torch {torch.__version__}, inductor on the CPU)."]
    result = {"rows": rows}
    write_report("torch_compile", "torch.compile vs torch eager vs the emulation", result, rows, columns, notes)
    return result


if __name__ == "__main__":
    main()
