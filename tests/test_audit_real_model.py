"""audit_torch on a tiny real GPT-2 (transformers, random weights, fp16 autocast on CPU): the clip-before-unscale
finding measures the update AdamW really made, gradients carried across steps are found, and the result
holds the skipped attempts and the scale history; an overflowed microbatch gives no 'nan%'."""

import contextlib
import math
import pathlib
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from fpemu.audits import audit_torch  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
import gpt2_loop  # noqa: E402

BATCH, LENGTH, VOCAB = 2, 8, 128


def tiny(init_scale=2.0 ** 16, lr=1e-3):
    model = gpt2_loop.make_model(layers=2, width=32, heads=2, vocab=VOCAB, context=16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=1000)
    return model, optimizer, scaler


def backward(model, scaler, tokens):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(tokens, labels=tokens).loss
    scaler.scale(loss).backward()


def weights(model):
    return [p.detach().clone() for p in model.parameters()]


def delta_norm(after, before):
    return math.sqrt(sum(float(((a.double() - b.double()) ** 2).sum()) for a, b in zip(after, before)))


def clip_loop(tokens, clip_first, audited):
    model, optimizer, scaler = tiny()
    start = weights(model)
    audit = audit_torch(scaler, optimizer)
    with audit if audited else contextlib.nullcontext():
        backward(model, scaler, tokens)
        if not clip_first:
            scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
    return audit, delta_norm(weights(model), start)


def test_clip_before_unscale_measures_the_update_adamw_made():
    tokens = gpt2_loop.batches(1, BATCH, LENGTH, VOCAB)[0]
    audit, buggy_update = clip_loop(tokens, clip_first=True, audited=True)
    _, correct_update = clip_loop(tokens, clip_first=False, audited=False)
    (finding,) = audit.findings
    effect = finding.effect
    assert finding.kind == "clip_before_unscale"
    assert effect["update_norm_this_order"] == pytest.approx(buggy_update, rel=1e-9)
    assert effect["update_norm_correct_order"] == pytest.approx(correct_update, rel=1e-6)
    # the gradient is 65536x too small, the AdamW update far less so: the finding says the latter
    assert effect["grad_shrink"] == pytest.approx(65536, rel=1e-3)
    assert 1 < effect["shrink"] < 1000 and effect["shrink"] == pytest.approx(correct_update / buggy_update, rel=1e-6)
    assert "AdamW made an update of norm" in finding.detail


def test_stepping_every_microbatch_without_zeroing_is_found():
    data = gpt2_loop.batches(4, BATCH, LENGTH, VOCAB)
    model, optimizer, scaler = tiny()
    carried = []
    with audit_torch(scaler, optimizer) as audit:
        for micro, tokens in enumerate(data):
            carried.append(math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()
                                         if p.grad is not None)))
            backward(model, scaler, tokens)
            scaler.step(optimizer)
            scaler.update()
            if micro % 2 == 1:  # "accumulation boundary": zeroed only here
                optimizer.zero_grad()
    found = audit.result.of_kind("gradients_carried_across_steps")
    assert [f.step for f in found] == [1, 3] and audit.result.kinds == {"gradients_carried_across_steps"}
    for finding in found:
        assert finding.effect["scale"] == 2.0 ** 16 and finding.effect["carried_weight"] == 2.0 ** -16
        assert finding.effect["carried_grad_norm"] == pytest.approx(carried[finding.step], rel=1e-9)
    model, optimizer, scaler = tiny()
    with audit_torch(scaler, optimizer) as clean:
        for tokens in data:
            backward(model, scaler, tokens)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    assert clean.findings == ()


def adam_updates(optimizer, param) -> int:
    """AdamW's own count of the updates it made to ``param``."""
    return int(optimizer.state[param]["step"]) if param in optimizer.state else 0


def test_result_holds_skipped_attempts_and_scales():
    model, optimizer, scaler = tiny(init_scale=2.0 ** 22)  # fp16 overflows until the scale backs off
    first = next(model.parameters())
    scales, skipped = [], []
    with audit_torch(scaler, optimizer) as audit:
        for step, tokens in enumerate(gpt2_loop.batches(6, BATCH, LENGTH, VOCAB)):
            optimizer.zero_grad()
            backward(model, scaler, tokens)
            scales.append(scaler.get_scale())
            updates = adam_updates(optimizer, first)
            scaler.step(optimizer)
            scaler.update()
            if adam_updates(optimizer, first) == updates:
                skipped.append(step)
    result = audit.result
    assert result.scales == tuple(scales) and result.skipped_steps == tuple(skipped)
    assert skipped and len(skipped) < 6 and result.accounting.skipped_updates == len(skipped)


def test_an_overflowed_microbatch_is_not_off_by_nan_percent():
    """Two microbatches accumulate while a second optimizer's step changes the scale; the first overflows."""
    body, head = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    body_opt, head_opt = torch.optim.SGD([body], lr=0.1), torch.optim.SGD([head], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    with audit_torch(scaler, [body_opt, head_opt]) as audit:
        for micro, x in enumerate([torch.tensor([math.inf, 4.0]), torch.tensor([3.0, 4.0])]):
            scaler.scale(((body + head) * x).sum()).backward()
            scaler.step(head_opt)
            head_opt.zero_grad()
            if micro == 1:
                scaler.step(body_opt)
            scaler.update()
    (finding,) = audit.result.of_kind("scale_changed_in_accumulation")
    assert "nan" not in finding.detail and "a microbatch overflowed" in finding.detail
    assert "relative_gradient_error" not in finding.effect and finding.effect["weights"] == (2.0, 1.0)


def test_clip_before_unscale_with_no_update_in_either_order():
    """A warmup's first learning rate is 0: neither order moves the weights, and the finding says so."""
    weight = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([weight], lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=100.0)
    with audit_torch(scaler, optimizer) as audit:
        scaler.scale((weight * torch.tensor([3.0, 4.0])).sum()).backward()
        torch.nn.utils.clip_grad_norm_([weight], max_norm=2.0)
        scaler.step(optimizer)
        scaler.update()
    (finding,) = audit.findings
    assert finding.effect["shrink"] == 1.0 and finding.effect["update_norm_this_order"] == 0.0
    assert "update is 0 in either order this step (learning rate 0)" in finding.detail
