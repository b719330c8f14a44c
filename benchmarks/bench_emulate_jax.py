"""Cost of an emulated JAX step (fpemu.emulate_jax) vs the same step under jax.jit, side by side in one
run: the compiled emulator (opt-in, compiled=True: one jitted program, rounding as jax integer ops, telemetry
counted in the program) and the interpreter (one XLA call per equation, numpy between them: the default
path, and the compiled one's reference).

The steps are examples/flax_emulate.py's (grads: forward and backward of the fp16 flax transformer,
2 layers; update: Adam) and the same model with 12 layers (``--layers``), from the same state at scale
1.  Each figure is the steady step (best of the repeats after a warm-up, the three taking turns); the
first call (trace and compile) is beside it.  The outputs of both paths are checked bit for bit against
each other.  Writes reports/bench_emulate_jax.md and .json.

Run: python -m benchmarks.bench_emulate_jax [--repeats N] [--layers 2 12]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import pathlib
import time

import numpy as np

from benchmarks._common import TIMING_NOTE, best_times_interleaved, write_report

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "flax_emulate.py"


def _example():
    spec = importlib.util.spec_from_file_location("flax_emulate", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _count_equations(jaxpr) -> int:
    """Equations of a jaxpr and of the jaxprs nested in it."""
    total = 0
    for eqn in jaxpr.eqns:
        total += 1
        for value in eqn.params.values():
            for inner in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(inner, "jaxpr", inner)
                if hasattr(inner, "eqns"):
                    total += _count_equations(inner)
    return total


def _with_layers(example, layers: int):
    """The example's model with ``layers`` blocks (its own module when that is its depth)."""
    if layers == example.CONFIG.layers:
        return example
    deeper = _example()
    deeper.CONFIG = dataclasses.replace(example.CONFIG, layers=layers)
    deeper.MODEL = type(example.MODEL)(deeper.CONFIG)
    return deeper


def _same_bits(a, b) -> bool:
    import jax
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        x, y = np.asarray(x).astype(np.float32), np.asarray(y).astype(np.float32)
        if not np.array_equal(x.view(np.uint32), y.view(np.uint32)) and not np.array_equal(x, y, equal_nan=True):
            return False
    return True


def _row(example, layers: int, repeats: int) -> dict:
    import jax

    from fpemu.emulate import emulate_jax
    state, scale, index = example.build(0), np.float32(1.0), np.int32(0)

    def step(grads, update):
        _, g = grads(state, scale, index)
        return jax.block_until_ready(update(state, g, index))

    paths = {"jit": (jax.jit(example.grads), jax.jit(example.update)),
             "compiled": (emulate_jax(example.grads, compiled=True), emulate_jax(example.update, compiled=True)),
             "interpreted": (emulate_jax(example.grads, compiled=False), emulate_jax(example.update, compiled=False))}
    first = {}
    for name, pair in paths.items():
        began = time.perf_counter()
        step(*pair)
        first[name] = time.perf_counter() - began
    timed = best_times_interleaved([lambda pair=pair: step(*pair) for pair in paths.values()], repeats)
    best = dict(zip(paths, (t for t, _ in timed)))
    outs = dict(zip(paths, (o for _, o in timed)))
    emulated = paths["compiled"]
    equations = sum(_count_equations(e.jaxpr(*a)[0].jaxpr) for e, a in
                    ((emulated[0], (state, scale, index)), (emulated[1], (state, example.grads(state, scale, index)[1],
                                                                          index))))
    return {"step": f"flax_emulate, {layers} layers: grads + update", "equations": equations,
            "jit_ms": best["jit"] * 1e3, "compiled_ms": best["compiled"] * 1e3,
            "compiled_ratio": best["compiled"] / best["jit"], "interpreted_ms": best["interpreted"] * 1e3,
            "interpreted_ratio": best["interpreted"] / best["jit"], "compiled_first_s": first["compiled"],
            "interpreted_first_s": first["interpreted"], "bit_identical": _same_bits(outs["compiled"],
                                                                                    outs["interpreted"])}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 12])
    args = parser.parse_args(argv)
    import jax
    example = _example()
    rows = [_row(_with_layers(example, layers), layers, args.repeats) for layers in args.layers]
    result = {"jax": jax.__version__, "rows": rows}
    write_report("bench_emulate_jax", "emulate_jax vs jax.jit: one training step, compiled and interpreted", result,
                 rows,
                 [("step", "step"), ("equations", "jaxpr equations"), ("jit_ms", "jax.jit (ms)"),
                  ("compiled_ms", "compiled (ms)"), ("compiled_ratio", "compiled / jit"),
                  ("interpreted_ms", "interpreter (ms)"), ("interpreted_ratio", "interpreter / jit"),
                  ("compiled_first_s", "compiled first call (s)"),
                  ("interpreted_first_s", "interpreter first call (s)"),
                  ("bit_identical", "outputs bit-identical")],
                 [f"jax {jax.__version__}, XLA:CPU; best of {args.repeats} steps after a warm-up step, the three "
                  "paths taking turns.", TIMING_NOTE,
                  "compiled: emulate_jax's opt-in path (compiled=True; the interpreter is the default), one "
                  "jitted program per signature in which every fp16 result is computed in float32 and rounded by "
                  "fpemu's kernel as jax integer ops, and the telemetry is "
                  "counted (its rows copied to the host after each call).  interpreter: one XLA call per equation "
                  "(nested ones included) with numpy between them, the reference the compiled path is tested "
                  "against; its first call traces and compiles each primitive's program per shape.",
                  "CUDA (XLA:GPU): no row; no GPU was lent to this run, so the compiled path is unverified there."])
    return result


if __name__ == "__main__":
    main()
