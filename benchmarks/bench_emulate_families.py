"""Emulation cost per model family: an emulated training step against the plain float32 step.

The families are tests/model_families.py's (ResNet-18 on 2x3x32x32, tiny transformers Llama, GPT-2
with SDPA, BERT, T5, ViT from configs, an LSTM), each step forward + backward + SGD under the policy
(``emulate_torch`` with fpemu's scaler and the full telemetry: cuda_autocast_fp16, cpu_autocast_bf16 and
fp8_delayed), beside real CPU bf16 autocast (the run the CPU table is checked against; where it raises, as
a bf16 LSTM does without oneDNN bf16 kernels, the report says so).  Best of ``--repeats``, the runs alternating so that all see
the same load.  Writes reports/bench_emulate_families.md and .json.
Run: python -m benchmarks.bench_emulate_families [--repeats 3]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

from benchmarks._common import TIMING_NOTE, write_report

POLICIES = ("cuda_autocast_fp16", "cpu_autocast_bf16", "fp8_delayed")


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _family_row(name, build, repeats, torch):
    from fpemu.emulate._torch_loop import EmulatedScaler
    from fpemu.emulate._torch_mode import emulate_torch
    torch.manual_seed(0)
    model, loss_of = build()
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step(scaler, autocast=None):
        optimizer.zero_grad()
        with autocast or torch.autocast("cpu", enabled=False):
            loss = loss_of(model, 0)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

    def plain():
        step(torch.amp.GradScaler("cpu", enabled=False))

    def real_bf16():
        step(torch.amp.GradScaler("cpu", init_scale=2.0 ** 10), torch.autocast("cpu", dtype=torch.bfloat16))

    def emulated(policy):
        scaler = EmulatedScaler("torch", {"init_scale": 2.0 ** 10})
        with emulate_torch(policy, model=model):  # entering installs the table's kernels: not timed
            return _timed(lambda: step(scaler))

    runs = {"plain": lambda: _timed(plain), "real_bf16": lambda: _timed(real_bf16),
            **{policy: (lambda p=policy: emulated(p)) for policy in POLICIES}}
    refused = {}
    for key, run in runs.items():  # warm-up: lazy imports, op readings, result dtypes, oneDNN primitives
        try:
            run()
        except RuntimeError as error:  # real CPU autocast where oneDNN has no kernel (a bf16 LSTM without AVX512_BF16)
            refused[key] = str(error).splitlines()[0][:80]
    runs = {key: run for key, run in runs.items() if key not in refused}
    best = {key: float("inf") for key in runs}
    for _ in range(repeats):
        for key, run in runs.items():
            best[key] = min(best[key], run())
    ratio = lambda key: best[key] / best["plain"] if key in best else None  # noqa: E731
    row = {"family": name, "plain_ms": best["plain"] * 1e3, "real_bf16_ratio": ratio("real_bf16")}
    row.update({f"{policy}_ratio": ratio(policy) for policy in POLICIES})
    row["refused"] = refused
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    import torch
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import model_families
    torch.set_num_threads(1)
    rows = [_family_row(name, build, args.repeats, torch) for name, build in model_families.FAMILIES.items()]
    from fpemu.host import host_provenance
    features = host_provenance(packages=())["cpu_features"]
    result = {"torch": torch.__version__, "threads": 1, "repeats": args.repeats, "cpu_features": features,
              "rows": rows}
    refusals = [f"{row['family']}: {key} raised ({why})" for row in rows for key, why in row["refused"].items()]
    write_report("bench_emulate_families", "Emulated training step vs plain float32 step, per model family", result,
                 rows, [("family", "family"), ("plain_ms", "plain float32 step (ms)"),
                        ("real_bf16_ratio", "real CPU bf16 autocast / plain"),
                        *((f"{policy}_ratio", f"emulated {policy} / plain") for policy in POLICIES)],
                 [f"torch {torch.__version__}, one intra-op thread, best of {args.repeats}; models of "
                  "tests/model_families.py (random init, their seeded batch 0).",
                  f"CPU features that change numerics or speed: {', '.join(features) or 'none'}.",
                  "The emulated step includes the telemetry (per-op and per-module counts) and fpemu's scaler; "
                  "fp8_delayed casts every matrix product's operands to fp8 with Transformer Engine's delayed scaling (an amax history per cast), the telemetry and the per-cast amax and scale records included.",
                  *(["Not timed (the run raised here): " + "; ".join(refusals)] if refusals else []),
                  "Tiny models: the emulation's cost per op (Python dispatch, rounding, counting) weighs more "
                  "against small kernels than on GPT-2 sized layers (reports/bench_emulate.md).",
                  TIMING_NOTE])
    return result


if __name__ == "__main__":
    main()
