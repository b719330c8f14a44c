"""audit_torch on accumulation loops of real models built from transformers configs (a tiny Llama, 4 microbatches
per update, fp16 autocast on CPU, GradScaler, AdamW): zero_grad between microbatches is found with the gradient
error a correct loop from the same weights measures; optimizer.step() on an overflowed step is found with what it
did to the parameters; the wording at overflowed steps says what happened (torch 2.13.0, transformers 5.24)."""

import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from fpemu.audits import audit_torch  # noqa: E402

from accumulation_loops import MICRO, batches, llama, microbatch_backward, training  # noqa: E402


def scaled_grads(model):
    return torch.cat([p.grad.detach().double().reshape(-1) if p.grad is not None else torch.zeros(p.numel()).double()
                      for p in model.parameters()])


def one_update(zero_between: bool, set_to_none: bool = True, audited: bool = True):
    """One update of 4 microbatches; returns (audit, the scaled gradient just before scaler.step)."""
    model = llama()
    optimizer, _, scaler = training(model, 4, init_scale=2.0 ** 10)
    audit = audit_torch(scaler, optimizer)
    with audit:
        optimizer.zero_grad()
        for tokens in batches(1)[0]:
            if zero_between:
                optimizer.zero_grad(set_to_none=set_to_none)
            microbatch_backward(model, scaler, tokens)
        grads = scaled_grads(model)
        scaler.step(optimizer)
        scaler.update()
    return audit, grads


def test_zero_grad_between_microbatches_is_found_with_the_gradient_error():
    audit, buggy = one_update(zero_between=True)
    correct_audit, correct = one_update(zero_between=False)
    assert correct_audit.findings == ()
    (finding,) = audit.findings
    assert finding.kind == "zero_grad_between_microbatches" and finding.step == 0
    assert (finding.effect["microbatches"], finding.effect["dropped_microbatches"]) == (MICRO, MICRO - 1)
    measured = float((buggy - correct).norm() / correct.norm())  # the correct loop's sum, summed by autograd
    assert finding.effect["relative_gradient_error"] == pytest.approx(measured, rel=1e-5)
    assert 0.5 < measured < 1
    assert f"{measured:.1%}" in finding.detail and "3 of 4 accumulated microbatches" in finding.detail


def test_zero_grad_in_place_between_microbatches_is_found_without_a_size():
    audit, _ = one_update(zero_between=True, set_to_none=False)
    (finding,) = audit.findings
    assert finding.kind == "zero_grad_between_microbatches" and finding.effect["dropped_microbatches"] == MICRO - 1
    assert "relative_gradient_error" not in finding.effect and "zeroed in place" in finding.detail


def overflowing_loop(step_directly: bool):
    """A loop at a scale that overflows fp16 every step; it steps the optimizer directly or through the scaler."""
    model = llama()
    optimizer, _, scaler = training(model, 4, init_scale=2.0 ** 24)
    with audit_torch(scaler, optimizer) as audit:
        for step in batches(2):
            optimizer.zero_grad()
            for tokens in step:
                microbatch_backward(model, scaler, tokens)
            if step_directly:  # unscale_ and clip as usual, then the optimizer itself: nothing skips the overflow
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
            else:
                scaler.step(optimizer)
            scaler.update()
    broken = sum(int((~torch.isfinite(p.detach())).sum()) for p in model.parameters())
    return audit, broken


def test_optimizer_step_on_an_overflowed_step_is_found():
    audit, broken = overflowing_loop(step_directly=True)
    found = audit.result.of_kind("update_on_nonfinite_grads")
    assert [f.step for f in found] == [0, 1]
    assert found[0].effect["nonfinite_grad_elements"] > 0 and found[-1].effect["nonfinite_param_elements"] == broken > 0
    assert found[0].call == "optimizer[0].step() outside scaler.step"
    safe, untouched = overflowing_loop(step_directly=False)
    assert untouched == 0 and not safe.result.of_kind("update_on_nonfinite_grads")
    assert safe.accounting.skipped_updates == 2


def test_a_carried_overflow_is_said_to_be_inf_not_applied_twice():
    """Stepping every microbatch without zero_grad: the gradient of a skipped (overflowed) attempt is inf/NaN,
    which makes every later microbatch's sum overflow; it was never applied."""
    model = llama()
    optimizer, _, scaler = training(model, 4, init_scale=2.0 ** 24)
    with audit_torch(scaler, optimizer) as audit:
        optimizer.zero_grad()
        for tokens in batches(1)[0]:
            microbatch_backward(model, scaler, tokens)
            scaler.step(optimizer)
            scaler.update()
    carried = audit.result.of_kind("gradients_carried_across_steps")
    assert [f.step for f in carried] == [1, 2, 3] and audit.accounting.skipped_updates == MICRO
    assert all("overflowed" in f.detail and "a second time" not in f.detail for f in carried)
    assert all(f.effect["carried_nonfinite"] == 1.0 for f in carried)


def test_all_skipped_without_update_says_the_scale_could_not_fall():
    model = llama()
    optimizer, _, scaler = training(model, 4, init_scale=2.0 ** 24)
    with audit_torch(scaler, optimizer) as audit:  # one attempt (a second scaler.step would raise without update)
        for tokens in batches(1)[0]:
            microbatch_backward(model, scaler, tokens)
        scaler.step(optimizer)  # no scaler.update(): the scale cannot fall
    (finding,) = audit.result.of_kind("all_updates_skipped")
    assert "scaler.update() was never called, so the scale stayed at 1.67772e+07" in finding.detail
    assert "fell" not in finding.detail


def test_clip_before_unscale_reports_its_first_measurable_occurrence():
    """Issue 26: the first clip before unscale_ is at an overflowed step (its norms are NaN); the headline is the
    first step where it was measured, and the others are counted."""
    model = llama()
    optimizer, _, scaler = training(model, 4, init_scale=2.0 ** 20, growth_interval=1000)
    with audit_torch(scaler, optimizer) as audit:
        for step in batches(3):
            optimizer.zero_grad()
            for tokens in step:
                microbatch_backward(model, scaler, tokens)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # before unscale_
            scaler.step(optimizer)
            scaler.update()
    clips = audit.result.of_kind("clip_before_unscale")
    assert [f.step for f in clips] == [0, 1, 2] and audit.result.skipped_steps == (0,)
    assert not clips[0].measurable and "has no size" in clips[0].detail and "nan" not in clips[0].detail
    summary = audit.summary()
    line = next(line for line in summary.splitlines() if line.startswith("clip_before_unscale"))
    assert "first measurable (step 1)" in line and "nan" not in line
    assert "(1 at steps whose gradients held inf/NaN" in line
    assert clips[1].measurable and math.isfinite(clips[1].effect["shrink"])
