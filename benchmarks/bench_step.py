"""Cost of an emulated mixed-precision training step vs the same step in plain float32 numpy.

Writes reports/bench_step.md and .json.  Run: python -m benchmarks.bench_step [--repeats N]
"""

from __future__ import annotations

import argparse

import numpy as np

from benchmarks._common import best_times_interleaved, minor_page_faults, write_report
from fpemu.steps import mixed_precision_step


def plain_step(params, x, y, loss_scale, good_steps, lr, growth_interval):
    """The seed's step with every op in float32 numpy: no casts, no rounding control."""
    w, b = params["w"], params["b"]
    sub = x @ w + b - y
    loss = np.mean(sub * sub)
    cotangent = sub * (loss_scale * np.float32(2.0 / sub.size))
    grad_w, grad_b = (x.T @ cotangent) / loss_scale, cotangent.sum(axis=0) / loss_scale
    finite = bool(np.isfinite(grad_w).all() and np.isfinite(grad_b).all())
    if not finite:
        return {"loss": loss, "params": params, "loss_scale": max(loss_scale * np.float32(0.5), np.float32(1)),
                "good_steps": 0, "grads_finite": False}
    counted = good_steps + 1
    grow = counted >= growth_interval
    return {"loss": loss, "params": {"w": w - lr * grad_w, "b": b - lr * grad_b},
            "loss_scale": loss_scale * np.float32(2) if grow else loss_scale, "good_steps": 0 if grow else counted,
            "grads_finite": True}


def case(batch: int, dim: int, out: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    f32 = np.float32
    return dict(params={"w": rng.standard_normal((dim, out)).astype(f32), "b": rng.standard_normal(out).astype(f32)},
                x=rng.standard_normal((batch, dim)).astype(f32), y=rng.standard_normal((batch, out)).astype(f32),
                loss_scale=f32(1024.0), good_steps=0, lr=f32(1e-3), growth_interval=2000)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    rows = []
    for shape, compute, mode in [((256, 512, 256), "bf16", "numpy"), ((256, 512, 256), "fp16", "numpy"),
                                 ((1024, 1024, 512), "bf16", "numpy"), ((1024, 1024, 512), "fp16", "numpy"),
                                 ((4, 4, 4), "bf16", "jax_cpu_strict"),
                                 ((4, 4, 4), "bf16", "torch_cpu")]:
        inputs = case(*shape)
        def plain():
            return plain_step(**inputs)
        def emulated():
            return mixed_precision_step(**inputs, compute=compute, mode=mode)
        (plain_s, _), (emulated_s, _) = best_times_interleaved([plain, emulated], args.repeats)
        row = {"shape": "x".join(map(str, shape)), "compute": compute, "mode": mode, "plain_us": plain_s * 1e6,
               "emulated_us": emulated_s * 1e6, "ratio": emulated_s / plain_s,
               "plain_faults": minor_page_faults(plain, args.repeats),
               "emulated_faults": minor_page_faults(emulated, args.repeats)}
        rows.append(row)
        print(row, flush=True)
    result = {"repeats": args.repeats, "rows": rows}
    columns = [("shape", "B x D x K"), ("compute", "compute"), ("mode", "semantics"),
               ("plain_us", "plain float32 numpy (us)"), ("emulated_us", "emulated step (us)"),
               ("ratio", "ratio"), ("plain_faults", "plain page faults per step"),
               ("emulated_faults", "emulated page faults per step")]
    notes = ["One step of seed 002's linear model (forward, loss, backward of S * loss, unscale, update, "
             "scale rule); best of the repeats.",
             "Goal (issue 4): an emulated training step costs at most 3x the plain float32 numpy step; it "
             "applies to training-sized steps under the 'numpy' semantics (BLAS matmul, numpy sums).",
             "The bit-exact presets (jax_cpu_strict, torch_cpu) replay the frameworks' accumulation orders "
             "one float32 operation at a time; at the seed's 4x4x4 the ratio is Python call overhead, "
             "listed for reference, not a training-sized cost.",
             "The two steps take turns (order flipped every round) after one untimed call each. Page "
             "faults are minor faults per step (getrusage): a step whose peak memory exceeds what glibc "
             "keeps between calls faults its pages in again every time, which once cost the emulated "
             "256x512x256 step ~600 faults and ~0.9 ms; it now keeps only what its backward reads."]
    write_report("bench_step", "Emulated mixed-precision step vs plain float32 numpy", result, rows, columns, notes)
    return result


if __name__ == "__main__":
    main()
