"""fpemu.record_torch on a tiny real GPT-2 (transformers, random weights) under fp16 autocast on CPU:
the recorded scale, found-inf, skips and growth tracker are what the loop itself reads from the scaler,
the gradient statistics match a numpy cast of the same gradients, the shadow pass counts true underflow,
and the trace round-trips through its file."""

import math
import pathlib
import sys

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import fpemu  # noqa: E402
from fpemu.traces import read_trace  # noqa: E402
from fpemu.traces.binades import CODES, numpy_codes  # noqa: E402
from fpemu.traces.recorded import ShadowHistogram, format_thresholds, recorded_steps  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
import gpt2_loop  # noqa: E402

STEPS, BATCH, LENGTH = 8, 2, 8
INIT_SCALE = 2.0 ** 22  # overflows fp16 for the first steps, then backs off into range


def tiny_gpt2():
    return gpt2_loop.make_model(layers=2, width=32, heads=2, vocab=128, context=16)


def numpy_stats(grad: np.ndarray, fmt_dtype) -> tuple:
    """(zero, subnormal, overflow, nan counts, max_abs, min_nonzero) by casting with ml_dtypes."""
    with np.errstate(over="ignore"):
        cast = grad.astype(fmt_dtype).astype(np.float64)
    tiny = float(ml_dtypes.finfo(fmt_dtype).smallest_normal)
    magnitude = np.abs(grad.astype(np.float64))
    finite_or_inf = magnitude[~np.isnan(magnitude)]
    nonzero = finite_or_inf[finite_or_inf > 0]
    return (int((cast == 0).sum()), int(((np.abs(cast) > 0) & (np.abs(cast) < tiny)).sum()),
            int(np.isinf(cast).sum()), int(np.isnan(grad).sum()),
            float(finite_or_inf.max(initial=0.0)), float(nonzero.min(initial=math.inf)))


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """Record the loop; on the side, read what the scaler and the gradients were at each attempt."""
    path = tmp_path_factory.mktemp("record") / "run.json"
    model = tiny_gpt2()
    optimizer, scheduler, scaler = gpt2_loop.make_training(model, steps=STEPS, warmup=2, init_scale=INIT_SCALE,
                                                           growth_interval=2)
    data = gpt2_loop.batches(STEPS, BATCH, LENGTH, 128)
    seen = {"scale": [], "tracker": [], "grads": [], "shadow": []}
    with fpemu.record_torch(scaler, optimizer, model, scheduler, shadow_every=3, batch_size=BATCH, path=path,
                            name="tiny") as rec:
        for tokens in data:
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(tokens, labels=tokens).loss
            scaler.scale(loss).backward()
            seen["scale"].append(scaler.get_scale())
            seen["grads"].append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
            due = rec.shadow_due
            assert rec.shadow(lambda: model(tokens, labels=tokens).loss) is None or due
            seen["shadow"].append(due)
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            seen["tracker"].append(int(scaler._get_growth_tracker()))
    return rec, seen, path, model


def test_scaler_fields_are_what_the_loop_reads(recorded):
    rec, seen, _, _ = recorded
    steps = rec.steps
    assert [s.step for s in steps] == list(range(STEPS))
    assert [s.scale.hex() for s in steps] == [float(v).hex() for v in seen["scale"]]
    assert [s.growth_counter for s in steps] == seen["tracker"]
    assert any(s.overflow for s in steps) and not all(s.overflow for s in steps)
    assert [s.applied for s in steps] == [not s.overflow for s in steps]
    summary = rec.trace.summary
    assert summary["attempts"] == STEPS and summary["skipped_updates"] == sum(s.overflow for s in steps)
    assert summary["examples"] == STEPS * BATCH and summary["scheduler_steps"] == STEPS
    assert summary["final_scale"] == rec.audit._scaler.get_scale()
    # an overflowed attempt shows it in its statistics
    for s in steps:
        nonfinite = any(g.overflow or g.nan for g in s.grad_stats.values())
        assert nonfinite == s.overflow


def test_gradient_statistics_match_a_numpy_cast(recorded):
    rec, seen, _, model = recorded
    names = dict(model.named_parameters())
    for step, grads in zip(rec.steps, seen["grads"]):
        for group, stats in step.grad_stats.items():
            members = [n for n in names if (n.rpartition(".")[0] or n) == group]
            flat = np.concatenate([grads[n].numpy().reshape(-1) for n in members])
            zero, sub, over, nan, largest, smallest = numpy_stats(flat, np.float16)
            assert stats.elements == flat.size
            shares = tuple(count / flat.size for count in (zero, sub, over, nan))
            assert (stats.zero, stats.subnormal, stats.overflow, stats.nan) == shares, (step.step, group)
            assert stats.max_abs.hex() == largest.hex() and stats.min_nonzero.hex() == smallest.hex()


def test_loss_norm_and_lr(recorded):
    rec, seen, _, _ = recorded
    for step, grads, scale in zip(rec.steps, seen["grads"], seen["scale"]):
        norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads.values())) / scale
        if step.overflow:
            assert not math.isfinite(step.grad_norm)
        else:
            assert step.grad_norm == pytest.approx(norm, rel=1e-12)
        assert math.isfinite(step.loss) and step.loss > 0
    assert rec.steps[0].lr == 0.0 and rec.steps[1].lr == pytest.approx(5e-4)  # warmup over 2 steps


def test_shadow_counts_true_underflow_element_by_element(recorded):
    rec, seen, _, _ = recorded
    assert [s.shadow is not None for s in rec.steps] == seen["shadow"] == [i % 3 == 0 for i in range(STEPS)]
    for step in rec.steps:
        if step.shadow is not None:
            assert set(step.shadow) == set(step.grad_stats)
            assert all(0 <= v.underflow <= 1 and 0 <= v.subnormal <= 1 for v in step.shadow.values())


def test_shadow_finds_underflow_the_run_statistics_cannot_see():
    """At scale 1 an fp16 backward flushes small gradients to plain zeros: the shadow pass counts them."""
    model = tiny_gpt2()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=1000)
    tokens = gpt2_loop.batches(1, BATCH, LENGTH, 128)[0]
    with fpemu.record_torch(scaler, optimizer, model, shadow_every=1) as rec:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(tokens, labels=tokens).loss
        scaler.scale(loss).backward()
        run_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        rec.shadow(lambda: model(tokens, labels=tokens).loss)
        scaler.step(optimizer)
        scaler.update()
    with torch.autocast("cpu", enabled=False):
        reference = torch.autograd.grad(model(tokens, labels=tokens).loss, list(model.parameters()))
    shadow = rec.steps[0].shadow
    group = "transformer.h.0.attn.c_attn"
    names = [n for n, _ in model.named_parameters()]
    members = [i for i, n in enumerate(names) if n.startswith(group + ".")]
    fp32 = np.concatenate([reference[i].numpy().reshape(-1) for i in members])
    run = np.concatenate([run_grads[names[i]].numpy().reshape(-1) for i in members])
    lost = int(((fp32 != 0) & (run == 0)).sum())
    assert lost > 0 and shadow[group].underflow == lost / fp32.size
    zero_at_most, normal_from, _ = format_thresholds("fp16")
    sub = int(((fp32 != 0) & (np.abs(run) > zero_at_most) & (np.abs(run) < normal_from)).sum())
    assert sub > 0 and shadow[group].subnormal == sub / fp32.size
    # the float32 gradients by binade: a replay recounts from them what any scale and format would lose
    histogram = rec.steps[0].shadow_histogram[group]
    assert histogram == ShadowHistogram.from_counts(fp32.size, np.bincount(numpy_codes(fp32), minlength=CODES))
    assert histogram.zero == int((fp32 == 0).sum()) and histogram.nonfinite == 0
    for fmt, scale in (("fp16", 1.0), ("fp16", 2.0 ** 9), ("bf16", 2.0 ** -100), ("fp8_e5m2", 2.0 ** 12),
                       ("fp16", 3.0), ("fp8_e4m3fn", 1e3)):
        rounded = np.abs(fpemu.quantize(fp32.astype(np.float64) * scale, fmt))  # exact product, rounded once
        under = int(((fp32 != 0) & (rounded == 0)).sum()) / fp32.size
        subnormal = int(((rounded > 0) & (rounded < fpemu.get_format(fmt).min_normal)).sum()) / fp32.size
        shares = histogram.shares(scale, fmt)
        if math.frexp(scale)[0] == 0.5:  # a power of two: exact
            assert shares.exact and shares.underflow == (under, under) and shares.subnormal == (subnormal,) * 2
        else:
            assert shares.underflow[0] <= under <= shares.underflow[1]
            assert shares.subnormal[0] <= subnormal <= shares.subnormal[1]


def test_trace_file_round_trips(recorded):
    rec, _, path, _ = recorded
    trace = read_trace(path)
    assert trace.metadata["source"] == "recorded_run" and trace.metadata["framework"] == "torch"
    assert trace.metadata["params"]["init_scale"] == INIT_SCALE and trace.metadata["profile"] == "torch"
    assert trace.metadata["recorder"] == {"groups": "module", "shadow_every": 3, "compute_format": "fp16",
                                          "statistics": True}
    assert trace.steps == rec.trace.steps
    assert [s.scale for s in recorded_steps(trace)] == [s.scale for s in rec.steps]


def test_groups_and_bad_arguments():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")

    def one_step(rec):
        with rec:
            scaler.scale(model(torch.ones(1, 2)).sum()).backward()
            scaler.step(optimizer)
            scaler.update()
        return sorted(rec.steps[0].grad_stats)

    assert one_step(fpemu.record_torch(scaler, optimizer, model)) == ["0", "1"]
    assert one_step(fpemu.record_torch(scaler, optimizer, model, groups="parameter")) == [
        "0.bias", "0.weight", "1.bias", "1.weight"]
    assert one_step(fpemu.record_torch(scaler, optimizer, model, groups=lambda n, p: "all")) == ["all"]
    assert one_step(fpemu.record_torch(scaler, optimizer)) == ["param_groups[0]"]
    with pytest.raises(ValueError, match="groups must be one of module, parameter"):
        fpemu.record_torch(scaler, optimizer, model, groups="layer")
    with pytest.raises(TypeError, match="optimizer must be one torch.optim.Optimizer"):
        fpemu.record_torch(scaler, [optimizer])
    with pytest.raises(ValueError, match="shadow_every"):
        fpemu.record_torch(scaler, optimizer, shadow_every=-2)
    with pytest.raises(ValueError, match="unknown format"):
        fpemu.record_torch(scaler, optimizer, compute_format="fp12")
    with pytest.raises(TypeError, match="must return a str"):
        fpemu.record_torch(scaler, optimizer, model, groups=lambda n, p: 3)


def test_the_audit_still_reports_while_recording():
    weight = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=100.0)
    with fpemu.record_torch(scaler, optimizer) as rec:
        scaler.scale((weight * torch.tensor([3.0, 4.0])).sum()).backward()
        torch.nn.utils.clip_grad_norm_([weight], max_norm=2.0)
        scaler.step(optimizer)
        scaler.update()
    assert [f.kind for f in rec.audit.findings] == ["clip_before_unscale"]
    # what the backward produced (400 = 4 x the scale 100), not what the clip left (1.6): overflow is decided
    # by what the backward produces at a scale
    assert rec.steps[0].grad_stats["param_groups[0]"].max_abs == 400.0


def test_large_gradients_are_measured_in_pieces_with_the_same_result(monkeypatch):
    model = torch.nn.Linear(100, 100)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)

    def record(chunk):
        monkeypatch.setattr(torch_run, "CHUNK", chunk)
        with fpemu.record_torch(scaler, optimizer, model) as rec:
            scaler.scale(torch.ones(()))  # the scaler's first scale() creates its scale
            model.weight.grad = torch.randn(100, 100, generator=torch.Generator().manual_seed(0)) * 1e-5
            model.weight.grad[3, [0, 50, 99]] = torch.tensor([math.nan, math.inf, 0.0])
            model.bias.grad = None
            scaler.step(optimizer)
            scaler.update()
        return rec.steps[0].grad_stats

    from fpemu.recorders import torch_run
    whole, pieces = record(1 << 22), record(1000)
    assert whole == pieces
    weight = whole["weight"]
    assert (weight.overflow, weight.nan) == (1 / 10_000, 1 / 10_000) and weight.max_abs == math.inf
    assert whole["bias"].zero == 1.0 and whole["bias"].elements == 100


@pytest.mark.parametrize("held", [1, 3000, 1 << 20], ids=["each-at-once", "some-held", "a-pass-held"])
def test_compute_max_is_the_largest_fp16_gradient_an_observer_sees(monkeypatch, held):
    """compute_max against an independent observer's hooks (every fp16 module output's gradient and every
    parameter gradient the backward hands over, in float64), with activation gradients measured as each arrives,
    a few held at a time, or a whole pass held (fpemu.recorders.torch_run.ACTIVATION_BATCH).  The model makes an
    activation's gradient the largest (small inputs, no biases, a large last layer), so a held one lost would
    show."""
    from fpemu.recorders import torch_run
    monkeypatch.setattr(torch_run, "ACTIVATION_BATCH", held)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64, bias=False), torch.nn.GELU(), torch.nn.Linear(64, 64, bias=False),
                                torch.nn.Tanh(), torch.nn.Linear(64, 4, bias=False))
    with torch.no_grad():
        model[4].weight.mul_(100)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    seen = {"activations": [], "parameters": []}

    def largest(kind):
        return lambda g: seen[kind].append(float(g.detach().double().abs().max()))

    def observe(_module, _args, output):
        if output.dtype == torch.float16 and output.requires_grad:
            output.register_hook(largest("activations"))
    hooks = [m.register_forward_hook(observe) for m in model] + [
        p.register_hook(largest("parameters")) for p in model.parameters()]
    maxima = []
    with fpemu.record_torch(scaler, optimizer, model) as rec:
        for step in range(3):
            optimizer.zero_grad()
            for micro in range(2):
                x = torch.randn(32, 16, generator=torch.Generator().manual_seed(10 * step + micro)) * 2.0 ** -10
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = model(x).float().square().mean() / 2
                scaler.scale(loss).backward()
            assert max(seen["activations"]) > max(seen["parameters"])
            maxima.append(max(seen["activations"]))
            seen = {kind: [] for kind in seen}
            scaler.step(optimizer)
            scaler.update()
    for hook in hooks:
        hook.remove()
    assert [step.compute_max for step in rec.steps] == maxima and len(maxima) == 3


def test_gradients_measured_together_count_as_each_alone():
    """Small gradients of several dtypes measured in one batch: each one's class counts and extremes are
    what bucketize, bincount, amin and amax give it alone (NaN and inf in a piece between others)."""
    from fpemu.recorders import torch_run
    generator = torch.Generator().manual_seed(0)
    sizes = ((7, 1e-6), (300, 1e-3), (1, 1e-9), (64, 1e5))
    pieces = [torch.randn(n, generator=generator) * scale for n, scale in sizes]
    pieces[1][[0, 5, 9]] = torch.tensor([math.nan, math.inf, 0.0])
    edges = torch_run._class_bounds(torch, "fp16")
    at_edges = torch.tensor(edges)  # each edge and its two float32 neighbours: the classes' boundaries
    at_edges = torch.cat([at_edges, torch.nextafter(at_edges, torch.zeros(3)), torch.nextafter(at_edges, at_edges * 2)])
    # a piece of zeros and NaN (no nonzero value: min_nonzero inf) and one of zeros and inf (min_nonzero inf)
    pieces += [pieces[0].double() * 1e-3, pieces[3].bfloat16(), torch.zeros(5), -at_edges,
               torch.tensor([0.0, math.nan, -math.nan]), torch.tensor([-math.inf, 0.0])]
    counts, extremes = torch_run._batch_measures(torch, pieces, edges)
    for piece, piece_counts, (smallest, largest) in zip(pieces, counts.tolist(), extremes.tolist()):
        magnitude = piece.abs().float()
        expected = torch.bincount(torch.bucketize(magnitude, torch.tensor(edges)), minlength=4).tolist()
        nonzero = magnitude[magnitude > 0]
        assert piece_counts == expected
        assert smallest == (float(nonzero.amin()) if nonzero.numel() else math.inf)
        assert largest == float(magnitude.amax()) or (math.isnan(largest) and bool(magnitude.isnan().any()))


def test_docstring_examples():
    import doctest

    from fpemu.recorders import torch_run
    result = doctest.testmod(torch_run, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0
