"""An emulated fp8 run's trace holds every fp8 tensor's amax and scale per step: a transformers GPT-2 (random
weights from a GPT2Config, no download: examples/gpt2_emulate.py, one layer) emulated under fp8_delayed and
fp8 (current scaling); each cast's recorded scales are what fpemu's DelayedScaling gives from the recorded
amaxes, bit for bit, and the report shows the per-tensor scale history."""

import math
import pathlib

import pytest

pytest.importorskip("transformers")

from fpemu.compare import compare_traces  # noqa: E402
from fpemu.emulate.policy import get_policy  # noqa: E402
from fpemu.emulate.report import report_markdown  # noqa: E402
from fpemu.emulate.run import emulate_file  # noqa: E402
from fpemu.formats import get_format  # noqa: E402
from fpemu.traces import Trace, decode_value  # noqa: E402

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "gpt2_emulate.py"
# The README's GPT-2 model file, shrunk to one layer of width 32 (its build and step read these globals).
MODEL_FILE = f'''
import importlib.util
spec = importlib.util.spec_from_file_location("gpt2_example", {str(EXAMPLE)!r})
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)
example.LAYERS, example.WIDTH, example.HEADS, example.VOCAB, example.CONTEXT, example.BATCH = 1, 32, 2, 64, 16, 2
build, step = example.build, example.step
'''


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2") / "gpt2_tiny.py"
    path.write_text(MODEL_FILE)
    return path


def _history(trace, field):
    """{cast name: [its value at each step]} (every step casts the same tensors)."""
    names = trace.steps[0]["fp8_casts"]
    assert all(record["fp8_casts"] == names for record in trace.steps)
    return {name: [decode_value(record, field)[i][0] for record in trace.steps] for i, name in enumerate(names)}


def test_delayed_scaling_trace_holds_each_tensors_amax_and_scale_per_step(model_file):
    trace = emulate_file(model_file, policy="fp8_delayed", steps=2, params={"init_scale": 1.0})
    amaxes, scales = _history(trace, "tensor_amax"), _history(trace, "tensor_scale")
    names = list(amaxes)
    assert "forward lm_head aten::mm self fp8_e4m3fn" in names and any(n.endswith("fp8_e5m2") for n in names)
    assert len(names) == 30  # 5 linear layers: 2 forward operands, 4 backward (2 products of 2)
    for name in names:  # the cast's scale at step 1 is TE's delayed update of its step-0 amax, bit for bit
        recipe = get_policy("fp8_delayed").delayed_scaling(get_format(name.rpartition(" ")[2]))
        expected = [1.0] + [float(s) for s in recipe.run(amaxes[name][:-1]).scale]
        assert [s.hex() for s in scales[name]] == [s.hex() for s in expected], name
    page = report_markdown(trace)
    assert "## fp8 scale per tensor (30 casts a step; the last 2 steps" in page
    row = next(line for line in page.splitlines() if line.startswith("| `forward lm_head aten::mm self"))
    assert row.split(" | ")[1:3] == ["1", f"{scales['forward lm_head aten::mm self fp8_e4m3fn'][1]:.6g}"]

    changed = dict(trace.steps[1], tensor_scale_hex=[["0x1p+0"]] + trace.steps[1]["tensor_scale_hex"][1:])
    other = Trace(trace.metadata, trace.steps[:1] + (changed,), trace.summary)
    divergence = compare_traces(trace, other).divergence
    assert (divergence.step, divergence.field, divergence.element) == (
        1, "tensor_scale", "forward transformer.h.0.attn.c_attn aten::addmm mat1 fp8_e4m3fn")


def test_current_scaling_trace_holds_the_power_of_two_scale_of_each_amax(model_file):
    trace = emulate_file(model_file, policy="fp8", steps=1, params={"init_scale": 1.0})
    amaxes, scales = _history(trace, "tensor_amax"), _history(trace, "tensor_scale")
    for name, (amax,) in amaxes.items():
        biggest = get_format(name.rpartition(" ")[2]).max_finite
        assert amax > 0 and scales[name] == [2.0 ** math.floor(math.log2(biggest / amax))], name
