"""Training-loop audits on real torch loops (CPU), JAX loop records, and loss-scale advice."""

import contextlib
import doctest
import math
import sys
import types

import numpy as np
import pytest

import fpemu
import fpemu.audits.advice
import fpemu.audits.findings
import fpemu.audits.jax_loop
from fpemu.audits import advise_loss_scale, audit_jax_loop

torch = pytest.importorskip("torch")
from fpemu.audits import audit_torch  # noqa: E402  (needs torch only when used)
import fpemu.audits.torch_loop  # noqa: E402

INF = float("inf")


def vector_setup(init_scale, values, **scaler_kw):
    """A parameter whose loss gradient is ``values``, its optimizer and a CPU GradScaler."""
    weight = torch.nn.Parameter(torch.zeros(len(values)))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, **scaler_kw)
    return weight, optimizer, scaler, torch.tensor(values)


def correct_step(weight, optimizer, scaler, coefficients):
    """backward, unscale_, step, update, zero_grad: the order GradScaler expects."""
    scaler.scale((weight * coefficients).sum()).backward()
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()


def clip_step(weight, optimizer, scaler, coefficients, clip, limit, unscale_first):
    scaler.scale((weight * coefficients).sum()).backward()
    if unscale_first:
        scaler.unscale_(optimizer)
    clip([weight], limit)
    scaler.step(optimizer)
    scaler.update()


# --- clipping before unscaling (seed 004) -----------------------------------------

@pytest.mark.parametrize("values,scale,limit,correct,buggy", [
    ([3.0, 4.0], 100.0, 2.0, 2.0, 0.02),            # the lab's vector: [1.2, 1.6] vs [0.012, 0.016]
    ([0.2], 1024.0, 1.0, 0.2, 1.0 / 1024),          # the worked example: 0.2 vs ~0.000977
    ([2.0], 100.0, 1.0, 1.0, 0.01),                 # the exercise: norm 1 vs 0.01
])
def test_seed_clip_before_unscale(values, scale, limit, correct, buggy):
    weight, optimizer, scaler, coefficients = vector_setup(scale, values)
    with audit_torch(scaler, optimizer) as audit:
        clip_step(weight, optimizer, scaler, coefficients, torch.nn.utils.clip_grad_norm_, limit, False)
    (finding,) = audit.findings
    assert finding.kind == "clip_before_unscale" and finding.step == 0
    assert finding.call == f"torch.nn.utils.clip_grad_norm_(max_norm={limit:g})"
    assert finding.effect["update_norm_correct_order"] == pytest.approx(correct, rel=1e-5)
    assert finding.effect["update_norm_this_order"] == pytest.approx(buggy, rel=1e-5)
    assert finding.effect["true_grad_norm"] == pytest.approx(math.hypot(*values), rel=1e-6)
    assert float(weight.grad.norm()) == pytest.approx(buggy, rel=1e-5)  # what the optimizer really got
    assert "unscale_" in finding.fix

    weight, optimizer, scaler, coefficients = vector_setup(scale, values)
    with audit_torch(scaler, optimizer) as audit:
        clip_step(weight, optimizer, scaler, coefficients, torch.nn.utils.clip_grad_norm_, limit, True)
    assert audit.findings == () and float(weight.grad.norm()) == pytest.approx(correct, rel=1e-5)


def test_clip_grad_value_before_unscale():
    weight, optimizer, scaler, coefficients = vector_setup(100.0, [3.0, 4.0])
    with audit_torch(scaler, optimizer) as audit:
        clip_step(weight, optimizer, scaler, coefficients, torch.nn.utils.clip_grad_value_, 2.0, False)
    (finding,) = audit.findings
    assert finding.call == "torch.nn.utils.clip_grad_value_(clip_value=2)"
    assert finding.effect["update_norm_correct_order"] == pytest.approx(math.hypot(2, 2), rel=1e-6)
    assert finding.effect["update_norm_this_order"] == pytest.approx(math.hypot(0.02, 0.02), rel=1e-5)


def test_clip_imported_by_name_before_the_audit(monkeypatch):
    """A loop module that did ``from torch.nn.utils import clip_grad_norm_ as clip`` before the
    audit began is seen too, and gets its own name back afterwards."""
    loop = types.ModuleType("user_training_loop")
    exec("from torch.nn.utils import clip_grad_norm_ as clip\n"
         "def step(weight, scaler, optimizer, coefficients):\n"
         "    scaler.scale((weight * coefficients).sum()).backward()\n"
         "    clip([weight], 2.0)\n"
         "    scaler.step(optimizer)\n"
         "    scaler.update()\n", vars(loop))
    monkeypatch.setitem(sys.modules, loop.__name__, loop)
    weight, optimizer, scaler, coefficients = vector_setup(100.0, [3.0, 4.0])
    with audit_torch(scaler, optimizer) as audit:
        loop.step(weight, scaler, optimizer, coefficients)
    assert [f.call for f in audit.findings] == ["torch.nn.utils.clip_grad_norm_(max_norm=2)"]
    assert loop.clip is torch.nn.utils.clip_grad.clip_grad_norm_


def test_audit_changes_nothing_and_restores_everything():
    """The same buggy loop with and without the audit ends with bit-identical weights."""
    originals = (torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad.clip_grad_norm_)
    weights = []
    for audited in (False, True):
        weight, optimizer, scaler, coefficients = vector_setup(100.0, [3.0, 4.0])
        step_method = scaler.step
        with audit_torch(scaler, optimizer) if audited else contextlib.nullcontext() as audit:
            for _ in range(3):
                scaler.scale((weight * coefficients).sum()).backward()
                torch.nn.utils.clip_grad_norm_((p for p in [weight]), max_norm=2.0)  # a generator, a keyword
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
        if audited:
            assert [f.kind for f in audit.findings] == ["clip_before_unscale"] * 3
        weights.append(weight.detach().clone())
        assert "step" not in vars(scaler) and "unscale_" not in vars(scaler) and scaler.step == step_method
    assert torch.equal(weights[0], weights[1])
    assert (torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad.clip_grad_norm_) == originals


# --- unscale_ twice, backward after unscale_ ----------------------------------------

@pytest.mark.parametrize("explicit_unscale", [False, True])
def test_manual_unscale_before_the_scaler_divides_again(explicit_unscale):
    weight, optimizer, scaler, coefficients = vector_setup(64.0, [3.0, 4.0])
    with audit_torch(scaler, optimizer) as audit:
        correct_step(weight, optimizer, scaler, coefficients)
        assert audit.findings == ()
        before = weight.detach().clone()
        scaler.scale((weight * coefficients).sum()).backward()
        weight.grad.div_(scaler.get_scale())  # the bug
        if explicit_unscale:
            scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
    (finding,) = audit.findings
    assert finding.kind == "manual_unscale" and finding.step == 1
    assert finding.call == ("scaler.unscale_(optimizer[0])" if explicit_unscale
                            else "scaler.step(optimizer[0]) (its own unscale_)")
    assert finding.effect["grad_norm_after_backward"] == pytest.approx(5 * 64)
    assert finding.effect["grad_norm_before_unscale"] == pytest.approx(5)
    assert torch.equal(before - weight.detach(), coefficients / 64)  # lr 1: the update is S times too small


def test_backward_after_unscale_counts_scale_times_too_much():
    """unscale_, then another backward in the same step: the second pass's gradient enters the
    update multiplied by S (step does not unscale again), as the weights show."""
    weight, optimizer, scaler, coefficients = vector_setup(64.0, [3.0, 4.0])
    with audit_torch(scaler, optimizer) as audit:
        for _ in range(2):  # correct steps first: unscale_ in one step, backward in the next
            correct_step(weight, optimizer, scaler, coefficients)
        assert audit.findings == ()
        before = weight.detach().clone()
        scaler.scale((weight * coefficients).sum()).backward()
        scaler.unscale_(optimizer)
        scaler.scale((weight * coefficients).sum()).backward()  # the bug
        scaler.step(optimizer)
        scaler.update()
    (finding,) = audit.findings
    assert finding.kind == "backward_after_unscale" and finding.step == 2
    assert finding.call == "backward after scaler.unscale_(optimizer[0])"
    assert finding.effect == {"scale": 64.0, "weight_of_this_backward": 64.0}
    assert torch.equal(before - weight.detach(), coefficients * (1 + 64))  # lr 1: g + S * g


def test_skipped_step_and_autograd_grad_after_unscale_are_not_findings():
    """unscale_, clip, then skip a spiky step (zero_grad, update, no step): the next backward
    starts a new step.  autograd.grad after unscale_ adds nothing to .grad."""
    weight, optimizer, scaler, coefficients = vector_setup(64.0, [3.0, 4.0])
    with audit_torch(scaler, optimizer) as audit:
        for skip in (True, False):
            scaler.scale((weight * coefficients).sum()).backward()
            scaler.unscale_(optimizer)
            torch.autograd.grad((weight * coefficients).sum(), [weight])
            if skip:
                optimizer.zero_grad()
                scaler.update()
                continue
            scaler.step(optimizer)
            scaler.update()
    assert audit.findings == ()



def test_unscale_twice_that_torch_refuses_is_recorded():
    weight, optimizer, scaler, coefficients = vector_setup(64.0, [3.0, 4.0])
    with pytest.raises(RuntimeError, match="already been called"):
        with audit_torch(scaler, optimizer) as audit:
            scaler.scale((weight * coefficients).sum()).backward()
            scaler.unscale_(optimizer)
            scaler.unscale_(optimizer)
    (finding,) = audit.findings
    assert finding.kind == "unscale_twice" and finding.call == "scaler.unscale_(optimizer[0])"
    assert finding.effect == {"scale": 64.0, "grad_norm": 5.0} and "torch raised" in finding.detail


def test_unscale_twice_across_update_divides_twice():
    """update() between unscale_ and step resets torch's guard: step unscales the gradients again."""
    weight, optimizer, scaler, coefficients = vector_setup(64.0, [3.0, 4.0])
    with audit_torch(scaler, optimizer) as audit:
        scaler.scale((weight * coefficients).sum()).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_([weight], 10.0)
        scaler.update()
        scaler.step(optimizer)
    (finding,) = audit.findings
    assert finding.kind == "unscale_twice" and finding.call == "scaler.step(optimizer[0]) (its own unscale_)"
    assert finding.effect["grad_norm_before"] == pytest.approx(5.0)
    assert finding.effect["grad_norm_after"] == pytest.approx(5.0 / 64)
    assert float(weight.grad.norm()) == pytest.approx(5.0 / 64)


# --- a scale that changes inside an effective batch --------------------------------

def accumulation_loop(update_every_microbatch):
    """Two optimizers share a scaler; the body accumulates two microbatches per update."""
    body, head = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    body_opt, head_opt = torch.optim.SGD([body], lr=0.1), torch.optim.SGD([head], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    x = torch.tensor([3.0, 4.0])
    with audit_torch(scaler, [body_opt, head_opt]) as audit:
        for micro in range(4):
            scaler.scale(((body + head) * x).sum()).backward()
            boundary = micro % 2 == 1
            if update_every_microbatch or boundary:
                scaler.step(head_opt)
                head_opt.zero_grad()
            if boundary:
                scaler.step(body_opt)
                body_opt.zero_grad()
            if update_every_microbatch or boundary:
                scaler.update()
    return audit


def test_scale_change_inside_accumulation_misweights_microbatches():
    audit = accumulation_loop(update_every_microbatch=True)
    found = audit.result.of_kind("scale_changed_in_accumulation")
    assert audit.result.kinds == {"scale_changed_in_accumulation"} and [f.step for f in found] == [0, 1]
    first = found[0]
    assert first.effect["scales"] == (1024.0, 2048.0) and first.effect["unscale_scale"] == 2048.0
    assert first.effect["weights"] == (0.5, 1.0)                              # (S1/S2) g1 + g2
    assert first.effect["relative_gradient_error"] == pytest.approx(0.25)     # 1.5 g instead of 2 g
    assert first.call == "scaler.step(optimizer[0]) (its own unscale_)"
    assert accumulation_loop(update_every_microbatch=False).findings == ()


# --- skipped updates, the scheduler, and the accounting (seed 004) -------------------

def skip_loop(scheduler_on_every_attempt, audited=True, bad_steps=range(5, 100, 10), attempts=100):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.99)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    audit = audit_torch(scaler, optimizer, scheduler, batch_size=8)
    with audit if audited else contextlib.nullcontext():
        for step in range(attempts):
            x = torch.ones(8, 4)
            if step in bad_steps:
                x[0, 0] = INF  # the gradients of this step are non-finite; the scaler skips its update
            scaler.scale(model(x).pow(2).mean()).backward()
            scaler.step(optimizer)
            before = scaler.get_scale()
            scaler.update()
            if scheduler_on_every_attempt or scaler.get_scale() >= before:
                scheduler.step()
            optimizer.zero_grad()
    return audit, model


def test_seed_accounting_100_attempts_10_skipped():
    audit, model = skip_loop(scheduler_on_every_attempt=False)
    accounting = audit.accounting
    assert (accounting.attempts, accounting.completed_updates, accounting.skipped_updates) == (100, 90, 10)
    assert (accounting.backward_passes, accounting.examples, accounting.scheduler_steps) == (100, 800, 90)
    assert audit.findings == ()
    _, unaudited = skip_loop(scheduler_on_every_attempt=False, audited=False)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), unaudited.parameters()))


def test_scheduler_that_advances_on_skipped_updates():
    audit, _ = skip_loop(scheduler_on_every_attempt=True)
    found = audit.result.of_kind("scheduler_on_skipped_update")
    assert audit.result.kinds == {"scheduler_on_skipped_update"}
    assert [f.step for f in found] == list(range(5, 100, 10))
    assert found[0].effect["scheduler_steps"] == 6 and found[0].effect["completed_updates"] == 5
    assert found[-1].effect == pytest.approx({"scheduler_steps": 96, "completed_updates": 86,  # at step 95
                                              "skipped_updates": 10, "lr": 0.01 * 0.99 ** 96})
    assert audit.accounting.scheduler_steps == 100 and audit.accounting.completed_updates == 90
    summary = audit.summary()
    assert summary.startswith("100 attempts, 90 completed updates, 10 skipped, 100 backward passes, 800 examples")
    assert "scheduler_on_skipped_update: 10x at step 5, 15, 25" in summary


def test_every_update_skipped():
    audit, _ = skip_loop(scheduler_on_every_attempt=False, bad_steps=range(6), attempts=6)
    (finding,) = audit.findings
    assert finding.kind == "all_updates_skipped" and finding.step == 5
    assert finding.effect == {"attempts": 6, "first_scale": 1024.0, "final_scale": 16.0}


# --- autocast -------------------------------------------------------------------

def autocast_loop(dtype, use_scaler, steps=3):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16) if use_scaler else None
    with audit_torch(scaler, optimizer) as audit:
        for _ in range(steps):
            with torch.autocast("cpu", dtype=dtype):
                loss = model(torch.randn(4, 8)).float().mean() * 1e-8  # small gradients, as late in training
            (scaler.scale(loss) if scaler else loss).backward()
            scaler.step(optimizer) if scaler else optimizer.step()
            if scaler:
                scaler.update()
            optimizer.zero_grad()
    return audit


def test_fp16_autocast_without_scaler():
    audit = autocast_loop(torch.float16, use_scaler=False)
    (finding,) = audit.findings
    assert finding.kind == "fp16_autocast_without_scaler" and finding.step == 0
    assert finding.effect["zero_share"] > 0.9  # measured: the gradients came back zero
    assert autocast_loop(torch.float16, use_scaler=True).findings == ()


def test_scaler_under_bf16_autocast():
    audit = autocast_loop(torch.bfloat16, use_scaler=True)
    (finding,) = audit.findings
    assert finding.kind == "scaler_under_bf16" and finding.effect["bf16_underflow_share"] == 0.0
    assert finding.effect["attempts"] == 3
    assert autocast_loop(torch.bfloat16, use_scaler=False).findings == ()


def test_bad_arguments_name_the_argument():
    weight, optimizer, scaler, _ = vector_setup(8.0, [1.0])
    with pytest.raises(TypeError, match="scaler must be a torch.amp.GradScaler or None, got SGD"):
        audit_torch(optimizer, optimizer)
    with pytest.raises(TypeError, match=r"optimizers\[1\] must be a torch.optim.Optimizer, got Parameter"):
        audit_torch(scaler, [optimizer, weight])
    with pytest.raises(TypeError, match="scheduler must be an LR scheduler with a step"):
        audit_torch(scaler, optimizer, scheduler=3)
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        audit_torch(scaler, optimizer, batch_size=0)
    audit = audit_torch(scaler, optimizer)
    with audit:
        pass
    with pytest.raises(RuntimeError, match="an audit records one run"):
        audit.__enter__()


# --- JAX loop records ------------------------------------------------------------

def jax_loop(carry_scale, guard_update, bad_steps=(3,), steps=8):
    """SGD on one weight vector with a jmp dynamic loss scale; returns (scale, grads, update) records."""
    jax = pytest.importorskip("jax")
    jmp = pytest.importorskip("jmp")
    jnp = jax.numpy

    def train_step(params, loss_scale, x):
        grads = jax.grad(lambda p: loss_scale.scale(jnp.sum((p["w"] * x) ** 2)))(params)
        grads = loss_scale.unscale(grads)
        finite = jmp.all_finite(grads)
        new_params = jax.tree_util.tree_map(lambda p, g: p - 0.01 * g, params, grads)
        if guard_update:
            new_params = jmp.select_tree(finite, new_params, params)
        updates = jax.tree_util.tree_map(lambda new, old: new - old, new_params, params)
        return new_params, loss_scale.adjust(finite), grads, updates

    params = {"w": jnp.ones(3)}
    initial = jmp.DynamicLossScale(jnp.float32(2.0 ** 15), period=2)
    loss_scale, records = initial, []
    for step in range(steps):
        x = jnp.array([1.0, INF if step in bad_steps else 2.0, 3.0])
        used = loss_scale if carry_scale else initial
        params, loss_scale, grads, updates = train_step(params, used, x)
        records.append((used, grads, updates))
    return records


def test_jax_correct_loop_has_no_findings():
    result = audit_jax_loop(jax_loop(carry_scale=True, guard_update=True))
    assert result.findings == ()
    accounting = result.accounting
    assert (accounting.attempts, accounting.completed_updates, accounting.skipped_updates) == (8, 7, 1)


def test_jax_scale_state_not_carried():
    result = audit_jax_loop(jax_loop(carry_scale=False, guard_update=True))
    assert result.kinds == {"scale_not_carried"}
    steps = [(f.step, f.effect) for f in result.findings]
    assert steps[0] == (1, {"counter_before": 0, "counter_after": 0})            # the counter did not move
    assert (4, {"scale_before": 32768.0, "scale_after": 32768.0}) in steps       # no backoff


def test_jax_update_applied_on_nonfinite_gradients():
    result = audit_jax_loop(jax_loop(carry_scale=True, guard_update=False))
    assert result.kinds == {"update_on_nonfinite_grads"}
    assert [f.step for f in result.findings] == [3, 4, 5, 6, 7]  # the NaN update poisoned the weight for good
    assert result.findings[0].effect == pytest.approx({"nonfinite_grad_share": 1 / 3,
                                                       "nonfinite_update_share": 1 / 3})
    assert result.accounting.completed_updates == 8


def test_jax_records_with_plain_numbers_and_bad_input():
    records = [(8.0, {"w": np.ones(2)}, {"w": np.zeros(2)})] * 4
    assert audit_jax_loop(records, growth_interval=2).of_kind("scale_not_carried")[0].step == 3
    assert audit_jax_loop(records, dynamic=False, growth_interval=2).findings == ()
    with pytest.raises(TypeError, match=r"records\[0\] must be a \(scale_state, grads, update\) tuple"):
        audit_jax_loop([(8.0, [1.0])])
    with pytest.raises(ValueError, match=r"records\[1\]\[0\] must be a positive loss scale"):
        audit_jax_loop([(8.0, [1.0], None), (-1.0, [1.0], None)])
    with pytest.raises(TypeError, match=r"records\[0\]\[1\]\['w'\] must hold numeric arrays"):
        audit_jax_loop([(8.0, {"w": "x"}, None)])


# --- loss-scale advice ------------------------------------------------------------

def log_uniform(rng, low, high, size):
    """Gradient magnitudes spread evenly over the binades from low to high, random signs."""
    values = np.exp(rng.uniform(np.log(low), np.log(high), size)) * rng.choice([-1.0, 1.0], size)
    return values.astype(np.float32)


def test_advice_when_a_scale_fits_fp16():
    rng = np.random.default_rng(1)
    steps = [{"embed": rng.standard_normal(5000).astype(np.float32) * 1e-6,
              "head": rng.standard_normal(500).astype(np.float32) * 1e-2} for _ in range(3)]
    advice = advise_loss_scale(steps, "fp16", max_underflow_share=0.001)
    assert advice.fits and advice.misfits == () and advice.lowest <= advice.scale <= advice.highest
    assert math.log2(advice.scale) == (math.log2(advice.lowest) + math.log2(advice.highest)) // 2
    head = advice.layers[1]
    assert advice.highest == head.max_scale  # the head's largest gradients set the ceiling
    assert head.max_abs * advice.highest <= 65504 < head.max_abs * 2 * advice.highest
    for layer in advice.layers:  # at the advised scale nothing overflows and underflow is within the limit
        stats = fpemu.range_stats(np.concatenate([s[layer.name] for s in steps]), "fp16", scale=advice.scale)
        assert stats.overflow == 0 and stats.underflow_share <= 0.001
    lowest = int(math.log2(advice.lowest))
    assert advice.summary().startswith(f"fp16 holds these gradients at loss scales 2^{lowest} to ")


def test_advice_says_plainly_when_no_scale_fits_bf16_pretrained_in_fp16():
    """Gradients spanning 1e-14..1e2, more than fp16's ~12 decades, as in bf16-pretrained models."""
    rng = np.random.default_rng(2)
    steps = [{"blocks.0": log_uniform(rng, 1e-14, 1e2, 20000), "norm": log_uniform(rng, 1e-4, 1e-2, 1000)}
             for _ in range(2)]
    advice = advise_loss_scale(steps, "fp16", max_underflow_share=0.01)
    assert not advice.fits and advice.scale is None and advice.lowest is None
    assert advice.misfits == ("blocks.0",) and not advice.layers[0].fits_alone and advice.layers[1].fits_alone
    assert advice.reference_scale == advice.layers[0].max_scale  # the largest scale with no overflow
    assert advice.layers[0].underflow_share > 0.01 and advice.layers[0].overflow == 0
    summary = advice.summary()
    assert summary.startswith("No power-of-two loss scale fits fp16")
    assert "blocks.0:" in summary and "its own range is wider than fp16's" in summary
    assert advise_loss_scale(steps, "bf16", max_underflow_share=0.01).fits  # bf16 holds them


def test_advice_layers_that_fit_alone_but_not_together():
    rng = np.random.default_rng(3)
    steps = [{"tiny": rng.standard_normal(2000).astype(np.float32) * 1e-9,
              "huge": rng.standard_normal(2000).astype(np.float32) * 1e3}]
    advice = advise_loss_scale(steps, "fp16", max_underflow_share=0.001)
    assert not advice.fits and all(layer.fits_alone for layer in advice.layers)
    assert advice.misfits == ("tiny",) and "set by huge" in advice.summary()


def test_advice_for_fp8():
    rng = np.random.default_rng(4)
    normal = [{"w": rng.standard_normal(10000).astype(np.float32) * 1e-3}]
    e4m3 = advise_loss_scale(normal, "fp8_e4m3fn", max_underflow_share=0.01)
    e5m2 = advise_loss_scale(normal, "fp8_e5m2", max_underflow_share=0.01)
    assert e4m3.fits and e5m2.fits and e5m2.highest / e5m2.lowest > e4m3.highest / e4m3.lowest
    wide = [{"w": log_uniform(rng, 1e-6, 1.0, 10000)}]  # 20 binades: more than e4m3's 19, less than e5m2's 33
    assert not advise_loss_scale(wide, "fp8_e4m3fn", max_underflow_share=0.01).fits
    assert advise_loss_scale(wide, "fp8_e5m2", max_underflow_share=0.01).fits


@pytest.mark.parametrize("steps,kwargs,error,words", [
    ({"w": np.ones(2)}, {}, TypeError, "steps must be a non-empty list of dicts"),
    ([], {}, TypeError, r"steps must be a non-empty list .*got an empty list"),
    ([{"w": np.ones(2)}, [1.0]], {}, TypeError, r"steps\[1\] must be a dict"),
    ([{"w": np.array([1.0, np.inf])}], {}, ValueError, r"steps\[0\]\['w'\] has non-finite values"),
    ([{"w": np.array(["a"])}], {}, TypeError, r"steps\[0\]\['w'\] must be a real array"),
    ([{"w": np.ones(2)}], {"max_underflow_share": 1.0}, ValueError, r"max_underflow_share must be in \[0, 1\)"),
    ([{"w": np.ones(2)}], {"max_underflow_share": "1%"}, TypeError, "max_underflow_share must be a number"),
    ([{"w": np.ones(2)}], {"fmt": "fp17"}, ValueError, "fp17"),
])
def test_advice_bad_input(steps, kwargs, error, words):
    with pytest.raises(error, match=words):
        advise_loss_scale(steps, **kwargs)


# --- docstrings ------------------------------------------------------------------

@pytest.mark.parametrize("module", [fpemu.audits.advice, fpemu.audits.findings, fpemu.audits.jax_loop,
                                    fpemu.audits.torch_loop])
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


def test_torchs_warnings_name_the_users_line_not_the_audit():
    """torch warns of lr_scheduler.step() before optimizer.step() at its caller's line (stacklevel=2): under the
    audit that caller is the audit's wrapper, whose line the user cannot act on."""
    import warnings
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    with warnings.catch_warnings(record=True) as caught, audit_torch(scaler, optimizer, scheduler):
        warnings.simplefilter("always")
        scheduler.step(); line = sys._getframe().f_lineno  # noqa: E702 -- the warning names this line
    (warning,) = [w for w in caught if "lr_scheduler.step()" in str(w.message)]
    assert (warning.filename, warning.lineno) == (__file__, line)
