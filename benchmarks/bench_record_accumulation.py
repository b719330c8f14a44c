"""Overhead of fpemu.record_torch on a loop that accumulates microbatches (a Llama from a transformers config,
CPU fp16 autocast, GradScaler, AdamW, warmup, clipping, 4 microbatches per update).

Writes reports/bench_record_accumulation.md and .json.  Run: python -m benchmarks.bench_record_accumulation
[--rounds N] [--steps N]

Modes, on one model, taking turns block by block (the order flipped every round): the plain loop; the loop under
record_torch with statistics off (the audit's own hooks and wrappers); with statistics every step (each
microbatch's gradients measured as its backward hands them over, and the compute-format maximum of the module
outputs' gradients).  Times are process CPU seconds with one torch thread.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import warnings

from benchmarks._common import TIMING_NOTE, write_report

MODES = {"plain": None, "watch only": dict(statistics=False), "statistics every step": dict()}
MODEL = dict(vocab_size=1024, hidden_size=64, intermediate_size=172, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=64)
MICRO, BATCH, LENGTH = 4, 4, 32


def _setup():
    import torch
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**MODEL))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scheduler = transformers.get_linear_schedule_with_warmup(optimizer, 5, 10_000)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=10_000)
    return model, optimizer, scheduler, scaler


def _data(steps: int) -> list:
    import torch
    generator = torch.Generator().manual_seed(1)
    return [[torch.randint(0, MODEL["vocab_size"], (BATCH, LENGTH), generator=generator) for _ in range(MICRO)]
            for _ in range(steps)]


def _train(model, optimizer, scheduler, scaler, data) -> None:
    """The user's loop: zero_grad once per update, MICRO backward passes, unscale_, clip, step, update."""
    import torch
    for step in data:
        optimizer.zero_grad()
        for tokens in step:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(tokens, labels=tokens).loss / MICRO
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()


def _block(mode, setup, data) -> float:
    """CPU seconds of the block's steps after its first (which carries the once-per-run work) in ``mode``."""
    import fpemu
    model, optimizer, scheduler, scaler = setup
    options = MODES[mode]
    with (contextlib.nullcontext() if options is None else
          fpemu.record_torch(scaler, optimizer, model, scheduler, **options)):
        _train(model, optimizer, scheduler, scaler, data[:1])
        start = time.process_time()
        _train(model, optimizer, scheduler, scaler, data[1:])
        return time.process_time() - start


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--steps", type=int, default=4, help="updates per block (at least 2)")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2: the first update of a block is timed apart")
    warnings.simplefilter("ignore")
    import torch
    torch.set_num_threads(1)
    setup, data, names = _setup(), _data(args.steps), list(MODES)
    for mode in names:  # warm-up: lazy imports, allocator state
        _block(mode, setup, data[:2])
    times = {mode: [] for mode in names}
    for round_ in range(args.rounds):
        for mode in (names if round_ % 2 == 0 else reversed(names)):
            times[mode].append(_block(mode, setup, data) / (len(data) - 1))
    plain = times["plain"]
    rows = []
    for mode in names:
        # per round, against the plain block of the same round: the ratio the alternation makes comparable
        ratios = sorted(t / p - 1 for t, p in zip(times[mode], plain))
        rows.append({"mode": mode, "step_ms": min(times[mode]) * 1e3, "overhead_best": min(times[mode]) / min(plain) - 1,
                     "overhead_median": statistics.median(times[mode]) / statistics.median(plain) - 1,
                     "overhead_range": f"{ratios[0]:+.1%} to {ratios[-1]:+.1%}",
                     "block_ms": [round(t * 1e3, 2) for t in times[mode]]})
        print({k: v for k, v in rows[-1].items() if k != "block_ms"}, flush=True)
    parameters = sum(p.numel() for p in setup[0].parameters())
    result = {"model": {**MODEL, "parameters": parameters, "microbatches": MICRO, "batch": BATCH, "length": LENGTH},
              "rounds": args.rounds, "steps_per_block": args.steps, "rows": rows,
              "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__}}
    columns = [("mode", "mode"), ("step_ms", "update of 4 microbatches, best CPU time (ms)"),
               ("overhead_best", "overhead, best vs best"), ("overhead_median", "overhead, median vs median"),
               ("overhead_range", "overhead, lowest and highest round")]
    notes = [f"Llama from transformers.LlamaConfig(hidden {MODEL['hidden_size']}, {MODEL['num_hidden_layers']} layers, "
             f"{MODEL['num_attention_heads']} heads, vocab {MODEL['vocab_size']}), random weights, {parameters:,} "
             f"parameters; {MICRO} microbatches of {BATCH}x{LENGTH} tokens per update; AdamW, linear warmup, "
             "clip_grad_norm_(1.0), torch.autocast('cpu', float16), torch.amp.GradScaler('cpu'); torch "
             f"{torch.__version__}, transformers {result['versions']['transformers']}.",
             f"Each mode runs {args.rounds} blocks of {args.steps} updates on the same model, the modes taking turns "
             "(order flipped every round), in process CPU time with one torch thread; an update's time is a block's "
             "updates after its first, divided by their number.  The best and the median update of each mode are "
             "compared with the plain loop's; the lowest and highest round compare each round's block with the "
             "plain block of the same round (where the machine's noise shows).",
             "Goal (issue 27): statistics every step cost at most 10% of an update on accumulation loops (5% "
             "wanted).",
             TIMING_NOTE]
    write_report("bench_record_accumulation", "fpemu.record_torch overhead on a Llama loop accumulating 4 "
                 "microbatches", result, rows, columns, notes)
    return result


if __name__ == "__main__":
    main()
