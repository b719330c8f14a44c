"""advise_loss_scale on a real transformers GPT-2 (random weights, float32 gradients): the same advice
grouped per module and per parameter, and the key bias, whose gradient is rounding noise, named."""

import numpy as np
import pytest

from fpemu.audits import advise_loss_scale

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

EMBED = 64


@pytest.fixture(scope="module")
def gpt2_grads():
    """Per parameter, the float32 gradients of two steps of a 2-layer GPT-2."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=EMBED, n_head=4, n_positions=32, vocab_size=500,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    steps = []
    for _ in range(2):
        ids = torch.randint(0, config.vocab_size, (4, 32))
        model.zero_grad()
        model(ids, labels=ids).loss.backward()
        steps.append({name: p.grad.detach().numpy().copy() for name, p in model.named_parameters()})
    return steps


def per_module(step):
    modules = {}
    for name, grad in step.items():
        modules.setdefault(name.rsplit(".", 1)[0], []).append(grad.ravel())
    return {name: np.concatenate(parts) for name, parts in modules.items()}


def test_same_advice_per_module_and_per_parameter(gpt2_grads):
    # softmax ignores a constant added to every key's score, so the key third of c_attn.bias has a
    # gradient that is zero in exact arithmetic: float32 leaves noise ~2^-24 of the other thirds
    key_bias = gpt2_grads[0]["transformer.h.0.attn.c_attn.bias"][EMBED:2 * EMBED]
    value_bias = gpt2_grads[0]["transformer.h.0.attn.c_attn.bias"][2 * EMBED:]
    assert np.median(np.abs(key_bias)) < 2.0 ** -24 * np.abs(value_bias).max()
    by_parameter = advise_loss_scale(gpt2_grads, "fp16")
    by_module = advise_loss_scale([per_module(step) for step in gpt2_grads], "fp16")
    assert by_parameter.fits and by_module.fits
    assert (by_parameter.lowest, by_parameter.scale, by_parameter.highest) == \
        (by_module.lowest, by_module.scale, by_module.highest)
    assert by_parameter.underflow_share == by_module.underflow_share
    first_line = by_parameter.summary().splitlines()[0]
    assert first_line == by_module.summary().splitlines()[0]
    bias = {layer.name: layer for layer in by_parameter.layers}["transformer.h.0.attn.c_attn.bias"]
    assert bias.noise >= 2 * EMBED * 0.9  # most of the key third, in both steps
    summary = by_parameter.summary()
    assert "Noise-level gradients" in summary and "transformer.h.0.attn.c_attn.bias:" in summary
    # alone, the bias would push the scale to the ceiling for its noise; all it loses is noise
    assert bias.name in by_parameter.misfits and bias.min_scale >= by_parameter.highest
    assert bias.noise_underflow == round(bias.underflow_share * bias.elements)
