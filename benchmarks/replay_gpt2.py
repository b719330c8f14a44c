"""How far a replay holds: a recorded GPT-2 run replayed under changed scaler parameters, against the
same GPT-2 really rerun with those parameters.

Writes reports/replay_gpt2.md and .json.  Run: python -m benchmarks.replay_gpt2 [--steps N]

The base run starts at a scale that overflows fp16 (so the scaler backs off) and grows every
``growth_interval`` good steps.  Each change is replayed from the base run's trace
(fpemu.scalers.replay) and rerun for real from the same initial weights and batches; the replay
under the base run's own parameters must reproduce the base run bit for bit.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import warnings

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

from benchmarks._common import write_report  # noqa: E402

BASE = {"init_scale": 2.0 ** 24, "growth_interval": 10}
CHANGES = {"own parameters": {}, "growth_interval 40": {"growth_interval": 40},
           "growth_interval 3": {"growth_interval": 3}, "init_scale 2^16": {"init_scale": 2.0 ** 16}}


def _agreement(replayed, real) -> dict:
    """How the replayed scaler trace agrees with a real recorded run (a TorchRecorder), step by step."""
    real_steps = real.steps
    scales = [step.scale for step in real_steps]
    overflows = [step.overflow for step in real_steps]
    same_scale = [a.hex() == b.hex() for a, b in zip(replayed.trace.scales, scales)]
    first = next((i for i, same in enumerate(same_scale) if not same), None)
    return {"steps": len(real_steps), "scale_agrees": sum(same_scale),
            "overflow_agrees": sum(a == b for a, b in zip(replayed.flags, overflows)),
            "first_scale_divergence": first, "first_estimate": replayed.first_estimate,
            "skipped_replay": len(replayed.trace.skipped), "skipped_real": sum(overflows),
            "final_scale_replay": replayed.trace.final_scale,
            "final_scale_real": real.trace.summary["final_scale"], **replayed.counts()}


def main(argv=None) -> dict:
    import gpt2_loop
    from fpemu.scalers.replay import replay
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        def run(name, params):
            rec = gpt2_loop.record(pathlib.Path(folder) / f"{name}.json", steps=args.steps, width=64,
                                   shadow_every=0, name=name, **{**BASE, **params})
            return rec
        base = run("base", {})
        for label, change in CHANGES.items():
            params = {**base.trace.metadata["params"], **change}
            replayed = replay(base.trace, "torch", **params)
            real = base if not change else run(label.replace(" ", "_").replace("^", ""), change)
            row = {"change": label, **_agreement(replayed, real)}
            print(row, flush=True)
            rows.append(row)
    result = {"base": BASE, "steps": args.steps, "rows": rows}
    columns = [("change", "replayed with"), ("scale_agrees", "scale agrees (steps)"),
               ("overflow_agrees", "overflow agrees"), ("first_scale_divergence", "first scale divergence"),
               ("first_estimate", "first estimated step"), ("recorded", "decided as recorded"),
               ("implied", "implied"), ("estimated", "estimated"), ("skipped_replay", "skips, replay"),
               ("skipped_real", "skips, real rerun"), ("final_scale_replay", "final scale, replay"),
               ("final_scale_real", "final scale, real rerun")]
    notes = [f"examples/gpt2_loop.py: GPT-2 (n_layer=4, n_embd=64, random weights), AdamW, warmup, clipping, fp16 "
             f"autocast on CPU, GradScaler(init_scale={BASE['init_scale']:g}, growth_interval="
             f"{BASE['growth_interval']}); {args.steps} steps of 8x32 tokens.  Each change is replayed from "
             "the base run's trace and compared with the same loop really rerun with the change (same weights, "
             "same batches).",
             "Decisions: 'recorded' = the base run's own verdict at its own scale; 'implied' = a larger scale "
             "than an overflow or a smaller one than a finite step; 'estimated' = from the largest parameter "
             "gradient magnitude, rescaled.  Once the replayed scale leaves the recorded one, the real rerun's "
             "weights (and so its gradients) differ from the recording's: the replay is a prediction from there.",
             "Figures are deterministic on one machine (CPU, fixed seeds); torch "
             "version and CPU kernels can change the recorded gradients."]
    write_report("replay_gpt2", "Replaying a recorded GPT-2 run under other scaler parameters", result, rows,
                 columns, notes)
    return result


if __name__ == "__main__":
    main()
