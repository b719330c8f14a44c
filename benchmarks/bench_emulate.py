"""Cost of an emulated training step (fpemu.emulate_torch) vs the same model's plain float32 eager step.

The model is examples/gpt2_emulate.py: transformers' GPT-2, 4 layers, d=256, 4 heads, 1024-token
vocabulary, batch 8 x 64 tokens, AdamW.  Both steps run with one intra-op thread (on a shared machine
torch's thread pool makes small elementwise ops up to 100x slower, which would hide what the emulation
costs).  Writes reports/bench_emulate.md and .json.  Run: python -m benchmarks.bench_emulate [--repeats N]
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import time

from benchmarks._common import TIMING_NOTE, write_report

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "gpt2_emulate.py"
PROTOTYPE_RATIO = 2.5  # the prototype: every op's output rounded per autocast's dtypes
POLICIES = ("cuda_autocast_fp16", "cuda_autocast_bf16", "pure_bf16", "fp8", "fp8_delayed")


def _example():
    spec = importlib.util.spec_from_file_location("gpt2_emulate", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    import torch
    from fpemu.emulate._torch_loop import EmulatedScaler
    from fpemu.emulate._torch_mode import emulate_torch
    torch.set_num_threads(1)
    example = _example()
    model, optimizer = example.build(0)
    plain = torch.amp.GradScaler("cpu", enabled=False)
    index = iter(range(10 ** 6))

    def plain_step():
        example.step(model, optimizer, plain, next(index))

    def run(scaler):
        example.step(model, optimizer, scaler, next(index))

    def emulated(policy, scaler):
        with emulate_torch(policy, model=model):  # entering installs the table's kernels: not timed
            start = time.perf_counter()
            run(scaler)
            return time.perf_counter() - start

    rows = []
    for policy in POLICIES:
        scaler = EmulatedScaler("torch", {"init_scale": 2.0 ** 10})
        run(plain), emulated(policy, scaler)  # warm-up: lazy imports, op readings, result dtypes
        plain_time = emulated_time = float("inf")
        for _ in range(args.repeats):  # alternating, so both see the same load on a shared machine
            start = time.perf_counter()
            run(plain)
            plain_time = min(plain_time, time.perf_counter() - start)
            emulated_time = min(emulated_time, emulated(policy, scaler))
        rows.append({"policy": policy, "plain_ms": plain_time * 1e3, "emulated_ms": emulated_time * 1e3,
                     "ratio": emulated_time / plain_time, "prototype": PROTOTYPE_RATIO})
    result = {"model": "GPT-2 4 layers, d=256, 4 heads, vocab 1024, batch 8x64, AdamW", "threads": 1,
              "torch": torch.__version__, "rows": rows}
    write_report("bench_emulate", "Emulated training step vs plain float32 eager step", result, rows,
                 [("policy", "policy"), ("plain_ms", "plain float32 step (ms)"), ("emulated_ms", "emulated step (ms)"),
                  ("ratio", "ratio"), ("prototype", "prototype's ratio")],
                 [result["model"] + f", torch {torch.__version__}, one intra-op thread, best of {args.repeats}.",
                  "The emulated step includes the telemetry (per-op and per-module counts, forward and backward) "
                  "and fpemu's scaler (its unscale and inf check in numpy).",
                  "The prototype's 2.5x is the issue's figure for a dispatch mode that rounded every op's output "
                  "per autocast's dtypes (no telemetry).",
                  TIMING_NOTE])
    return result


if __name__ == "__main__":
    main()
