"""How far a replay holds: a recorded GPT-2 run replayed under changed scaler parameters, against the
same GPT-2 really rerun with those parameters.

Writes reports/replay_gpt2.md and .json.  Run: python -m benchmarks.replay_gpt2 [--steps N]

The base run starts at a scale that overflows fp16 (so the scaler backs off) and grows every
``growth_interval`` good steps.  Each change is replayed from the base run's trace
(fpemu.traces.replay) and rerun for real from the same initial weights and batches; the replay
under the base run's own parameters must reproduce the base run bit for bit.  Every run records a
float32 shadow pass every SHADOW_EVERY steps: the replay recounts true underflow from the base run's
and is compared with each rerun's own.
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
SHADOW_EVERY = 5
FORMATS = ("fp16", "bf16", "fp8_e5m2")
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


def _true_underflow(step) -> float:
    """The run's own shadow shares of underflow over every element (its fp16 backward against float32)."""
    elements = {group: histogram.elements for group, histogram in step.shadow_histogram.items()}
    lost = sum(round(stats.underflow * elements[group]) for group, stats in step.shadow.items())
    return lost / sum(elements.values())


def _rounded_once(step, scale: float, fmt: str):
    """(underflow, subnormal) shares of a step's float32 gradients rounded once at ``scale``, over every element."""
    from fpemu.traces.recorded import ShadowShares
    histograms = step.shadow_histogram.values()
    total = ShadowShares.total(h.counts(scale, fmt) for h in histograms).per(sum(h.elements for h in histograms))
    assert total.exact  # GradScaler's scales are powers of two
    return total.underflow[0], total.subnormal[0]


def _shadow_rows(label, replayed, real) -> list:
    """Per sampled step: the replay's recount from the base run's float32 gradients at the replayed scale,
    against the real rerun's own float32 gradients at its scale and its true (fp16 backward) underflow."""
    rows = []
    for index, (shares, step) in enumerate(zip(replayed.shadow_total, real.steps)):
        if shares is None or step.shadow_histogram is None:
            continue
        under, sub = _rounded_once(step, step.scale, "fp16")
        rows.append({"change": label, "step": index, "scale_replay": replayed.trace.scales[index],
                     "scale_real": step.scale, "underflow_replay": shares.underflow[0], "underflow_real": under,
                     "underflow_true": _true_underflow(step), "subnormal_replay": shares.subnormal[0],
                     "subnormal_real": sub})
    return rows


def main(argv=None) -> dict:
    import gpt2_loop
    from fpemu.traces.replay import replay
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    rows, shadow_rows = [], []
    with tempfile.TemporaryDirectory() as folder:
        def run(name, params):
            rec = gpt2_loop.record(pathlib.Path(folder) / f"{name}.json", steps=args.steps, width=64,
                                   shadow_every=SHADOW_EVERY, name=name, **{**BASE, **params})
            return rec
        base = run("base", {})
        for label, change in CHANGES.items():
            params = {**base.trace.metadata["params"], **change}
            replayed = replay(base.trace, "torch", **params)
            real = base if not change else run(label.replace(" ", "_").replace("^", ""), change)
            row = {"change": label, **_agreement(replayed, real)}
            print(row, flush=True)
            rows.append(row)
            shadow_rows += _shadow_rows(label, replayed, real)
        formats = [{"format": fmt, **{f"step_{i}": shares.underflow[0] for i, shares in
                                      enumerate(replay(base.trace, "torch", compute=fmt,
                                                       **base.trace.metadata["params"]).shadow_total)
                                      if shares is not None}} for fmt in FORMATS]
    result = {"base": BASE, "steps": args.steps, "rows": rows, "shadow_every": SHADOW_EVERY,
              "shadow_rows": shadow_rows, "formats": formats}
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
    shadow_columns = [("change", "replayed with"), ("step", "step"), ("scale_replay", "scale, replay"),
                      ("scale_real", "scale, real rerun"), ("underflow_replay", "underflow, replay"),
                      ("underflow_real", "underflow, rerun rounded once"),
                      ("underflow_true", "underflow, rerun true"), ("subnormal_replay", "subnormal, replay"),
                      ("subnormal_real", "subnormal, rerun rounded once")]
    shadow_notes = [f"Every run records a float32 shadow pass every {SHADOW_EVERY} steps.  'replay': the base "
                    "run's float32 gradients (their binade histogram) rounded once at the replayed scale into fp16, "
                    "as shares of all gradient elements; 'rerun rounded once': the same from the real rerun's own "
                    "float32 gradients at its own scale; 'rerun true': what the rerun's fp16 backward really "
                    "lost (nonzero in float32, zero in its gradients).",
                    "GradScaler's scales are powers of two, so every recount is exact (fpemu's zero edge is a "
                    "power of two and its normal edge a tie point: see fpemu/traces/recorded.py).  While the "
                    "replayed scale stays on the recorded trajectory, 'replay' and 'rerun rounded once' agree "
                    "bit for bit (the same weights, the same float32 pass); after the scales part the rerun's "
                    "weights differ and the replay is a prediction.",
                    "'rerun true' is 0 at every sampled step: no gradient element nonzero in float32 is zero in "
                    "these runs.  The few elements 'rounded once' counts (at most 32 of 269,696) lay, where checked "
                    "(step 15 of the base loop run for 16 steps, grouped per parameter), all in the attention "
                    "c_attn biases, whose key part has a mathematically zero gradient: float32 leaves rounding "
                    "noise near 2^-45 there, below fp16's zero edge once scaled, while the run's fp16 backward "
                    "leaves noise of its own, larger, so nothing it holds is zero.  Rounding "
                    "the float32 gradient once models a parameter gradient computed in fp16 from exact inputs; "
                    "what the backward loses earlier (activation gradients underflowing) shows only in 'true'."]
    format_columns = [("format", "replayed in")] + [(key, f"step {key[5:]}") for key in
                                                    (formats[0] if formats else {}) if key != "format"]
    format_notes = ["The base run's float32 gradients at the scales its own scaler held, rounded once into each "
                    "format: the underflow share a replay in that format recounts: none in bf16, whose range "
                    "reaches far below fp16's; more in fp8_e5m2, which has fp16's exponents but 2 mantissa bits, so "
                    "its smallest subnormal (2^-16) is 256 times fp16's."]
    write_report("replay_gpt2", "Replaying a recorded GPT-2 run under other scaler parameters", result, rows,
                 columns, notes,
                 sections=[("Shadow statistics replayed: true underflow at the replayed scale", shadow_rows,
                            shadow_columns, shadow_notes),
                           ("Shadow statistics replayed in other formats (own scales)", formats, format_columns,
                            format_notes)])
    return result


if __name__ == "__main__":
    main()
