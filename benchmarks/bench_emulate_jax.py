"""Cost of an emulated JAX step (fpemu.emulate_jax) vs the same step under jax.jit.

The step is examples/flax_emulate.py's: grads (forward and backward of the fp16 flax transformer) and
update (Adam), from the same state at scale 1.  The emulation's first call traces the jaxpr and
compiles one XLA call per primitive and shape; the figure is the steady step (best of the repeats
after a warm-up), beside the warm-up step.  Writes reports/bench_emulate_jax.md and .json.

Run: python -m benchmarks.bench_emulate_jax [--repeats N]
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import time

from benchmarks._common import TIMING_NOTE, best_time, write_report

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


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    import jax
    import numpy as np

    from fpemu.emulate import emulate_jax
    example = _example()
    state, scale, index = example.build(0), np.float32(1.0), np.int32(0)

    def step(grads, update):
        _, g = grads(state, scale, index)
        return jax.block_until_ready(update(state, g, index))

    jitted = (jax.jit(example.grads), jax.jit(example.update))
    emulated = (emulate_jax(example.grads), emulate_jax(example.update))
    start = time.perf_counter()
    step(*emulated)
    first = time.perf_counter() - start
    step(*jitted)
    plain, _ = best_time(lambda: step(*jitted), args.repeats)
    steady, _ = best_time(lambda: step(*emulated), args.repeats)
    equations = sum(_count_equations(e.jaxpr(*a)[0].jaxpr) for e, a in
                    ((emulated[0], (state, scale, index)), (emulated[1], (state, example.grads(state, scale, index)[1],
                                                                          index))))
    row = {"step": "flax_emulate grads + update", "equations": equations, "jit_ms": plain * 1e3,
           "emulated_ms": steady * 1e3, "ratio": steady / plain, "first_call_s": first}
    result = {"jax": jax.__version__, "rows": [row]}
    write_report("bench_emulate_jax", "emulate_jax vs jax.jit: one training step", result, [row],
                 [("step", "step"), ("equations", "jaxpr equations"), ("jit_ms", "jax.jit (ms)"),
                  ("emulated_ms", "emulated (ms)"), ("ratio", "ratio"), ("first_call_s", "first call (s)")],
                 [f"jax {jax.__version__}, XLA:CPU; best of {args.repeats} steps after a warm-up step.", TIMING_NOTE,
                  "The emulation runs one XLA call per equation (nested ones included) with numpy between them; "
                  "jax.jit runs one fused program.  The first call also traces and compiles each primitive's "
                  "program per shape (cached for the later steps)."])
    return result


if __name__ == "__main__":
    main()
