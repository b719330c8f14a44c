"""The report page of an emulated run: scale trajectory, skips, where values first went non-finite, each
fp8 tensor's scale per step (fp8 placements), and the per-module underflow heat map (markdown; PNGs with
matplotlib).  Reads only the trace."""

from __future__ import annotations

import importlib.util
import math

_HEAT_MODULES = 40  # rows of the heat map: the modules that lose the most
_FP8_STEPS = 8  # steps of the per-tensor fp8 scale table (the last ones)


def module_matrix(trace) -> tuple:
    """(modules, steps x modules underflow shares) of the trace's backward pass, modules by mean share."""
    names = sorted({name for record in trace.steps for name in record.get("module_underflow", {})})
    rows = [[record.get("module_underflow", {}).get(name, 0.0) for name in names] for record in trace.steps]
    means = {name: sum(row[i] for row in rows) / max(len(rows), 1) for i, name in enumerate(names)}
    order = sorted(names, key=lambda n: (-means[n], n))[:_HEAT_MODULES]
    index = {name: i for i, name in enumerate(names)}
    return order, [[row[index[name]] for name in order] for row in rows]


def report_markdown(trace, images=()) -> str:
    meta, summary = trace.metadata, trace.summary
    policy, table = meta["policy"], meta.get("op_table") or {}
    lines = [f"# {trace.spec_name}: {policy['name']} under the {meta['profile']} scaler", "",
             f"{summary['attempts']} steps: {summary['completed_updates']} updates applied, "
             f"{summary['skipped_updates']} skipped; final scale {summary['final_scale']:g}.", "",
             f"Policy: placement {policy['placement']}, compute "
             + ("the program's own dtypes" if policy["placement"] == "program" else policy["compute"]["name"])
             + (f", backward {policy['backward']['name']}" if policy.get("backward") else "")
             + f", rounding {policy['rounding']}, overflow {policy['overflow']}, subnormals "
             f"{'kept' if policy['subnormals'] else 'flushed'}, accumulation {policy['accumulation']}.", ""]
    if table.get("primitives"):  # JAX: the interpreter's placement table and semantics
        semantics = table["semantics"]
        lines += [f"Primitive table: jax {table['jax']}, "
                  + ", ".join(f"{len(names)} {kind}" for kind, names in sorted(table["primitives"].items()))
                  + f" (any other floating primitive is refused); semantics {semantics['name']}: "
                  + ", ".join(f"{k}={v}" for k, v in semantics["applied"].items())
                  + (f"; not applied: {', '.join(semantics['not_applied'])}" if semantics["not_applied"] else "")
                  + ".", ""]
    elif table:
        counts = {}
        for category in table["ops"].values():
            counts[category] = counts.get(category, 0) + 1
        added = table.get("from_source", {})
        lines += [f"Op table: torch {table['torch']}'s {table['key']} registrations"
                  + (f" read on a {table['read_on']} build" if "read_on" in table else "") + ", "
                  + ", ".join(f"{n} {c}" for c, n in sorted(counts.items()))
                  + f", {len(table['unclassified'])} unreadable (refused if reached)"
                  + (f"; added from torch's source: "
                     f"{', '.join(f'{op} {c}' for op, c in sorted(added['ops'].items()))} ({added['where']})"
                     if added else "") + ".", ""]
    first = meta["telemetry"]["first_nonfinite"]
    for direction in ("forward", "backward"):
        event = first.get(direction)
        where = (f"`{event['op']}` in `{event['module']}` at step {event['step']} ({event['produced']})"
                 if event else "none")
        lines.append(f"- first inf/NaN in the {direction} pass: {where}")
    lines += ["", "## Scale trajectory", "", "| step | scale | overflow | loss | backward underflow |",
              "|---|---|---|---|---|"]
    for record in trace.steps:
        lines.append(f"| {record['step']} | {record['scale']:g} | {'X' if record['overflow'] else ''} | "
                     f"{_number(record['loss'])} | {record['underflow_share']:.3%} |")
    lines += fp8_scale_lines(trace)
    modules, matrix = module_matrix(trace)
    lines += ["", f"## Backward underflow by module (top {len(modules)}: share of each module's rounded "
              "backward values that underflowed to zero)", ""]
    if modules:
        lines += ["| module | mean | max |", "|---|---|---|"]
        for i, name in enumerate(modules):
            column = [row[i] for row in matrix]
            lines.append(f"| `{name}` | {sum(column) / len(column):.3%} | {max(column):.3%} |")
    float32_ops = meta["telemetry"]["float32_ops"]
    listed = ", ".join(f"`{op}`" for op in float32_ops) or "none"
    lines += ["", f"Ops the policy left in float32 ({len(float32_ops)}): {listed}."]
    lines += [""] + [f"![{name}]({name})" for name in images]
    if not images and importlib.util.find_spec("matplotlib") is None:
        lines.append("_matplotlib is not installed: the heat map and trajectory plots are skipped._")
    return "\n".join(lines) + "\n"


def fp8_scale_lines(trace, last: int = _FP8_STEPS) -> list:
    """The report's per-tensor fp8 section: each cast's scale in the ``last`` steps and its amax in the
    last of them ([] for a trace without fp8 casts).  The exact values are the trace's ``tensor_scale_hex``."""
    from fpemu.traces import decode_value
    steps = [record for record in trace.steps if record.get("fp8_casts")][-last:]
    if not steps:
        return []
    names = list(dict.fromkeys(name for record in steps for name in record["fp8_casts"]))
    per_step = [dict(zip(record["fp8_casts"], zip(decode_value(record, "tensor_amax"),
                                                   decode_value(record, "tensor_scale")))) for record in steps]
    lines = ["", f"## fp8 scale per tensor ({len(names)} casts a step; the last {len(steps)} steps; amax of the "
             "last step)", "",
             "| tensor | " + " | ".join(f"scale @{record['step']}" for record in steps) + " | amax |",
             "|---|" + "---|" * (len(steps) + 1)]
    for name in names:
        cells = [_number(held[name][1][0]) if name in held else "-" for held in per_step]
        amax = per_step[-1].get(name)
        lines.append(f"| `{name}` | " + " | ".join(cells) + f" | {_number(amax[0][0]) if amax else '-'} |")
    return lines


def _number(value) -> str:
    return value if isinstance(value, str) else f"{value:.6g}"


NO_UNDERFLOW = "no underflow: every module's backward values stayed nonzero at every step"


def draw_heatmap(trace, modules, matrix):
    """The modules x steps heat map of backward underflow shares (not saved); all zero draws no colours but
    says so (a colour map of zeros was one solid colour with a -0.1..0.1 colour bar)."""
    from fpemu.figures import pyplot, whole_steps
    fig, axis = pyplot().subplots(figsize=(8, 0.25 * len(modules) + 1.5))
    shares = [list(col) for col in zip(*matrix)]
    top = max((v for row in shares for v in row), default=0.0)
    if top > 0:
        image = axis.imshow(shares, aspect="auto", cmap="magma", interpolation="nearest", vmin=0.0, vmax=top)
        fig.colorbar(image, ax=axis, label="underflow share")
        axis.set_yticks(range(len(modules)), modules, fontsize=7)
    else:
        axis.set_xlim(-0.5, len(matrix) - 0.5)
        axis.set_ylim(len(modules) - 0.5, -0.5)
        axis.set_yticks(range(len(modules)), modules, fontsize=7)
        axis.text(0.5, 0.5, NO_UNDERFLOW, transform=axis.transAxes, ha="center", va="center", fontsize=9,
                  color="0.3", bbox={"facecolor": "white", "edgecolor": "0.7"})
    axis.set_xlabel("step")
    whole_steps(axis)
    axis.set_title(f"{trace.spec_name}, {trace.metadata['policy']['name']}: backward underflow share by module")
    return fig


def draw_scale(trace):
    """The scale per step (not saved); red lines at overflow steps."""
    from fpemu.figures import log_scale, pyplot, whole_steps
    fig, axis = pyplot().subplots(figsize=(8, 3))
    scales = log_scale([r["scale"] if isinstance(r["scale"], float) else math.nan for r in trace.steps])
    axis.step(range(len(scales)), scales, where="post")
    axis.set_yscale("log", base=2)
    for record in trace.steps:
        if record["overflow"]:
            axis.axvline(record["step"], color="red", alpha=0.3)
    axis.set_xlabel("step")
    whole_steps(axis)
    axis.set_ylabel("loss scale")
    axis.set_title("scale trajectory (red: overflow, update skipped)")
    return fig


def write_plots(trace, out, stem: str) -> list:
    """``{stem}.heatmap.png`` (modules x steps backward underflow) and ``{stem}.scale.png``; [] without matplotlib."""
    if importlib.util.find_spec("matplotlib") is None:
        return []
    from fpemu.figures import save_png
    modules, matrix = module_matrix(trace)
    written = [save_png(draw_heatmap(trace, modules, matrix), out / f"{stem}.heatmap.png")] if modules else []
    return written + [save_png(draw_scale(trace), out / f"{stem}.scale.png")]
