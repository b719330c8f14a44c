"""Seeded step cases that reach the edges where the fitted XLA and torch orders differ.

The accumulation orders of docs/steps.md only show in products that overflow, underflow or come
out as signed zeros, and in magnitudes at the ends of float32's range; random data of moderate
magnitude rarely reaches them.  :func:`edge_cases` draws both kinds, reproducibly, for the
differential tests and ``benchmarks/jax_step_diff.py``.
"""

from __future__ import annotations

import math

import numpy as np

F32 = np.float32
EDGES = np.array([0.0, -0.0, 1.0, -3.0, 2.0 ** 100, -2.0 ** 120, 2.0 ** -100, -2.0 ** -130, 1e-40, -3e-39, 3.3e38],
                 F32)
RANGES = [(-30, 30), (-140, 127), (-5, 5), (-130, -100), (60, 127)]  # log2 magnitudes, one per case in turn
# Probe values: w * x products that overflow float32 alone (4 * 4 * 2^124, 4096 * 2^116) but not
# when fused with a partial sum (4 * 3 * 2^124 - 4 * 4 * 2^124), underflow (2^-70 * 2^-70) or are
# signed zeros (0 * -1).
PROBE_W = np.array([0.0, -0.0, 3 * 2.0 ** 124, -3 * 2.0 ** 124, 4 * 2.0 ** 124, -4 * 2.0 ** 124, 2.0 ** 116,
                    -(2.0 ** 116), 1.0, -1.0, 2.0 ** -70, -(2.0 ** -70)], F32)
PROBE_X = np.array([0.0, -0.0, 4.0, -4.0, 4096.0, -4096.0, 1.0, -1.0, 2.0 ** -70, -(2.0 ** -70)], F32)


def _random_case(rng, shape, low: int, high: int) -> dict:
    """Normal values times 2^U(low, high), a fifth of them replaced by an edge value."""
    batch, features, outputs = shape

    def draw(*dims):
        normal = np.clip(rng.standard_normal(dims) * np.exp2(rng.uniform(low, high, dims)), -3.4e38, 3.4e38)
        return np.where(rng.random(dims) < 0.2, rng.choice(EDGES, dims), normal).astype(F32)
    return dict(params={"w": draw(features, outputs), "b": draw(outputs)}, x=draw(batch, features),
                y=draw(batch, outputs), lr=0.01)


def _probe_case(rng, shape) -> dict:
    """x and w of probe values (half of them zero), b and y zero, lr 1 (a gradient of +-0 shows
    its sign in a zero weight's update)."""
    batch, features, outputs = shape

    def pick(values, *dims):
        return np.where(rng.random(dims) < 0.5, rng.choice(values, dims), 0.0).astype(F32)
    return dict(params={"w": pick(PROBE_W, features, outputs), "b": np.zeros(outputs, F32)},
                x=pick(PROBE_X, batch, features), y=np.zeros((batch, outputs), F32), lr=1.0)


def edge_cases(shape, count: int, seed: int) -> list:
    """``count`` cases of one (B, D, K) shape, every third a probe case, the others random with
    magnitudes cycling through :data:`RANGES`; scales 2^-10..2^99, growth intervals 1..3."""
    rng = np.random.default_rng(seed)
    drawn = []
    for index in range(count):
        case = _probe_case(rng, shape) if index % 3 == 0 else _random_case(rng, shape, *RANGES[index % len(RANGES)])
        interval = int(rng.integers(1, 4))
        drawn.append(dict(case, loss_scale=math.ldexp(1.0, int(rng.integers(-10, 100))),
                          good_steps=int(rng.integers(0, interval)), growth_interval=interval))
    return drawn
