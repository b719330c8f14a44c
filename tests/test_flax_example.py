"""examples/flax_loop.py, small: a flax transformer in fp16 with DynamicScale, recorded, rerun and
recorded again with another growth interval, then compared by `fpemu compare` (the README's commands).

Opt-in (FPEMU_TEST_EXAMPLES=1): XLA compiles the transformer's step and its float32 shadow pass
three times, 35-45 s each on this contended 2-core machine.
"""

import os
import pathlib
import sys

import pytest

if os.environ.get("FPEMU_TEST_EXAMPLES") != "1":
    pytest.skip("the flax example compiles a transformer three times; set FPEMU_TEST_EXAMPLES=1",
                allow_module_level=True)
pytest.importorskip("flax")
pytest.importorskip("optax")

from fpemu.cli import main  # noqa: E402
from fpemu.traces import read_trace  # noqa: E402
from fpemu.traces.recorded import recorded_steps  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
import flax_loop  # noqa: E402

TINY = flax_loop.Config(vocab=64, width=16, heads=2, layers=1, context=8)


def run(path, growth_interval):
    return flax_loop.record(path, steps=8, batch=2, init_scale=2.0 ** 20, growth_interval=growth_interval,
                            config=TINY, warmup=2, shadow_every=4)


def test_flax_loop_recorded_and_compared(tmp_path, capsys):
    first, rerun, changed = (tmp_path / name for name in ("a.json", "a_rerun.json", "b.json"))
    run(first, 2), run(rerun, 2), run(changed, 3)
    trace = read_trace(first)
    steps = recorded_steps(trace)
    assert steps[0].overflow and not all(step.overflow for step in steps)  # 2^20 overflows fp16 at first
    assert trace.summary["scheduler_steps"] == trace.summary["completed_updates"]  # the schedule waits on skips
    attention = [group for group in steps[-1].grad_stats if "MultiHeadDotProductAttention" in group]
    assert attention and all(steps[-1].grad_stats[group].elements > 0 for group in attention)
    assert trace.metadata["recorder"]["groups"] == "module" and trace.metadata["profile"] == "flax"
    assert [step.shadow is not None for step in steps] == [index % 4 == 0 for index in range(8)]
    assert all(0 <= shadow.underflow <= 1 for shadow in steps[4].shadow.values())

    assert main(["compare", str(first), str(rerun)]) == 0  # the same run on the same machine: bit for bit
    capsys.readouterr()
    assert main(["compare", str(first), str(changed)]) == 1
    out = capsys.readouterr().out
    assert "parameters differ: growth_interval 2 -> 3" in out and "growth_counter" in out
