"""fpemu.record_torch and replay on a loop that accumulates 4 microbatches per update (a tiny Llama from a
transformers config, fp16 autocast on CPU, GradScaler, AdamW, warmup, clipping): the statistics are each
microbatch's own gradient as the backward hands it over (an independent observer's tensor hooks, counted with
ml_dtypes), not the float32 sum in .grad; and replaying the recorded run under its own scaler, a slower growth
and DeepSpeed's scaler agrees step for step with real reruns under the real GradScaler and the real DeepSpeed
DynamicLossScaler (torch 2.13.0, transformers 5.24, deepspeed 0.19.8 checked)."""

import math

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
# trains a Llama several times over (about a minute on 2 cores)
pytestmark = pytest.mark.stage2("accumulation replays against real reruns; record_torch's per-pass measuring in "
                                "test_record_torch.py's GPT-2 runs")
pytest.importorskip("transformers")

import fpemu  # noqa: E402
from fpemu.traces.recorded import format_thresholds  # noqa: E402
from fpemu.traces.replay import replay  # noqa: E402

from accumulation_loops import MICRO, DeepSpeedRule, batches, llama, train, training  # noqa: E402

STEPS = 16
INIT_SCALE, GROWTH_INTERVAL = 2.0 ** 20, 2  # overflows at 2^20, not at 2^19: a skip every third step
OVERFLOW_FROM = format_thresholds("fp16")[2]


def run(init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL, rule=None, record=False, observe=False):
    model = llama()
    optimizer, scheduler, scaler = training(model, STEPS, init_scale, growth_interval)
    recorder = fpemu.record_torch(scaler, optimizer, model, scheduler) if record else None
    incoming, hooks = [], []
    if observe:  # an independent observer: every gradient each backward hands a parameter, by module
        names = {id(p): name.rpartition(".")[0] for name, p in model.named_parameters()}
        for param in model.parameters():
            hooks.append(param.register_hook(lambda g, n=names[id(param)]: incoming.append((n, g.detach().clone()))))
    seen = train(model, optimizer, scheduler, scaler, batches(STEPS), rule=rule, watch=recorder)
    for hook in hooks:
        hook.remove()
    return recorder, seen, incoming, model


@pytest.fixture(scope="module")
def recorded():
    return run(record=True, observe=True)


def counts(values: np.ndarray, dtype=np.float16) -> tuple:
    """(zero, subnormal, beyond, nan) counts of float32 values cast to ``dtype`` by ml_dtypes."""
    with np.errstate(over="ignore"):
        cast = values.astype(dtype).astype(np.float64)
    tiny = float(ml_dtypes.finfo(dtype).smallest_normal)
    return (int((cast == 0).sum()), int(((np.abs(cast) > 0) & (np.abs(cast) < tiny)).sum()),
            int(np.isinf(cast).sum()), int(np.isnan(values).sum()))


def computed_in_fp16(incoming) -> dict:
    """group -> whether its gradients are fp16 values (autocast computed them in fp16), from the finite elements
    of the first one with finite nonzero elements; the embedding's and the norms' are float32."""
    out = {}
    for name, grad in incoming:
        values = grad.numpy()
        values = values[np.isfinite(values)]
        if name not in out and values.any():
            out[name] = bool((values.astype(np.float16).astype(np.float32) == values).all())
    return out


def test_statistics_are_each_microbatchs_gradient_not_the_sum(recorded):
    rec, seen, incoming, model = recorded
    assert [s.scale for s in rec.steps] == [scale for scale, _ in seen]
    assert [s.overflow for s in rec.steps] == [found for _, found in seen]
    per_step = len(incoming) // STEPS
    assert per_step == MICRO * len(list(model.parameters()))
    in_fp16 = computed_in_fp16(incoming)
    assert not in_fp16["model.embed_tokens"] and in_fp16["lm_head"]
    differs = 0  # float32 gradients whose fp16 classes are not their own: the test tells the two apart
    for index, step in enumerate(rec.steps):
        assert step.microbatches == MICRO
        mine = incoming[index * per_step:(index + 1) * per_step]
        for group, stats in step.grad_stats.items():
            values = np.concatenate([g.numpy().ravel() for name, g in mine if name == group])
            zero, subnormal, beyond, nan = counts(values, np.float16 if in_fp16[group] else np.float32)
            differs += not in_fp16[group] and counts(values) != (zero, subnormal, beyond, nan)
            assert values.size == stats.elements * MICRO
            assert (stats.zero, stats.subnormal, stats.overflow, stats.nan) == tuple(
                n / values.size for n in (zero, subnormal, beyond, nan))
            finite = np.abs(values[~np.isnan(values)])
            assert stats.max_abs == float(finite.max())
        if not step.overflow:  # nothing beyond fp16 in any microbatch of a step that did not overflow
            assert all(stats.overflow == 0 for stats in step.grad_stats.values())
            assert step.compute_max < OVERFLOW_FROM
        else:
            assert step.compute_max == math.inf
    assert differs


def test_the_float32_sum_of_the_microbatches_is_not_what_is_recorded(recorded):
    """The summed .grad of a step that did not overflow exceeds what any microbatch produced."""
    rec, _, incoming, _ = recorded
    per_step = len(incoming) // STEPS
    step = next(i for i, s in enumerate(rec.steps) if not s.overflow)
    summed = {}
    for name, grad in incoming[step * per_step:(step + 1) * per_step]:
        summed[name] = summed.get(name, 0) + grad.abs().max().item()
    largest_recorded = max(s.max_abs for s in rec.steps[step].grad_stats.values())
    assert max(summed.values()) > largest_recorded


@pytest.fixture(scope="module")
def deepspeed_comm():
    pytest.importorskip("deepspeed")  # stage 2 of .ci/run installs it
    from fpemu.adapters.deepspeed_scaler import _deepspeed_comm
    _deepspeed_comm()  # DynamicLossScaler logs through deepspeed.comm: a gloo world of one


def test_replay_under_its_own_scaler_is_the_run(recorded):
    rec = recorded[0]
    same = replay(rec.trace, "torch", **rec.trace.metadata["params"])
    assert [float(s).hex() for s in same.trace.scales] == [s.scale.hex() for s in rec.steps]
    assert same.flags == [s.overflow for s in rec.steps] and same.first_estimate is None


def assert_agrees(replayed, real):
    assert [float(s).hex() for s in replayed.trace.scales] == [float(s).hex() for s, _ in real]
    assert replayed.flags == [found for _, found in real]


def test_replay_under_a_slower_growth_agrees_with_a_real_rerun(recorded):
    rec = recorded[0]
    params = {**rec.trace.metadata["params"], "growth_interval": 4}
    replayed = replay(rec.trace, "torch", **params)
    assert replayed.counts()["estimated"] > 0  # off the recorded scales: decided from compute_max
    assert_agrees(replayed, run(growth_interval=4)[1])


@pytest.mark.parametrize("delayed_shift", [1, 2])
def test_replay_under_deepspeed_agrees_with_the_real_dynamic_loss_scaler(recorded, deepspeed_comm, delayed_shift):
    rec = recorded[0]
    params = dict(init_scale=INIT_SCALE, scale_window=2, min_scale=1, delayed_shift=delayed_shift,
                  consecutive_hysteresis=False)
    replayed = replay(rec.trace, "deepspeed", **params)
    assert replayed.counts()["estimated"] > 0
    assert_agrees(replayed, run(growth_interval=10 ** 6, rule=DeepSpeedRule(**params))[1])
