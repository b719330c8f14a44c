"""Loss scaling across ranks: the model (numpy), [ranks] specs, and real torch.distributed ranks over gloo.

The default suite runs the model, the spec checks and one 2-rank `fpemu run` (one process group,
5 cases).  FPEMU_TEST_ENVS=1 adds every shipped [ranks] spec at 2 and 4 ranks, the real ranks
against the model on every case, and the launcher's timeout path.
"""

import importlib.util
import json
import os
import pathlib

import numpy as np
import pytest

import fpemu
from fpemu.adapters import torch_ranks
from fpemu.cli import main
from fpemu.ranks import RanksCase, chained_scales, cross_rank_verdict, predict, reduce_found_inf
from fpemu.ranks.model import MAX, SUM, FoundInfReduction
from fpemu.specs import RanksScenario, SpecError, load_specs, parse_spec

SPECS = pathlib.Path(__file__).resolve().parent.parent / "specs"
BAD_AT = (2, 7, 8)
FLAGS = tuple(step in BAD_AT for step in range(12))
PARAMS = {"init_scale": 65536.0, "growth_interval": 3}

no_torch = importlib.util.find_spec("torch") is None
needs_torch = pytest.mark.skipif(no_torch, reason="torch not installed")
stage2 = pytest.mark.stage2("every [ranks] spec at 2 and 4 ranks, and a 45 s hang; one spec of each layout in the "
                            "tests above")


more_real_ranks = pytest.mark.stage2("more real-rank runs; the default suite keeps one of each path")


def _case(layout, scaler, inject, world_size=2):
    overflow = tuple(FLAGS if rank == 1 else (False,) * 12 for rank in range(world_size))
    return RanksCase(world_size, layout, scaler, inject, overflow, dict(PARAMS))


# --- the model ---------------------------------------------------------------------------

# The issue's table, as the model predicts it: per rank, the skipped steps.
@pytest.mark.parametrize("layout,scaler,inject,skips", [
    ("ddp", "torch", "loss", [BAD_AT, BAD_AT]),
    ("ddp", "torch", "grad_before_reduce", [BAD_AT, BAD_AT]),
    ("ddp", "torch", "grad_after_reduce", [(), BAD_AT]),
    ("fsdp1", "torch", "grad_before_reduce", [BAD_AT, ()]),  # the shard owner skips, not the rank that overflowed
    ("fsdp1", "torch", "shard", [(), BAD_AT]),
    ("fsdp1", "torch_sharded", "grad_before_reduce", [BAD_AT, BAD_AT]),
    ("fsdp1", "torch_sharded", "grad_after_reduce", [BAD_AT, BAD_AT]),
    ("fsdp2", "torch", "grad_after_reduce", [BAD_AT, BAD_AT]),
    ("fsdp2", "torch_sharded", "shard", [BAD_AT, BAD_AT]),
])
def test_model_predicts_the_issue_table(layout, scaler, inject, skips):
    prediction = predict(_case(layout, scaler, inject))
    assert [tuple(t.skipped) for t in prediction.traces] == [tuple(s) for s in skips]
    assert prediction.verdict.agree == (skips[0] == skips[1])
    any_rank = fpemu.simulate_scaler(FLAGS, "torch" if scaler == "torch" else "torch_sharded", **PARAMS)
    for trace, skipped in zip(prediction.traces, skips):  # agreeing ranks follow the any-rank sequence
        if skipped:
            assert trace.scales == any_rank.scales and trace.final_scale == any_rank.final_scale


def test_ddp_after_reduce_scales_part_as_measured():
    prediction = predict(_case("ddp", "torch", "grad_after_reduce"))
    assert [t.scales[-1] for t in prediction.traces] == [524288.0, 16384.0]
    assert prediction.verdict.describe().startswith("ranks disagree from step 2: rank 1 skipped the update, rank 0")


def test_four_ranks_shard_owner_and_sum_reduction():
    owner = predict(_case("fsdp1", "torch", "grad_before_reduce", world_size=4))
    assert (owner.verdict.step, owner.verdict.skipped, owner.verdict.applied) == (2, (0,), (1, 2, 3))
    summed = reduce_found_inf(np.array([[True], [True], [False], [True]]),
                              FoundInfReduction("x", ("*",), ((SUM, "world", ""),), "", "", "", ""))
    assert summed.ravel().tolist() == [True] * 4
    maxed = reduce_found_inf(np.array([[False], [False]]), FoundInfReduction("x", ("*",), ((MAX, "world", ""),), "", "", "", ""))
    assert maxed.ravel().tolist() == [False, False]


def test_cross_rank_verdict_names_a_scale_that_differs_without_a_skip():
    verdict = cross_rank_verdict([[8.0, 8.0], [8.0, 16.0]], [[True, True], [True, True]])
    assert (verdict.step, verdict.field) == (1, "scale")
    assert cross_rank_verdict([[8.0], [8.0]], [[False], [False]]).agree


def test_megatron_chained_optimizers_scales_drift():
    traces, applied, drift = chained_scales([FLAGS, (False,) * 12], initial_scale=65536.0, min_scale=1.0,
                                            growth_interval=3, hysteresis=1)
    assert applied.tolist() == [not f for f in FLAGS]  # the chain skips whenever one sub-optimizer overflowed
    assert traces[0].final_scale != traces[1].final_scale
    assert (drift.step, drift.field) == (3, "scale")  # the expert optimizer backed off; the dense one did not


# --- specs -------------------------------------------------------------------------------

RANKS_SPEC = """
description = "t"
steps = 4
[ranks]
layout = "fsdp1"
scaler = "torch"
world_sizes = [2, 4]
inject = ["grad_before_reduce", "shard"]
[ranks.overflow.1]
source = "explicit"
sequence = [false, true, false, false]
[ranks.expect_divergence.shard]
step = 1
reason = "own shard"
"""


ZERO_SPEC = RANKS_SPEC.replace('layout = "fsdp1"', 'layout = "zero1"').replace('scaler = "torch"', 'scaler = "deepspeed"')\
    .replace('["grad_before_reduce", "shard"]', '["grad_after_reduce"]').replace("[ranks.expect_divergence.shard]\nstep = 1\n"
                                                                          'reason = "own shard"\n', "")


@pytest.mark.parametrize("change,words", [
    (("world_sizes = [2, 4]", "world_sizes = [4]\nmodel_parallel = 2"), None),
    (("world_sizes = [2, 4]", "world_sizes = [4]\nmodel_parallel = 2\nreduce_over = [\"dp\"]"), None),
    (("world_sizes = [2, 4]", "world_sizes = [2, 4]\nmodel_parallel = 2"),
     "ranks.model_parallel: expected a divisor of every world size that leaves at least two data-parallel ranks, got 2 for 2"),
    (("world_sizes = [2, 4]", "world_sizes = [4]\nreduce_over = [\"world\"]"),
     "ranks.reduce_over: expected some of deepspeed's own found-inf groups \\(dp, mp\\)"),
])
def test_model_parallel_spec_keys(change, words):
    text = ZERO_SPEC.replace(*change)
    if words is None:
        [(_, case, _)] = parse_spec(text, "r.toml").cases()
        assert case.model_parallel == 2 and case.reduce_over in (None, ("dp",))
        return
    with pytest.raises(SpecError, match=f"r.toml: .*{words}"):
        parse_spec(text, "r.toml")
    with pytest.raises(SpecError, match="ranks.model_parallel: layout fsdp1 runs data parallelism only"):
        parse_spec(RANKS_SPEC.replace("world_sizes = [2, 4]", "world_sizes = [4]\nmodel_parallel = 2"), "r.toml")


def test_found_inf_reduced_over_the_data_parallel_group_only_parts_the_model_parallel_slices():
    flags = tuple(FLAGS if rank == 1 else (False,) * 12 for rank in range(4))
    both = predict(RanksCase(4, "zero1", "deepspeed", "grad_after_reduce", flags, {"init_scale": 256.0}, 2))
    assert both.verdict.agree and [tuple(t.skipped) for t in both.traces] == [BAD_AT] * 4
    dp_only = predict(RanksCase(4, "zero1", "deepspeed", "grad_after_reduce", flags, {"init_scale": 256.0}, 2, ("dp",)))
    assert (dp_only.verdict.step, dp_only.verdict.skipped, dp_only.verdict.applied) == (2, (1, 3), (0, 2))
    # before the reduction, the inf lands in element 0: the first rank of rank 1's data-parallel group, rank 1
    early = predict(RanksCase(4, "zero1", "deepspeed", "grad_before_reduce", flags, {}, 2, ("dp",)))
    assert early.visible[:, 2].tolist() == [False, True, False, False]


def test_ranks_spec_builds_a_case_per_world_size_and_injection():
    scenario = parse_spec(RANKS_SPEC, "r.toml")
    assert isinstance(scenario, RanksScenario) and scenario.adapter == "torch_fsdp1"
    names = [name for name, _, _ in scenario.cases()]
    assert names == ["r.grad_before_reduce.2ranks", "r.shard.2ranks", "r.grad_before_reduce.4ranks", "r.shard.4ranks"]
    _, case, declared = scenario.cases()[3]
    assert case.overflow[1] == (False, True, False, False) and case.overflow[3] == (False,) * 4
    assert declared.step == 1 and declared.ends == "completes"


@pytest.mark.parametrize("change,words", [
    (('layout = "fsdp1"', 'layout = "ddp"'), r"ranks.inject: 'shard' needs a layout whose shards split the probe .*\(fsdp1, fsdp2\)"),
    (('layout = "fsdp1"', 'layout = "zero2"'), "ranks.scaler: 'torch' does not run on layout 'zero2'; expected one of deepspeed"),
    (("[ranks.overflow.1]", "[ranks.overflow.2]"), "ranks.overflow.2: expected a rank 0..1"),
    (('scaler = "torch"', 'scaler = "apex"'), "ranks.scaler: expected one of torch, torch_sharded"),
    (("world_sizes = [2, 4]", "world_sizes = [1]"), r"ranks.world_sizes\[0\]: expected an integer >= 2"),
    (('inject = ["grad_before_reduce", "shard"]', 'inject = ["grad_before_reduce"]'),
     "ranks.expect_divergence.shard: unknown key"),
    (("step = 1\n", ""), "ranks.expect_divergence.shard.step: missing required key"),
    (("sequence = [false, true, false, false]", "sequence = [true]"), "ranks.overflow.1.sequence: expected steps=4"),
    (('reason = "own shard"', 'reason = "own shard"\nends = "crash"'), "ends: expected one of completes, abort"),
    (("[ranks]", "[scaler]\nprofile = \"torch\"\n[ranks]"), "scaler: a \\[ranks\\] spec says"),
    (("world_sizes = [2, 4]", "world_sizes = [2, 4]\ntimeout_s = 0"),
     r"ranks.timeout_s: expected seconds > 0 \(a finite number\), got 0"),
    (("world_sizes = [2, 4]", "world_sizes = [2, 4]\ntimeout_s = \"60\""), "ranks.timeout_s: expected seconds > 0"),
    (("world_sizes = [2, 4]", "world_sizes = [2, 4]\ntimeout_s = inf"), "ranks.timeout_s: expected seconds > 0"),
])
def test_ranks_spec_errors_name_the_key(change, words):
    with pytest.raises(SpecError, match=f"r.toml: .*{words}"):
        parse_spec(RANKS_SPEC.replace(*change), "r.toml")


def test_case_timeout_scales_with_steps_and_ranks_unless_the_spec_or_the_command_line_sets_it():
    """A fixed 60 s called a healthy 8,000-step DDP case a hang (it took 131 s): the default grows with
    steps x ranks, ranks.timeout_s replaces it, and --rank-timeout replaces both."""
    from fpemu.harness.ranks import case_payload, case_timeout
    long = parse_spec(RANKS_SPEC.replace("steps = 4", "steps = 8000").replace(
        'source = "explicit"\nsequence = [false, true, false, false]', 'source = "periodic"\nperiod = 1000'),
        "long.toml")
    _, case, _ = long.cases()[0]
    assert case.world_size == 2 and case_timeout(long, case) == 60 + 0.05 * 8000 * 2 > 3 * 131
    assert case_payload(long, case)["timeout_s"] == 860.0
    own = parse_spec(RANKS_SPEC.replace("world_sizes = [2, 4]", "world_sizes = [2, 4]\ntimeout_s = 900"), "own.toml")
    assert own.timeout_s == 900.0 and case_timeout(own, own.cases()[0][1]) == 900.0
    assert case_timeout(own, own.cases()[0][1], rank_timeout=5.0) == 5.0


def test_shipped_ranks_specs_cover_the_issue_table():
    scenarios = [s for s in load_specs([SPECS]) if isinstance(s, RanksScenario)]
    setups = {(s.layout, s.scaler) for s in scenarios}
    assert {("ddp", "torch"), ("fsdp1", "torch"), ("fsdp1", "torch_sharded"), ("fsdp2", "torch"),
            ("fsdp2", "torch_sharded")} <= setups
    for scenario in scenarios:  # every declared divergence is one the model predicts
        for name, case, declared in scenario.cases():
            verdict = predict(case).verdict
            assert (None if verdict.agree else verdict.step) == (declared.step if declared else None), name


# --- real ranks --------------------------------------------------------------------------

UNDECLARED = """
description = "DDP + GradScaler, inf after the all-reduce, no divergence declared"
steps = 12
[ranks]
layout = "ddp"
scaler = "torch"
world_sizes = [2]
inject = ["loss", "grad_after_reduce"]
params = { init_scale = 65536.0, growth_interval = 3 }
[ranks.overflow.1]
source = "explicit"
sequence = [false, false, true, false, false, false, false, true, true, false, false, false]
"""


@needs_torch
def test_fpemu_run_fails_an_undeclared_cross_rank_divergence_naming_step_and_ranks(tmp_path, capsys):
    specs, reports = tmp_path / "specs", tmp_path / "reports"
    specs.mkdir()
    (specs / "undeclared.toml").write_text(UNDECLARED)
    fsdp = UNDECLARED.replace('"ddp"', '"fsdp1"').replace('"loss", ', '"grad_before_reduce", ')
    (specs / "fsdp.toml").write_text(fsdp + "".join(
        f'[ranks.expect_divergence.{inject}]\nstep = 2\nreason = "GradScaler reduces no found-inf"\n'
        for inject in ("grad_before_reduce", "grad_after_reduce")))
    (specs / "wrong.toml").write_text(UNDECLARED.replace('"ddp"', '"fsdp2"').replace('"loss", ', "") +
                                      '[ranks.expect_divergence.grad_after_reduce]\nstep = 2\nreason = "r"\n')
    code = main(["run", "--specs", str(specs), "--reports", str(reports), "--quiet"])
    out = capsys.readouterr().out
    assert code == 1
    line = next(l for l in out.splitlines() if "undeclared.grad_after_reduce.2ranks" in l)
    assert line.split()[0] == "diverged"
    assert "undeclared cross-rank divergence: ranks disagree from step 2: rank 1 skipped the update, rank 0 applied" in line
    assert "replicas' parameters differ from step 2" in line
    assert "match  undeclared.loss.2ranks / torch_ddp@cpu" in out
    assert "known divergence  fsdp.grad_before_reduce.2ranks / torch_fsdp1@cpu" in out
    assert ("diverged  wrong.grad_after_reduce.2ranks / torch_fsdp2@cpu [declared a cross-rank divergence at step 2 "
            "(r); the ranks agree]") in out  # FSDP2's DTensor check MAXes found-inf over the mesh
    verdicts = json.loads((reports / "diff.json").read_text())["verdicts"]
    assert {v["spec"]: v["status"] for v in verdicts} == {"wrong.grad_after_reduce.2ranks": "diverged",
        "undeclared.loss.2ranks": "match", "undeclared.grad_after_reduce.2ranks": "diverged",
        "fsdp.grad_before_reduce.2ranks": "known divergence", "fsdp.grad_after_reduce.2ranks": "known divergence"}
    observed = sorted(p.name for p in (reports / "observed" / "ranks").glob("*.json"))
    assert len(observed) == 10 and "undeclared.grad_after_reduce.2ranks.rank1.torch_ddp-cpu.json" in observed
    # an observed trace keeps the scaler's parameters as the real GradScaler holds them (its defaults completed)
    kept = json.loads((reports / "observed" / "ranks" / observed[0]).read_text())["metadata"]["params"]
    assert kept == {"init_scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 3}
    assert ("| `fsdp` (FSDP1 + GradScaler) | 2 | - | **diverge**: rank 0 skips 2, 7, 8; rank 1 skips none; "
            "last scales 524288 vs 16384 (known divergence) | - |") in (reports / "ranks.md").read_text()


@needs_torch
@stage2
def test_real_ranks_equal_the_model_on_every_shipped_case(tmp_path):
    from fpemu.harness.ranks import run_ranks
    outcomes, _ = run_ranks([SPECS], tmp_path / "golden", tmp_path / "observed")
    assert len(outcomes) >= 40
    for outcome in outcomes:
        assert outcome.verdict.status in ("match", "known divergence"), (outcome.name, outcome.verdict.note)
        if outcome.observed:  # every rank equals the model bit for bit, even where ranks part
            for real, model in zip(outcome.observed, outcome.prediction.traces):
                assert [float(v).hex() for v in real.column("scale")] == [float(v).hex() for v in model.scales]
                assert real.column("applied") == model.applied.tolist()


@needs_torch
@stage2
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")
def test_zero_skips_step_0_at_a_scale_of_2_16_because_its_fp16_gradient_overflows_on_one_rank_too():
    # Why ZeRO on several ranks skipped step 0 with no injection at DeepSpeed's default 2^16: the tiny model's
    # gradient w.r.t. its first weight is 1.0, and 1.0 * 2^16 = 65536 rounds to inf in fp16 (largest 65504).
    from fpemu.adapters.deepspeed_scaler import run_engine
    with np.errstate(over="ignore"):  # the overflow is the point
        assert np.float16(2.0**16) == np.inf and np.float16(2.0**15) == 32768.0
    assert run_engine(3, (), 1, initial_scale_power=16).skipped == [True, False, False]  # a world of one
    assert run_engine(3, (), 1, initial_scale_power=15).skipped == [False, False, False]
    # on 2 ranks at 2^16, the probe model's gradients (scaled, within fp16's range) skip nothing: no garbage in
    # ZeRO's buffers, no overflow check over padding
    from fpemu.adapters.torch_ranks import run_cases
    cases = [{"layout": layout, "scaler": "deepspeed", "params": {"init_scale": 65536.0, "scale_window": 100},
              "inject": "loss", "overflow": [[False] * 3] * 2} for layout in ("zero1", "zero2")]
    for result in run_cases(cases, 2):
        assert [r.applied for r in result.ranks] == [[True] * 3] * 2, result.error


@needs_torch
@stage2
def test_a_hang_is_a_result_and_the_next_case_runs_in_a_fresh_group():
    from fpemu.adapters.torch_ranks import run_cases
    # A case that cannot finish in time stands for a hang; the timeout leaves room for a fresh group's first
    # case (its lazy initialisation took up to 21 s here under a load average of 12).
    slow = {"layout": "fsdp1", "scaler": "torch", "params": {}, "inject": "loss", "overflow": [[False] * 10**6] * 2}
    quick = {"layout": "ddp", "scaler": "torch", "params": {}, "inject": "loss", "overflow": [[True], [False]]}
    first, second = run_cases([slow, quick], 2, case_timeout_s=45.0)
    assert first.error.startswith("timeout: no result within 45 s") and not first.ranks
    assert second.error is None and [r.applied for r in second.ranks] == [[False], [False]]


@needs_torch
@stage2
def test_a_long_healthy_case_runs_within_the_default_timeout():
    """20,000 DDP steps on 2 ranks: about 2 minutes here (8,000 took 50 s), past the old fixed 60 s; the
    default gives it 60 + 0.05 * 20,000 * 2 = 2,060 s."""
    from fpemu.adapters.torch_ranks import run_cases
    case = {"layout": "ddp", "scaler": "torch", "params": {}, "inject": "loss", "overflow": [[False] * 20000] * 2}
    [result] = run_cases([case], 2)
    assert result.error is None and [len(r.applied) for r in result.ranks] == [20000, 20000]


LONG_DDP = """
description = "DDP, many steps"
steps = 3000
[ranks]
layout = "ddp"
scaler = "torch"
world_sizes = [2]
inject = ["loss"]
{timeout}
[ranks.overflow.1]
source = "periodic"
period = 1000
"""


@needs_torch
@pytest.mark.stage2("test_case_timeout_scales_with_steps_and_ranks_unless_the_spec_or_the_command_line_sets_it "
                    "(the limit); test_pool's and test_bounds' jobs past their timeout (the result line)")
@pytest.mark.parametrize("in_spec,on_command_line", [("timeout_s = 0.5", []),
                                                     pytest.param("timeout_s = 600", ["--rank-timeout", "0.5"],
                                                                  marks=more_real_ranks)])
def test_a_case_past_its_timeout_is_reported_as_a_hang_naming_the_case_and_the_timeout(tmp_path, capsys, in_spec,
                                                                                      on_command_line):
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "long.toml").write_text(LONG_DDP.format(timeout=in_spec))
    code = main(["run", "--specs", str(specs), "--reports", str(tmp_path / "reports"), "--quiet", *on_command_line])
    out = capsys.readouterr().out
    assert code == 1
    line = next(l for l in out.splitlines() if "long.loss.2ranks" in l)
    assert line.split(":")[0].strip() == "cannot run  long.loss.2ranks / torch_ddp@cpu", line
    assert "timeout: no result within 0.5 s (a hang" in line
    assert "ranks.timeout_s in the spec, or `fpemu run --rank-timeout SECONDS`" in line


@needs_torch
@more_real_ranks
def test_audit_torch_on_real_ranks_notices_an_unreduced_found_inf_and_ranks_that_part():
    from fpemu.adapters.torch_ranks import run_cases
    after = [[False, False, True, False], [False, True, False, False]]  # rank 1 overflows at step 1, after the all-reduce
    cases = [{"layout": layout, "scaler": scaler, "params": {}, "inject": "grad_after_reduce", "overflow": after,
              "audit": True} for layout, scaler in (("ddp", "torch"), ("ddp", "torch_sharded"), ("fsdp1", "torch"))]
    recorded = [{**case, "audit": False, "record": True} for case in cases[:2]]  # fpemu.record_torch on each rank
    ddp, sharded, fsdp1, ddp_recorded, sharded_recorded = run_cases(cases + recorded, 2)
    assert [r.findings for r in ddp.ranks] == [(("found_inf_not_reduced", 0), ("ranks_disagree", 1))] * 2
    assert [r.findings for r in sharded.ranks] == [(), ()]  # the SUM all-reduce keeps them together
    assert all(r.findings[0] == ("found_inf_not_reduced", 0) for r in fsdp1.ranks)
    # The recorder: one trace per rank, rank and world in its metadata, the same findings from its audit
    assert [r.findings for r in ddp_recorded.ranks] == [(("found_inf_not_reduced", 0), ("ranks_disagree", 1))] * 2
    for rank, record in enumerate(ddp_recorded.ranks):
        ranks = record.recorded.metadata["ranks"]
        assert (ranks["rank"], ranks["world_size"], ranks["found_inf_reduction"]) == (rank, 2, None)
        assert ranks["disagree"] == {"attempt": 1, "skipped_ranks": [1], "applied_ranks": [0],
                                     "scales": [65536.0, 65536.0]}
        # each rank skipped once (rank 1 at attempt 1, rank 0 at 2): equal counts, and the scales say so too
        assert ranks["skipped_per_rank"] == [1, 1] and ranks["final_scales"] == [32768.0, 32768.0]
        skips = [not flag for flag in after[rank]]  # each rank skips its own overflows only
        assert [s["applied"] for s in record.recorded.steps] == record.applied == skips
    for rank, record in enumerate(sharded_recorded.ranks):
        ranks = record.recorded.metadata["ranks"]
        assert ranks["found_inf_reduction"].startswith("SUM over its process group (2 ranks)") and ranks["rank"] == rank
        assert ranks["disagree"] is None and record.findings == ()


def test_recorder_writes_one_trace_per_rank():
    from fpemu.recorders.torch_run import _rank_path
    assert _rank_path("run.json", None) == "run.json"
    assert _rank_path("out/run.json", {"rank": 1}) == pathlib.Path("out/run.rank1.json")
    assert _rank_path(pathlib.Path("r{rank}/run.json"), {"rank": 3}) == pathlib.Path("r3/run.json")


def test_model_docstring_examples():
    import doctest
    import fpemu.ranks.model
    result = doctest.testmod(fpemu.ranks.model, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 5


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core not installed")
@pytest.mark.filterwarnings("ignore:Transformer Engine and Apex are not installed:UserWarning")
def test_chained_sub_scalers_are_megatrons_own_dynamic_grad_scaler():
    # ChainedOptimizer.prepare_grads (megatron-core 0.16.1) calls each sub-optimizer's prepare_grads, which
    # updates its own DynamicGradScaler with its own found-inf: drive the real class once per sub-optimizer.
    from fpemu.adapters import record_scaler
    params = dict(initial_scale=65536.0, min_scale=1.0, growth_interval=3, hysteresis=2)
    expert = tuple(step in (2, 3, 7) for step in range(12))
    traces, _, drift = chained_scales([expert, (False,) * 12], **params)
    for flags, model in zip((expert, (False,) * 12), traces):
        real = record_scaler("megatron", list(flags), **params)
        assert [float(s).hex() for s in real.scales] == [float(s).hex() for s in model.scales]
    assert not drift.agree and drift.field == "scale"


@needs_torch
@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core not installed")
@pytest.mark.stage2("megatron-core is a stage-2 framework; test_chained_sub_scalers_are_megatrons_own_dynamic_grad_scaler")
def test_megatron_chained_optimizer_on_real_ranks_keeps_a_scaler_per_sub_optimizer_that_drifts():
    # megatron-core 0.16.1's own ChainedOptimizer of two Float16OptimizerWithFloat16Params (the probe, the rest)
    # on 2 gloo ranks: rank 1's inf after the all-reduce lands in the probe's sub-optimizer only
    from fpemu.adapters.torch_ranks import run_cases
    params = {"initial_scale": 256.0, "growth_interval": 3, "hysteresis": 2}
    bad = [step in (2, 3) for step in range(8)]
    [result] = run_cases([{"layout": "megatron", "scaler": "megatron", "params": params, "inject": "grad_after_reduce",
                           "overflow": [[False] * 8, bad], "chained": True}], 2)
    assert result.error is None, result.error
    assert all("type() named as its CUDA twin" in r.overrides[0] for r in result.ranks)  # said in the traces
    for rank, record in enumerate(result.ranks):
        traces, chain_applied, drift = chained_scales([bad if rank else [False] * 8, [False] * 8], **params)
        assert record.applied == chain_applied.tolist()  # the chain skips when any sub-optimizer found an inf
        for sub, trace in enumerate(traces):  # each sub-scaler follows its own flags, bit for bit
            after = trace.scales[1:] + [trace.final_scale]
            assert [float(step[sub]).hex() for step in record.sub_scales] == [float(v).hex() for v in after]
        assert drift.agree == (rank == 0)
    # the probe's scaler backed off to 128 at step 3 (hysteresis 2) and grew back once; the other's grew thrice
    assert result.ranks[1].sub_scales[-1] == [256.0, 1024.0] and result.ranks[0].sub_scales[-1] == [1024.0, 1024.0]


def test_cases_whose_device_is_missing_are_skipped_with_the_reason(tmp_path):
    from fpemu.harness.ranks import run_ranks
    if not no_torch:
        import torch
        if torch.cuda.is_available():
            pytest.skip("CUDA is present: the cuda cases would run")
    outcomes, written = run_ranks([SPECS / "ranks_fsdp2_grad_scaler.toml"], tmp_path / "g", tmp_path / "o",
                                  requested=["torch_fsdp2@cuda"])
    assert {o.verdict.status for o in outcomes} == {"skipped"} and len(outcomes) == 8
    reason = "torch not installed" if no_torch else "CUDA is not available on this machine"
    assert all(reason in o.verdict.note for o in outcomes) and all(o.verdict.implementation == "torch_fsdp2@cuda"
                                                                  for o in outcomes)
    assert len(written) == 4 * 2 + 4 * 4  # the model's traces still, one per rank of each case


# --- torchrun: the same cases on the world torchrun forms -----------------------------------------

TORCHRUN_SPEC = UNDECLARED.replace("world_sizes = [2]", "world_sizes = SIZES")
ROOT = SPECS.parent


class _ScriptedGroup(torch_ranks._Group):
    """The launcher's view of a group whose messages arrive in a set order (fpemu's own transport, scripted):
    each entry is a message, or ``("die", rank, exit code, last words)``, after which that rank is dead."""

    script = ()

    def __init__(self, cases, world_size, device, group_timeout_s, folder):
        self.left, self.deaths = list(self.script), {}

    def next_message(self):
        while self.left:
            entry = self.left.pop(0)
            if entry[0] != "die":
                return entry
            self.deaths[entry[1]] = entry[2:]
            return None  # the launcher looks at the dead before the next message
        return None

    def dead(self):
        return sorted(self.deaths)

    def death(self, rank):
        return self.deaths[rank]

    def close(self):
        pass


@pytest.mark.parametrize("late", ["done", "error"])
def test_a_result_arriving_after_a_peer_died_still_counts_and_the_crash_is_the_next_cases(late, monkeypatch):
    """Found in CI under torchrun: rank 0's process died in case 6 (a gloo abort) and was seen dead before rank
    1's 'done' of case 5, sent before it, came through the store; case 5 was blamed for case 6's crash.  A
    result or error already sent still counts; the failure is the first case some rank did not finish."""
    monkeypatch.setattr(torch_ranks, "_IN_FLIGHT_S", 0.05)
    rank1_late = (("done", 0, 1, ("r1", 0.5)) if late == "done" else ("error", 1, 1, "RuntimeError: Connection reset"))
    _ScriptedGroup.script = [("ready", -1, 0, None), ("ready", -1, 1, None), ("done", 0, 0, ("r0", 0.25)),
                             ("die", 0, -6, "op.preamble.length <= op.nbytes. 216 vs 8"), rank1_late]
    if late == "error":  # rank 1 finished case 0 in time; its error about case 1 arrives after the death
        _ScriptedGroup.script.insert(3, ("done", 0, 1, ("r1", 0.5)))
    first, second = torch_ranks._launch([{}, {}, {}], 2, "cpu", [60.0] * 3, _ScriptedGroup)
    assert first == torch_ranks.CaseResult(("r0", "r1"), None, 0.5)
    died = "rank 0 died (exit code -6): op.preamble.length <= op.nbytes. 216 vs 8"
    assert second.error == (died if late == "done" else f"rank 1: RuntimeError: Connection reset; {died}")


def test_env_world_reads_torchruns_variables_and_names_the_one_missing():
    from fpemu.adapters.torch_ranks import env_world
    from fpemu.errors import FpemuInputError
    assert env_world({}) is None  # the built-in launcher
    full = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "node0",
            "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "job7", "TORCHELASTIC_RESTART_COUNT": "0"}
    world = env_world(full)
    assert (world.rank, world.world_size, world.local_rank, world.local_world_size, world.host, world.port,
            world.run) == (1, 4, 1, 2, "node0", 29500, "job7/0")
    with pytest.raises(FpemuInputError, match="environment: RANK, WORLD_SIZE set but not MASTER_ADDR, MASTER_PORT"):
        env_world({"RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(FpemuInputError, match="environment: WORLD_SIZE='two': expected an integer"):
        env_world({**full, "WORLD_SIZE": "two"})
    with pytest.raises(FpemuInputError, match="RANK=4: expected 0 <= RANK < WORLD_SIZE"):
        env_world({**full, "RANK": "4"})


def test_fpemu_ranks_refuses_a_world_no_case_fits_and_specs_without_ranks(tmp_path, monkeypatch, capsys):
    spec = tmp_path / "d.toml"
    spec.write_text(TORCHRUN_SPEC.replace("SIZES", "[2, 4]"))
    for name, value in {"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)  # a world of 3: refused before any store is reached
    args = ["ranks", str(spec), "--golden", str(tmp_path / "g"), "--out", str(tmp_path / "o"), "--quiet"]
    assert main(args) == 2
    assert ("no selected [ranks] case has 3 ranks, the world torchrun formed (WORLD_SIZE=3); their world sizes: 2, 4"
            in capsys.readouterr().err)
    assert main(["ranks", str(SPECS / "bernoulli_jmp.toml"), *args[2:]]) == 2
    assert "no [ranks] spec" in capsys.readouterr().err
    monkeypatch.delenv("MASTER_PORT")
    assert main(args) == 2 and "but not MASTER_PORT" in capsys.readouterr().err


def _fpemu_ranks(spec, out, nproc=None):
    """``fpemu ranks`` in a fresh process, under torchrun (``torch.distributed.run``, --standalone: a free port)
    with ``nproc`` ranks, else the built-in launcher; OMP_NUM_THREADS=1 for both, as torchrun sets it in its
    workers (the traces record it: fpemu.host)."""
    import subprocess
    import sys
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
                if nproc else [sys.executable])
    command = [*launcher, "-m", "fpemu", "ranks", *map(str, spec), "--golden", str(out / "golden"), "--out",
               str(out / "observed"), "--reports", str(out / "reports"), "--quiet", "--json"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    return done, json.loads(done.stdout) if done.stdout.strip() else None  # rank 0's alone: the others print none


def _same_bytes(torchrun, builtin, world_size):
    """Every trace torchrun's rank 0 wrote equals, byte for byte, the built-in launcher's of that case."""
    compared = 0
    for folder in ("golden", "observed"):
        written = sorted((torchrun / folder).glob("*.json"))
        assert written and all(f".{world_size}ranks." in p.name for p in written)
        assert {p.name for p in written} == {p.name for p in (builtin / folder).glob(f"*.{world_size}ranks.*.json")}
        for path in written:
            assert path.read_bytes() == (builtin / folder / path.name).read_bytes(), path.name
            compared += 1
    return compared


@needs_torch
@pytest.mark.stage2("the built-in launcher's 2 real ranks in test_fpemu_run_fails_an_undeclared_cross_rank_divergence_"
                    "naming_step_and_ranks; torchrun's world in test_env_world_reads_torchruns_variables...")
def test_torchrun_at_2_ranks_writes_the_built_in_launchers_traces_byte_for_byte_and_a_divergence_exits_1(tmp_path):
    spec = tmp_path / "d.toml"
    spec.write_text(TORCHRUN_SPEC.replace("SIZES", "[2]"))
    builtin, builtin_json = _fpemu_ranks([spec], tmp_path / "builtin")
    torchrun, torchrun_json = _fpemu_ranks([spec], tmp_path / "torchrun", nproc=2)
    assert builtin.returncode == 1 and torchrun.returncode != 0, (builtin.stderr[-2000:], torchrun.stderr[-2000:])
    # torchrun exits 1 for any failed worker; the worker's own code is rank 0's, 1 here (a divergence)
    assert torchrun_json["exit_code"] == 1 and "exitcode  : 1" in torchrun.stderr
    assert torchrun_json["launcher"] == "torchrun (env://, rank 0 of 2)"
    assert torchrun_json["verdicts"] == builtin_json["verdicts"]
    assert [v["status"] for v in torchrun_json["verdicts"]] == ["match", "diverged"]
    assert _same_bytes(tmp_path / "torchrun", tmp_path / "builtin", 2) == 8
    assert ((tmp_path / "torchrun" / "reports" / "ranks.md").read_bytes()
            == (tmp_path / "builtin" / "reports" / "ranks.md").read_bytes())


@needs_torch
@stage2
def test_torchrun_at_4_ranks_runs_the_4_rank_cases_and_names_those_left_out(tmp_path):
    spec = tmp_path / "d.toml"
    spec.write_text(TORCHRUN_SPEC.replace("SIZES", "[2, 4]"))
    builtin, _ = _fpemu_ranks([spec], tmp_path / "builtin")
    torchrun, result = _fpemu_ranks([spec], tmp_path / "torchrun", nproc=4)
    assert builtin.returncode == 1 and result["exit_code"] == 1, torchrun.stderr[-2000:]
    assert result["left_out"] == ["d.loss.2ranks", "d.grad_after_reduce.2ranks"]
    assert "2 cases left out: their world size is not WORLD_SIZE=4 (torchrun's): d.loss.2ranks" in torchrun.stderr
    assert [(v["spec"], v["status"]) for v in result["verdicts"]] == [("d.loss.4ranks", "match"),
                                                                      ("d.grad_after_reduce.4ranks", "diverged")]
    assert _same_bytes(tmp_path / "torchrun", tmp_path / "builtin", 4) == 16


@needs_torch
@stage2
def test_torchrun_matches_the_built_in_launcher_on_every_shipped_2_rank_case_a_crash_and_a_hang_included(tmp_path):
    """Every shipped 2-rank case (DeepSpeed, megatron-core where installed; the step-keyed abort crashes its
    group on purpose) and a case past its timeout: each is its own result line under torchrun too, and the
    cases after it run in a fresh group."""
    (tmp_path / "long.toml").write_text(LONG_DDP.format(timeout="timeout_s = 0.5"))
    specs = [SPECS, tmp_path / "long.toml"]
    builtin, expected = _fpemu_ranks(specs, tmp_path / "builtin")
    torchrun, result = _fpemu_ranks(specs, tmp_path / "torchrun", nproc=2)
    assert expected is not None and result is not None, torchrun.stderr[-3000:]
    two = [v for v in expected["verdicts"] if ".2ranks" in v["spec"]]
    assert result["verdicts"] == two and len(two) >= 30
    statuses = {v["spec"]: v["status"] for v in two}
    assert statuses["long.loss.2ranks"] == "cannot run" and statuses[
        "ranks_ddp_step_keyed_abort.grad_after_reduce.2ranks"] == "known divergence"
    assert result["exit_code"] == expected["exit_code"] == 1  # the hang
    _same_bytes(tmp_path / "torchrun", tmp_path / "builtin", 2)
