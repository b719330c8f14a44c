"""An emulated fp8 run's trace holds every fp8 tensor's amax and scale per step: a transformers GPT-2 (random
weights from a GPT2Config, no download) emulated under fp8_delayed and fp8 (current scaling); each cast's
recorded scales are what fpemu's DelayedScaling gives from the recorded amaxes, bit for bit, and the report
shows the per-tensor scale history."""

import math

import pytest

pytest.importorskip("transformers")

from fpemu.compare import compare_traces  # noqa: E402
from fpemu.emulate.policy import get_policy  # noqa: E402
from fpemu.emulate.report import report_markdown  # noqa: E402
from fpemu.emulate.run import emulate_file  # noqa: E402
from fpemu.formats import get_format  # noqa: E402
from fpemu.traces import Trace, decode_value  # noqa: E402

MODEL_FILE = '''
import torch
from transformers import GPT2Config, GPT2LMHeadModel

def build(seed):
    torch.manual_seed(seed)
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    model.train()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)

def step(model, optimizer, scaler, index):
    start = torch.randint(0, 64, (2, 1), generator=torch.Generator().manual_seed(index))
    ids = (start + torch.arange(16)) % 64
    optimizer.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return loss
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
