"""reports/ranks.md and plots/ranks.png: loss scaling across ranks, as `fpemu run` found it.

Nothing of the host goes in (no timings: benchmarks/bench_ranks.py measures those), so a rerun
elsewhere with the same versions writes the same files.
"""

from __future__ import annotations

import pathlib

from fpemu.compare.diff import KNOWN, STATUSES
from fpemu.fileio import atomic_write
from fpemu.ranks import FOUND_INF_REDUCTIONS, INJECTIONS, LAYOUTS, SCALERS
from fpemu.reports.writer import _headline, _matplotlib_missing, markdown_table


def _skips(trace) -> list:
    return [step for step, applied in enumerate(trace.column("applied")) if not applied]


def _what_happened(outcome) -> str:
    """One cell of the issue's table: who skipped what, from the real ranks (the model where none ran)."""
    if not outcome.observed:
        return f"the run aborted ({KNOWN})" if outcome.verdict.status == KNOWN else outcome.verdict.status
    traces = outcome.observed
    skips = [tuple(_skips(t)) for t in traces]
    finals = [t.column("scale")[-1] for t in traces]
    if len(set(skips)) == 1:
        text = f"all skip {', '.join(map(str, skips[0])) or 'none'}"
    else:
        groups = {}
        for rank, skipped in enumerate(skips):
            groups.setdefault(skipped, []).append(rank)
        text = "**diverge**: " + "; ".join(
            f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))} skip{'s' * (len(ranks) == 1)} "
            f"{', '.join(map(str, skipped)) or 'none'}" for skipped, ranks in groups.items())
        text += f"; last scales {' vs '.join(sorted({f'{v:g}' for v in finals}, key=float, reverse=True))}"
    return f"{text} ({outcome.verdict.status})"


def _setup(scenario) -> str:
    over = f", found-inf over {' and '.join(scenario.reduce_over)} only" if scenario.reduce_over else ""
    return f"{scenario.layout.upper()} + {SCALERS[scenario.scaler].real.rpartition('.')[2]}{over}"


def _world(world: int, model_parallel: int) -> str:
    return f"{world} ({world // model_parallel} dp x {model_parallel} mp)" if model_parallel > 1 else str(world)


def _issue_table(outcomes) -> str:
    """Rows: the specs (setups) at each world size; columns: the injection points."""
    cells, rows = {}, []
    for o in outcomes:
        key = (o.scenario.name, o.case.world_size)
        if key not in cells:
            rows.append((key, o.scenario))
        cells.setdefault(key, {})[o.case.inject] = _what_happened(o)
    table = [(f"`{scenario.name}` ({_setup(scenario)})", _world(world, scenario.model_parallel),
              *(cells[(name, world)].get(inject, "-") for inject in INJECTIONS))
             for (name, world), scenario in rows]
    return markdown_table(["spec (setup)", "ranks", *INJECTIONS], table)


def _reduction_table() -> str:
    rows = [(r.framework, ", ".join(r.layouts),
             "; ".join(f"{op.upper()} over {name} ({group})" for op, group, name in r.ops)
             or "none", r.when, r.check, r.versions, f"`{r.source}`") for r in FOUND_INF_REDUCTIONS]
    return markdown_table(["scaler", "layouts", "found-inf reduction", "where", "local check", "versions", "source"],
                          rows)


def _case_rows(outcomes) -> list:
    rows = []
    for o in sorted(outcomes, key=lambda o: (tuple(STATUSES).index(o.verdict.status), o.name)):
        v = o.verdict
        status = f"**{v.status}**" if v.failed else v.status
        rows.append((o.name, v.implementation, status, o.prediction.verdict.describe(), v.note or "-"))
    return rows


def _draw(outcomes, path: pathlib.Path) -> pathlib.Path:
    from fpemu.figures import save_png
    return save_png(draw_ranks(outcomes), path)


def draw_ranks(outcomes):
    """One figure (not saved): a panel per spec and injection point at the largest world size, a line per
    rank (ranks with the same trajectory share a line), the model's trajectory dashed."""
    from fpemu.figures import log_scale, pyplot
    widest = {}
    for o in outcomes:
        if o.observed and o.case.world_size >= widest.get((o.scenario.name, o.case.inject), (0, None))[0]:
            widest[(o.scenario.name, o.case.inject)] = (o.case.world_size, o)
    names = list(dict.fromkeys(name for name, _ in widest))
    columns = [inject for inject in INJECTIONS if any(i == inject for _, i in widest)]
    plt = pyplot()
    # constrained layout keeps the figure's title above the panels' own (tight_layout drew it over them)
    fig, axes = plt.subplots(len(names), len(columns), figsize=(3.2 * len(columns), 2.1 * len(names)),
                             squeeze=False, sharex=True, layout="constrained")
    for row, name in enumerate(names):
        for col, inject in enumerate(columns):
            ax = axes[row][col]
            ax.set_yscale("log", base=2)
            ax.grid(alpha=0.3)
            if (name, inject) not in widest:
                ax.set_axis_off()
                continue
            world, o = widest[(name, inject)]
            lines = {}
            for rank, trace in enumerate(o.observed):
                lines.setdefault(tuple(float(v).hex() for v in trace.column("scale")), []).append(rank)
            for scales_hex, ranks in lines.items():
                scales = [float.fromhex(v) for v in scales_hex]
                ax.step(range(len(scales)), log_scale(scales), where="post", linewidth=1.6,
                        label=f"rank{'s' * (len(ranks) > 1)} {','.join(map(str, ranks))}")
            for rank, trace in enumerate(o.reference):
                if rank == 0 or trace.column("scale") != o.reference[0].column("scale"):
                    ax.step(range(len(trace.steps)), log_scale(trace.column("scale")), where="post",
                            linestyle=":", color="black", linewidth=1.0)
            ax.set_title(f"{name.removeprefix('ranks_')}, {inject} ({_world(world, o.scenario.model_parallel)}): "
                         f"{o.verdict.status}", fontsize=7)
            ax.legend(fontsize=6, loc="lower left")
            ax.tick_params(labelsize=6)
    fig.suptitle("Loss scale per rank (model: dotted)", fontsize=9)
    return fig


_NOTES = "\n".join(f"- {line}" for line in (
    "Model-parallel cases: the world is dp x mp ranks, the model-parallel ranks adjacent (rank r is model-parallel "
    "rank r % mp of replica r // mp, megatron's default order). Each model-parallel rank holds its own slice (its "
    "own seed) and no tensor-parallel collective runs in forward or backward, so an inf reaches another slice only "
    "through the found-inf reduction; the `loss` injection is left out there (in real tensor parallelism every "
    "slice computes the same loss). megatron's model-parallel group spans tensor and pipeline ranks (TP x PP) "
    "and DeepSpeed's is its mpu's: one mp group stands for either.",
    "DeepSpeed ZeRO 1/2 (0.19.8) keeps fp16 gradients: the specs start at a scale of 256. At 2^16 a gradient of "
    "1.0 becomes 65536, above fp16's largest finite 65504, so the engine skips step 0 on every rank: a real "
    "overflow, which a world of one shows as well (run_engine(3, (), 1, initial_scale_power=16) skips step 0; "
    "at 2^15 it does not); it was the step-0 skip seen when ZeRO first ran on several ranks here. At 2^16 on 2 "
    "ranks ZeRO 1 and 2 skip nothing where the scaled gradients fit in fp16: no garbage in ZeRO's buffers, no "
    "overflow check over padding (tests/test_ranks.py, FPEMU_TEST_ENVS=1).",
    "DeepSpeed's engine copies an mpu into `deepspeed.utils.groups.mpu` and never clears it, so each case sets it "
    "to its own (None without model parallelism) before `deepspeed.initialize`; `reduce_over = [\"dp\"]` hands "
    "the engine an mpu whose model-parallel group is the rank alone, which makes its second MAX a no-op.",
    "megatron-core (0.16.1): Float16OptimizerWithFloat16Params refuses CPU parameters by their `type()` "
    "(optimizer.py: 'Wrapped parameters must be one of torch.cuda.FloatTensor, ...') and allocates found_inf "
    "with device='cuda'; the adapter builds it under two TorchFunctionModes (the CPU tensor's type() named as its "
    "CUDA twin, cuda allocations moved to the CPU) and then runs megatron's own prepare_grads, found-inf "
    "all-reduce, scaler update and step on gloo. The distributed optimizer (DistributedOptimizer, whose "
    "grad_stats_parallel_group spans DP x MP) builds on megatron's own DDP buffers and is not driven here; the "
    "ChainedOptimizer's per-sub-optimizer scalers are modelled by `fpemu.ranks.chained_scales`.",
))


def ranks_report(folder, outcomes) -> list:
    """Write ranks.md (and plots/ranks.png with matplotlib) into ``folder``; returns the paths."""
    folder = pathlib.Path(folder)
    written = []
    plot = ""
    if not _matplotlib_missing() and any(o.observed for o in outcomes):
        written.append(_draw(outcomes, folder / "plots" / "ranks.png"))
        plot = "\n\n![per-rank loss scales](plots/ranks.png)"
    verdicts = [o.verdict.as_dict() for o in outcomes]
    injections = markdown_table(["injection point", "enters", "how"],
                                [(i.name, "before the gradient reduction" if i.reduced else "after it", i.how)
                                 for i in INJECTIONS.values()])
    layouts = markdown_table(["layout", "adapter", "what is run"],
                             [(l.name, l.adapter, l.wraps) for l in LAYOUTS.values()])
    text = ("# Loss scaling across ranks\n\n"
            f"**{_headline(verdicts)}.** Each [ranks] spec runs its layout and scaler on real torch.distributed "
            "ranks (gloo on the CPU, one process group per world size), with one rank overflowing at the spec's "
            "steps at each injection point. Every rank's trajectory is compared bit for bit with fpemu's model "
            "(`fpemu.ranks.predict`: who sees the inf, then the scaler's found-inf reduction, then "
            "`simulate_scaler` per rank), and the ranks with each other; a spec declares where ranks part.\n\n"
            "## What happened\n\n" + _issue_table(outcomes) + plot +
            "\n\n## Found-inf reductions (read in the installed source)\n\n" + _reduction_table() +
            "\n\n## Injection points and layouts\n\n" + injections + "\n\n" + layouts +
            "\n\n## Notes\n\n" + _NOTES +
            "\n\n## Every case\n\n" + markdown_table(["case", "implementation", "status", "model", "note"],
                                                      _case_rows(outcomes)) + "\n")
    written.insert(0, atomic_write(folder / "ranks.md", text))
    return written
