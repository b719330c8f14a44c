"""What recording costs a jitted JAX step: examples/flax_loop.py's transformer (fp16, DynamicScale,
AdamW) stepped without statistics, with them per module and per parameter, plus the host's
``JaxRecorder.record``; and what the statistics add to XLA's compile.

Writes reports/bench_record_jax.md and .json.  Run: python -m benchmarks.bench_record_jax [--steps N]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import optax

import fpemu
from benchmarks._common import TIMING_NOTE, best_times_interleaved, write_report

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
import flax_loop  # noqa: E402


class _NoStatistics:
    """The step without fpemu: grad_stats returns nothing."""

    def grad_stats(self, grads, scale=None):
        return {}


def _setup(config, batch: int):
    from flax.training.dynamic_scale import DynamicScale
    model = flax_loop.TinyLM(config)
    params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, config.context), jnp.int32))["params"]
    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-3, 5, 1000)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule))
    # 2^10: no step overflows, so every timed step does the same work
    state = (params, optimizer.init(params), DynamicScale(growth_interval=10 ** 6, scale=jnp.float32(2.0 ** 10)))
    return model, optimizer, schedule, state, flax_loop.batches(config, 1, batch)[0]


_RECORD_CALLS = 200


def _record_split(steps, state, tokens, repeats: int) -> dict:
    """The host's record() alone, per call, with the module and the parameter groupings, and the line through
    the two: its fixed cost per step and its cost per group."""
    per_call, groups = [], []
    for group_by in ("module", "parameter"):
        name = f"grad_stats per {group_by}"
        params, opt_state, dynamic_scale = state
        params, opt_state, new_scale, aux = steps[name](params, opt_state, dynamic_scale, tokens)
        best = float("inf")
        for _ in range(repeats):
            # fresh device copies for every call: a jax.Array read once keeps its host copy, as a new step's do not
            copies = jax.block_until_ready([jax.tree_util.tree_map(jnp.copy, aux) for _ in range(_RECORD_CALLS)])
            recorder = fpemu.record_jax("fp16", name="bench", scaler="flax", group_by=group_by)
            start = time.perf_counter()
            for out in copies:
                recorder.record(out["stats"], scale_state=dynamic_scale, next_scale_state=new_scale, loss=out["loss"],
                                grad_norm=out["grad_norm"], lr=out["lr"], applied=True)
            best = min(best, (time.perf_counter() - start) / _RECORD_CALLS)
        per_call.append(best * 1e3)
        groups.append(len(aux["stats"]))
    slope = (per_call[1] - per_call[0]) / (groups[1] - groups[0])
    return {"groups": groups, "per_call_ms": per_call, "per_group_ms": slope,
            "fixed_ms": per_call[0] - slope * groups[0]}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="steps per timed call")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args(argv)
    config = flax_loop.Config()
    model, optimizer, schedule, state, tokens = _setup(config, args.batch)
    variants = {"no statistics": _NoStatistics()}
    for group_by in ("module", "parameter"):
        variants[f"grad_stats per {group_by}"] = fpemu.record_jax("fp16", name="bench", scaler="flax",
                                                                 group_by=group_by)
    steps, compile_s = {}, {}
    for name, recorder in variants.items():
        step = flax_loop.make_step(model, optimizer, schedule, recorder)
        start = time.perf_counter()
        steps[name] = step.lower(*state, tokens).compile()
        compile_s[name] = time.perf_counter() - start

    def run(name, record=False):
        def loop():
            params, opt_state, dynamic_scale = state
            for _ in range(args.steps):
                params, opt_state, new_scale, aux = steps[name](params, opt_state, dynamic_scale, tokens)
                if record:
                    variants[name].record(aux["stats"], scale_state=dynamic_scale, next_scale_state=new_scale,
                                          loss=aux["loss"], grad_norm=aux["grad_norm"], lr=aux["lr"],
                                          applied=True)  # scale 2^10: no step overflows
                jax.block_until_ready(params)
        return loop

    timed = [("no statistics", False), ("grad_stats per module", False), ("grad_stats per module", True),
             ("grad_stats per parameter", False), ("grad_stats per parameter", True)]
    results = best_times_interleaved([run(name, record) for name, record in timed], args.repeats)
    base = results[0][0] / args.steps
    rows = []
    for (name, record), (seconds, _) in zip(timed, results):
        per_step = seconds / args.steps
        groups = len(variants[name].grad_stats(state[0])) if name != "no statistics" else 0
        rows.append({"variant": name + (" + record()" if record else ""), "groups": groups,
                     "step_ms": per_step * 1e3, "overhead": per_step / base - 1,
                     "compile_s": compile_s[name]})
    params = sum(leaf.size for leaf in jax.tree_util.tree_leaves(state[0]))
    split = _record_split(steps, state, tokens, args.repeats)
    result = {"config": vars(config) | {"batch": args.batch, "parameters": int(params)},
              "steps": args.steps, "repeats": args.repeats, "rows": rows, "record_split": split,
              "versions": {"jax": jax.__version__, "fpemu": fpemu.__version__}}
    write_report("bench_record_jax", "Recording a jitted JAX step (examples/flax_loop.py's transformer)", result,
                 rows, [("variant", "variant"), ("groups", "groups"), ("step_ms", "ms / step"),
                        ("overhead", "overhead vs no statistics"), ("compile_s", "XLA compile (s)")],
                 [f"{params:,} parameters (2 blocks, width {config.width}), batch {args.batch} x {config.context} "
                  "tokens, fp16 compute, float32 parameters, on the CPU.",
                  f"Best of {args.repeats} interleaved runs of {args.steps} steps each; the statistics stay on "
                  "the device inside the step, record() copies them (a few numbers per group) to the host.",
                  f"record() alone, on copies of one step's outputs (best of {args.repeats} x {_RECORD_CALLS} "
                  f"calls on a fresh recorder, each on its own device copy): {split['per_call_ms'][0]:.3f} ms with "
                  f"{split['groups'][0]} groups, "
                  f"{split['per_call_ms'][1]:.3f} ms with {split['groups'][1]}: {split['fixed_ms']:.3f} ms a step "
                  f"fixed and {split['per_group_ms'] * 1e3:.1f} us a group (the line through the two).",
                  TIMING_NOTE])
    return result


if __name__ == "__main__":
    main()
