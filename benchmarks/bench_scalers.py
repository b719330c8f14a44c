"""Per-step cost of simulating a loss scaler vs driving the real torch GradScaler on the CPU.

Writes reports/bench_scalers.md and .json.  Run: python -m benchmarks.bench_scalers [--steps N]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import fpemu
from benchmarks._common import write_report
from fpemu.adapters import available, record_scaler


def per_step(fn, steps: int, repeats: int) -> float:
    fn()  # warm-up off the clock
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best / steps


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--real-steps", type=int, default=2_000)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    flags = rng.random(args.steps) < 0.01
    overflows = flags.tolist()
    rows = []
    for profile, params in (("torch", dict(growth_interval=100)), ("flax", dict(growth_interval=100)),
                            ("megatron", dict(growth_interval=100)), ("deepspeed", dict(scale_window=100))):
        sim = per_step(lambda: fpemu.simulate_scaler(overflows, profile, **params), args.steps, 7)
        sim_array = per_step(lambda: fpemu.simulate_scaler(flags, profile, **params), args.steps, 7)
        row = {"profile": profile, "simulate_us_per_step": sim * 1e6,
               "simulate_array_us_per_step": sim_array * 1e6}
        if profile == "torch" and available("torch"):
            real = per_step(lambda: record_scaler("torch", overflows[:args.real_steps], **params),
                            args.real_steps, 2)
            row.update(real_us_per_step=real * 1e6, speedup=real / sim)
        rows.append(row)
        print(row, flush=True)
    result = {"steps": args.steps, "real_steps": args.real_steps, "rows": rows}
    columns = [("profile", "profile"), ("simulate_us_per_step", "simulate_scaler us/step"),
               ("simulate_array_us_per_step", "simulate_scaler us/step (bool array in)"),
               ("real_us_per_step", "real GradScaler us/step (CPU)"), ("speedup", "speed-up")]
    notes = [f"{args.steps:,} steps with 1% overflows, given as a list of Python bools (the speed-up "
             "column) or as a numpy bool array; best of 7 after a warm-up. The real torch.amp.GradScaler "
             f"(CPU) runs {args.real_steps:,} steps of scale(), step(SGD) and update() on one parameter.",
             "Goal (issue 3): simulation at least 1,000x faster per step than the real GradScaler."]
    write_report("bench_scalers", "Scaler simulation cost", result, rows, columns, notes)
    return result


if __name__ == "__main__":
    main()
