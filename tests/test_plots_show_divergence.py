"""Plots show the field that diverged, and say what an empty one means (checked through matplotlib's
objects and its renderer, not by eye): the engine_deepspeed and fp8 recipe plots from the committed
goldens and diff.json, the emulate heat map, the ranks figure."""

import pathlib
import types

import pytest

from fpemu.figures import pyplot
from fpemu.kinds import kind_of_trace
from fpemu.reports import plots
from fpemu.reports.writer import departures, diverged_fields
from fpemu.traces import read_trace

pytest.importorskip("matplotlib")
REPORTS = pathlib.Path(__file__).resolve().parent.parent / "reports"


def verdicts_of(spec):
    import json
    return [v for v in json.loads((REPORTS / "diff.json").read_text())["verdicts"] if v["spec"] == spec]


def figure_of(spec, observed=()):
    trace, verdicts = read_trace(REPORTS / "golden" / f"{spec}.json"), verdicts_of(spec)
    return plots.draw_scale_trajectories(spec, {"reference": trace.column("scale")}, trace.column("overflow"),
                                         {}, kind_of_trace(trace).scale_label,
                                         diverged_fields(trace, observed, verdicts), departures(verdicts))


def test_engine_deepspeed_plots_the_update_ratio_it_diverges_in():
    fig = figure_of("engine_deepspeed")
    scale, ratio = fig.axes[0], fig.axes[1]
    assert scale.get_ylabel() == "loss scale" and ratio.get_ylabel() == "update_ratio"
    legend = [t.get_text() for t in ratio.get_legend().get_texts()]
    assert "deepspeed_zero0@cpu: 0.0625 at step 0" in legend and "deepspeed_zero1@cpu: 0.5 at step 2" in legend
    golden = read_trace(REPORTS / "golden" / "engine_deepspeed.json").column("update_ratio")
    assert list(ratio.get_lines()[0].get_ydata()) == golden
    pyplot().close(fig)


def test_fp8_recipe_plot_labels_the_fp8_scale_whole_steps_and_two_ticks():
    fig = figure_of("recipe_te_delayed_nan")
    fig.canvas.draw()
    scale = fig.axes[0]
    assert scale.get_ylabel() == "fp8 scale" and fig.axes[1].get_ylabel() == "amax_used"
    low, high = scale.get_ylim()
    shown = [t for t in scale.get_yticks() if low <= t <= high]
    assert len(shown) >= 2, shown
    steps = [t for t in fig.axes[-1].get_xticks() if 0 <= t <= 4]
    assert steps and all(float(t).is_integer() for t in steps), steps
    pyplot().close(fig)


def test_a_matching_spec_gets_no_extra_panel():
    assert diverged_fields(read_trace(REPORTS / "golden" / "timing_torch.json"), (), verdicts_of("timing_torch")) == {}


def heat_trace(shares):
    steps = [{"step": i, "scale": 1.0, "overflow": False, "module_underflow": {"fc": s, "out": 0.0}}
             for i, s in enumerate(shares)]
    return types.SimpleNamespace(spec_name="mlp", metadata={"policy": {"name": "fp16"}}, steps=steps)


def test_an_all_zero_heat_map_says_no_underflow():
    from fpemu.emulate.report import NO_UNDERFLOW, draw_heatmap, module_matrix
    trace = heat_trace([0.0, 0.0, 0.0])
    fig = draw_heatmap(trace, *module_matrix(trace))
    (axis,) = fig.axes  # no colour bar
    assert not axis.images and [t.get_text() for t in axis.texts] == [NO_UNDERFLOW]
    assert [t.get_text() for t in axis.get_yticklabels()] == ["fc", "out"]
    pyplot().close(fig)
    trace = heat_trace([0.0, 0.25, 0.5])
    fig = draw_heatmap(trace, *module_matrix(trace))
    axis, bar = fig.axes
    assert axis.images[0].get_clim() == (0.0, 0.5) and bar.get_ylabel() == "underflow share" and not axis.texts
    pyplot().close(fig)


def test_ranks_figure_title_clears_the_panel_titles():
    from fpemu.reports.ranks import draw_ranks
    golden = REPORTS / "golden" / "ranks"
    outcomes = []
    for inject in ("grad_before_reduce", "grad_after_reduce"):
        traces = tuple(read_trace(p) for p in sorted(golden.glob(f"ranks_ddp_grad_scaler.{inject}.4ranks.rank*.json")))
        assert len(traces) == 4
        outcomes.append(types.SimpleNamespace(
            scenario=types.SimpleNamespace(name="ranks_ddp_grad_scaler", model_parallel=1),
            case=types.SimpleNamespace(world_size=4, inject=inject), observed=traces, reference=traces,
            verdict=types.SimpleNamespace(status="match")))
    fig = draw_ranks(outcomes)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    title = fig._suptitle.get_window_extent(renderer)
    panels = [ax.title.get_window_extent(renderer) for ax in fig.axes if ax.get_title()]
    assert len(panels) == 2 and not any(title.overlaps(box) for box in panels)
    pyplot().close(fig)
