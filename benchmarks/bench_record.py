"""Overhead of fpemu.record_torch on a GPT-2-like training step (CPU, fp16 autocast, GradScaler).

Writes reports/bench_record.md and .json.  Run: python -m benchmarks.bench_record [--rounds N] [--steps N]

Modes, on one model, taking turns round by round: the plain loop; the loop under record_torch with
statistics every step (no shadow pass); the same with the float32 shadow pass every step (its cost,
which shadow_every=N divides by N; its counting and histogram are also timed apart); the loop under record_torch with statistics off (the watcher's
own cost).  Times are process CPU seconds with one torch thread (a contended machine stretches wall
time far more than CPU time).  Memory: the growth of each mode's peak resident set over the loop in a
fresh process, and the peak growth while measuring one 2^26-element gradient (256 MiB).
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import resource
import subprocess
import sys
import time
import warnings

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

from benchmarks._common import TIMING_NOTE, write_report  # noqa: E402
from fpemu.recorders.torch_run import CHUNK  # noqa: E402

MODES = {"plain": None, "watch only": dict(statistics=False), "statistics every step": dict(),
         "statistics + shadow every step": dict(shadow_every=1)}
MODEL = dict(layers=4, width=64, heads=4, vocab=1024, context=64)
BATCH, LENGTH = 4, 32


def _setup():
    import gpt2_loop
    model = gpt2_loop.make_model(**MODEL)
    optimizer, scheduler, scaler = gpt2_loop.make_training(model, steps=10_000)
    return gpt2_loop, model, optimizer, scheduler, scaler


def _block(mode, setup, data) -> tuple:
    """(CPU seconds of the block's steps after the first, CPU seconds of entering, the first step and
    leaving) in ``mode``: the first step carries once-per-run work (the audit's range statistics of the
    first update), so it is timed with entering and leaving, apart from the steady steps."""
    import fpemu
    gpt2_loop, model, optimizer, scheduler, scaler = setup
    options = MODES[mode]
    start = time.process_time()
    with (contextlib.nullcontext() if options is None else
          fpemu.record_torch(scaler, optimizer, model, scheduler, **options)) as rec:
        gpt2_loop.train(model, optimizer, scheduler, scaler, data[:1], recorder=rec)
        first = time.process_time()
        gpt2_loop.train(model, optimizer, scheduler, scaler, data[1:], recorder=rec)
        stepped = time.process_time()
    return stepped - first, first - start + time.process_time() - stepped


def _max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _in_child(function: str, *args) -> float:
    """Run ``function(*args)`` of this module in a fresh process (one torch thread); its printed number."""
    code = (f"import sys; sys.path[:0] = [{str(ROOT)!r}]; import torch; torch.set_num_threads(1); "
            f"import benchmarks.bench_record as b; b.{function}(*{args!r})")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def _loop_growth_child(mode: str, steps: int) -> None:
    """Prints MiB: how far the peak resident set grew while ``steps`` steps ran in ``mode``."""
    import gpt2_loop
    warnings.simplefilter("ignore")
    setup = _setup()
    data = gpt2_loop.batches(steps, BATCH, LENGTH, MODEL["vocab"])
    _block("plain", setup, data[:1])  # the first step's allocations are the loop's, not the mode's
    before = _max_rss_mib()
    _block(mode, setup, data)
    print(_max_rss_mib() - before)


def _statistics_growth_child(elements: int) -> None:
    """Prints MiB: peak resident-set growth while the recorder measures one gradient of ``elements``."""
    import torch
    from fpemu.recorders.torch_run import _batch_measures, _class_bounds, _pieces
    grad = torch.empty(elements).normal_(std=1e-4)  # one allocation: no larger transient before
    edges = _class_bounds(torch, "fp16")
    _batch_measures(torch, [grad[:1024]], edges)
    before = _max_rss_mib()
    for piece in _pieces(grad):  # as TorchRecorder._measure does: one piece at a time
        _batch_measures(torch, [piece], edges)
    print(_max_rss_mib() - before)


def _shadow_counting(setup, tokens, repeats: int) -> dict:
    """CPU ms the shadow pass spends counting, beyond its float32 forward and backward, per sampled step:
    the element-by-element true underflow against the run's gradients, and the binade histogram of the
    float32 gradients (what replays recount from).  Best of ``repeats``, over every parameter."""
    import torch
    from fpemu.recorders.torch_run import _class_bounds, _shadow_counts, _shadow_histograms
    _, model, *_ = setup
    params = [p for p in model.parameters() if p.grad is not None]
    with torch.autocast("cpu", enabled=False):
        shadow = torch.autograd.grad(model(tokens, labels=tokens).loss, params)
    edges = _class_bounds(torch, "fp16")
    parts = {"true_underflow": lambda: [_shadow_counts(torch, g, p.grad, 1.0, edges).tolist()
                                        for g, p in zip(shadow, params)],
             "histogram": lambda: _shadow_histograms(torch, list(enumerate(shadow)), len(shadow)).tolist()}
    out = {}
    for name, part in parts.items():
        part()
        best = float("inf")
        for _ in range(repeats):
            start = time.process_time()
            part()
            best = min(best, time.process_time() - start)
        out[f"{name}_ms"] = best * 1e3
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="steps per block (at least 2)")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2: the first step of a block is timed apart")
    warnings.simplefilter("ignore")
    import torch
    torch.set_num_threads(1)
    setup = _setup()
    import gpt2_loop
    data = gpt2_loop.batches(args.steps, BATCH, LENGTH, MODEL["vocab"])
    names = list(MODES)
    for mode in names:  # warm-up: lazy imports, allocator state
        _block(mode, setup, data[:1])
    best = {mode: float("inf") for mode in names}
    fixed = {mode: float("inf") for mode in names}  # entering and leaving the recorder
    for round_ in range(args.rounds):
        for mode in (names if round_ % 2 == 0 else reversed(names)):
            steps, once = _block(mode, setup, data)
            best[mode], fixed[mode] = min(best[mode], steps), min(fixed[mode], once)
    per_step = {mode: best[mode] / (len(data) - 1) for mode in names}
    # what entering, the first step and leaving add to a step (timing noise can take plain's below 0)
    fixed = {mode: max(fixed[mode] - per_step[mode], 0.0) for mode in names}
    model = setup[1]
    grads = [p.numel() for p in model.parameters()]
    plain = per_step["plain"]
    rows = [{"mode": mode, "step_ms": per_step[mode] * 1e3, "overhead": per_step[mode] / plain - 1,
             "fixed_ms": fixed[mode] * 1e3,
             "rss_growth_mib": _in_child("_loop_growth_child", mode, args.steps)} for mode in names]
    counting = _shadow_counting(setup, data[0], args.rounds)
    float32_pass = per_step["statistics + shadow every step"] - per_step["statistics every step"] - sum(
        counting.values()) / 1e3
    big = 1 << 26
    statistics_growth = _in_child("_statistics_growth_child", big)
    for row in rows:
        print(row, flush=True)
    result = {"model": {**MODEL, "batch": BATCH, "length": LENGTH, "parameters": sum(grads),
                        "largest_tensor": max(grads)},
              "rounds": args.rounds, "steps_per_block": args.steps, "rows": rows,
              "shadow_pass_ms": {**counting, "float32_pass_ms": float32_pass * 1e3},
              "statistics_peak_growth_mib": {"elements": big, "gradient_mib": big * 4 / 2 ** 20,
                                             "growth_mib": statistics_growth}}
    columns = [("mode", "mode"), ("step_ms", "step, CPU time (ms)"), ("overhead", "overhead vs plain"),
               ("fixed_ms", "once per run: enter, exit, first step's extra (ms)"),
               ("rss_growth_mib", "peak RSS growth over the loop (MiB)")]
    notes = [f"GPT-2 from transformers.GPT2Config(n_layer={MODEL['layers']}, n_embd={MODEL['width']}, "
             f"n_head={MODEL['heads']}, vocab {MODEL['vocab']}), random weights, {sum(grads):,} parameters; "
             f"batch {BATCH}x{LENGTH} tokens; AdamW, linear warmup, clip_grad_norm_(1.0), "
             "torch.autocast('cpu', float16), torch.amp.GradScaler('cpu').",
             f"Each mode runs {args.rounds} blocks of {args.steps} steps on the same model, the modes taking "
             "turns (order flipped every round), in process CPU time with one torch thread.  A step's time is "
             "the best block's time of its steps after the first, divided by their number.  Once per run "
             "(best of the blocks): entering the recorder, the first step and leaving, less one step's time "
             "(at least 0): "
             "mostly finding every loaded module's reference to the clipping functions (which grows with "
             "the modules loaded: transformers loads thousands) and the audit's range statistics of the first "
             "update.",
             "Goal (issue 11): statistics every step cost at most 10% of a step.  The shadow row is the "
             "float32 forward+backward the shadow pass adds when it runs every step, with its counting; "
             "shadow_every=N costs about 1/N of that difference per step.",
             f"Of a shadow pass ({(per_step['statistics + shadow every step'] - per_step['statistics every step']) * 1e3:.1f}"
             f" ms, the shadow row less the statistics row): counting the true underflow element by element "
             f"{counting['true_underflow_ms']:.1f} ms, the binade histogram of the float32 gradients (what a replay "
             f"recounts underflow from at another scale or format) {counting['histogram_ms']:.1f} ms "
             f"({counting['histogram_ms'] / (plain * 1e3):.1%} of a plain step; times timed apart over every "
             f"parameter, best of {args.rounds}), the float32 forward and backward the rest "
             f"({float32_pass * 1e3:.1f} ms).",
             f"Memory: statistics are computed at most 2^{CHUNK.bit_length() - 1} elements at a time (small "
             "gradients together, a large one in pieces) on the tensors' own device; measuring one "
             f"2^26-element float32 gradient ({big * 4 / 2 ** 20:.0f} MiB) grew the peak resident set by "
             f"{statistics_growth:.0f} MiB (about {statistics_growth * 2 ** 20 / CHUNK:.0f} bytes per element "
             "measured at once).  The trace keeps a few numbers per group per step.",
             TIMING_NOTE]
    write_report("bench_record", "fpemu.record_torch overhead on a GPT-2-like step", result, rows, columns, notes)
    return result


if __name__ == "__main__":
    main()
