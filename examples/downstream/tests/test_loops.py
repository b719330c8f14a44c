"""Golden tests of the team's own loops (fpemu's pytest plugin: assert_trace_matches, assert_data_matches).

The goldens are recorded runs (``recorded=True`` lets a recorded trace become a golden): write or accept
them with ``pytest --fpemu-update-golden``; ``--fpemu-force-regen`` rewrites those that differ and fails.
pyproject.toml holds them to the trajectory level: the scale, overflow verdicts, skips and the scaler's
counters must be the golden's; losses and gradient statistics may move (another host, a harmless upgrade).
"""

import pytest

pytest.importorskip("torch")
pytest.importorskip("jmp")
pytest.importorskip("optax")

from loops import jax_loop, torch_loop  # noqa: E402


def test_torch_loop(assert_trace_matches):
    assert_trace_matches(torch_loop.train(), "torch_loop", recorded=True)


def test_torch_loop_survives_a_harmless_change(assert_trace_matches):
    """The microbatches accumulated in the other order: other float32 rounding, the same trajectory.  Never
    a golden (no recorded=True): it only ever compares."""
    assert_trace_matches(torch_loop.train(reverse_microbatches=True), "torch_loop")


def test_jax_loop(assert_trace_matches):
    assert_trace_matches(jax_loop.train(), "jax_loop", recorded=True)


def test_scale_schedule(assert_data_matches):
    """Plain data golden: the scale of every step and the steps skipped, of both loops."""
    runs = {"torch": torch_loop.train(), "jax": jax_loop.train()}
    assert_data_matches({name: {"scales": [step["scale"] for step in trace.steps],
                                "skipped": [step["step"] for step in trace.steps if not step["applied"]]}
                         for name, trace in runs.items()}, "scale_schedule")
