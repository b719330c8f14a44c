"""The fixed cost per step of fpemu.record_torch: what it adds to a step whatever the step computes.

Writes reports/bench_record_fixed.md and .json.  Run: python -m benchmarks.bench_record_fixed [--rounds N]
[--steps N]

Models of tiny Linear(8, 8) layers (1, 4 and 16 of them: one gradient group each), so a step's own work
is small and what the recorder adds is its per-step bookkeeping: per attempt (the scale, found-inf, the
scaler's state, loss and norm read back to the host) and per group (the statistics).  A line through the
three sizes splits the added time into a fixed part per step (its intercept) and a part per group (its
slope).  The loop is the downstream example's: fp16 CPU autocast, GradScaler, 4 microbatches, clipping.
Modes take turns round by round, in process CPU time with one torch thread (bench_record.py's method).
"""

from __future__ import annotations

import argparse
import contextlib
import time

from benchmarks._common import TIMING_NOTE, write_report

MODES = {"plain": None, "watch only": dict(statistics=False), "statistics every step": dict(),
         "statistics + shadow every step": dict(shadow_every=1)}
LAYERS = (1, 4, 16)
MICROBATCHES = 4


def _setup(layers: int):
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(layers)])
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=10 ** 9)
    data = torch.randn(MICROBATCHES, 4, 8)
    return model, optimizer, scaler, data


def _steps(setup, count: int, recorder) -> None:
    import torch
    model, optimizer, scaler, data = setup
    for _ in range(count):
        optimizer.zero_grad(set_to_none=True)
        for micro in range(MICROBATCHES):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(data[micro]).float().pow(2).mean() / MICROBATCHES
            scaler.scale(loss).backward()
        if recorder is not None:
            recorder.shadow(lambda: model(data.reshape(-1, 8)).pow(2).mean())
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()


def _block(mode: str, setup, steps: int) -> float:
    """CPU seconds per step of ``steps`` steps after a first one (which carries once-per-run work)."""
    import fpemu
    model, optimizer, scaler, _ = setup
    options = MODES[mode]
    with (contextlib.nullcontext() if options is None else
          fpemu.record_torch(scaler, optimizer, model, **options)) as recorder:
        _steps(setup, 1, recorder)
        start = time.process_time()
        _steps(setup, steps, recorder)
        return (time.process_time() - start) / steps


def _fit(xs, ys) -> tuple:
    """(intercept, slope) of the least-squares line through (xs, ys)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def main(argv=None) -> dict:
    import torch
    torch.set_num_threads(1)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args(argv)
    best = {(layers, mode): float("inf") for layers in LAYERS for mode in MODES}
    setups = {layers: _setup(layers) for layers in LAYERS}
    for round_index in range(args.rounds):
        order = list(MODES) if round_index % 2 == 0 else list(MODES)[::-1]
        for layers in LAYERS:
            for mode in order:
                best[layers, mode] = min(best[layers, mode], _block(mode, setups[layers], args.steps))
    rows, fits = [], {}
    for mode in MODES:
        added = [(best[layers, mode] - best[layers, "plain"]) * 1e3 for layers in LAYERS]
        fixed, per_group = _fit(LAYERS, added) if MODES[mode] is not None else (0.0, 0.0)
        fits[mode] = {"fixed_ms": fixed, "per_group_ms": per_group}
        rows.append({"mode": mode, **{f"step_{n}": best[n, mode] * 1e3 for n in LAYERS},
                     "fixed_ms": fixed, "per_group_ms": per_group})
    for row in rows:
        print(row, flush=True)
    result = {"layers": list(LAYERS), "microbatches": MICROBATCHES, "rounds": args.rounds, "steps_per_block": args.steps,
              "torch": torch.__version__, "step_ms": {f"{mode} / {n}": best[n, mode] * 1e3 for n in LAYERS
                                                     for mode in MODES}, "fit": fits}
    columns = ([("mode", "mode")] + [(f"step_{n}", f"step, {n} group{'s' if n > 1 else ''} (ms)") for n in LAYERS]
               + [("fixed_ms", "added per step, fixed (ms)"), ("per_group_ms", "added per step and group (ms)")])
    notes = [f"torch {torch.__version__} CPU, one thread; Sequential of 1, 4, 16 Linear(8, 8) (each a gradient group), "
             f"{MICROBATCHES} microbatches of 4 under torch.autocast('cpu', float16), GradScaler('cpu'), "
             "clip_grad_norm_(1.0), SGD.",
             f"Best of {args.rounds} blocks of {args.steps} steps per mode and size, the modes taking turns (order "
             "flipped every round), process CPU time; the first step of each block (once-per-run work) is not counted.",
             "Added per step = the mode's step time less the plain step's, at each size; a least-squares line through "
             "the three sizes gives the fixed part (intercept: per attempt, whatever the model) and the part per "
             "gradient group (slope).  The shadow row's slope includes its float32 forward and backward.",
             TIMING_NOTE]
    write_report("bench_record_fixed", "fpemu.record_torch: its fixed cost per step", result, rows, columns, notes)
    return result


if __name__ == "__main__":
    main()
