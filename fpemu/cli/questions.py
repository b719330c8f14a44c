"""The everyday questions: simulate (a scaler over your overflows), recipe (fp8 scales per step) and
underflow (what a tensor file loses in a format)."""

from __future__ import annotations

import math
import pathlib
import typing
import zipfile

from fpemu.cli import output
from fpemu.errors import FpemuInputError


def _number(text: str, where: str) -> float:
    """A number as a user types it: 1024, 1e-4, 2**16, 2^-24, inf."""
    cleaned = text.strip().replace("^", "**")
    base, sep, exponent = cleaned.partition("**")
    try:
        value = float(base) ** int(exponent) if sep else float(cleaned)
    except (ValueError, OverflowError):
        value = None
    if value is None or (math.isinf(value) and "inf" not in cleaned.lower()):  # 1e999 reads as inf
        raise FpemuInputError(f"{where}: expected a number within float64's range (1024, 1e-4, 2**16, inf), "
                              f"got {_shortened(text)!r}") from None
    return value


def _shortened(text: str) -> str:
    """A typed value as an error line shows it: at most 40 characters."""
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} characters)"


def _param_value(text: str, where: str):
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    try:
        return int(low)
    except ValueError:
        return _number(text, where)


def _bounded_param(key: str, value, item: str, option: str, bounds: str):
    """An integer parameter within its row of fpemu.kinds.bounds (``bounds``.NAME, as a spec's would be)."""
    from fpemu.kinds.bounds import bound_for
    if isinstance(value, bool) or not isinstance(value, int):
        return value
    try:
        row = bound_for(f"{bounds}.{key}")
    except LookupError:  # a name no row spells (a dot in it): the row of any name
        row = bound_for(f"{bounds}.*")
    if not row.minimum <= value <= row.limit():
        raise FpemuInputError(f"{option} {item}: expected an integer in {row.minimum:,}..{row.limit():,} "
                              f"({row.why}), got {value}")
    return value


def parse_params(items, words=(), option: str = "--param", bounds: str = "scaler.params") -> dict:
    """NAME=VALUE items; ``words``: the names whose value is taken as a string (a format's name).

    An integer value is held to the bound a spec's ``bounds``.NAME has (fpemu.kinds.bounds: a scaler's
    ``scaler.params``, a recipe's ``recipe.params``); past it is an error naming ``option`` and the bound.
    """
    params = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise FpemuInputError(f"{option} {item}: expected NAME=VALUE (e.g. {option} init_scale=1024)")
        key = key.strip()
        params[key] = (value.strip() if key in words else
                       _bounded_param(key, _param_value(value, f"{option} {_shortened(item)}"), item, option, bounds))
    return params


def _steps_bound() -> int:
    """The most steps a simulated run has: a scaler spec's steps bound (fpemu.kinds.bounds)."""
    from fpemu.kinds.bounds import bound_for
    return bound_for("steps").limit("scaler")


def _parse_steps(text: str) -> list:
    """'3,7,8' or '10-12,20' -> sorted step indices, each below the steps bound."""
    steps = set()
    last_step = _steps_bound() - 1
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, sep, last = part.partition("-")
        try:
            lo, hi = int(first), int(last) if sep else int(first)
        except ValueError:
            raise FpemuInputError(f"--overflow-steps {text}: expected step numbers like 3,7,8 or 10-12, "
                                  f"got {part!r}") from None
        if lo < 0 or hi < lo:
            raise FpemuInputError(f"--overflow-steps {text}: {part!r} is not a step or an increasing range >= 0")
        if hi > last_step:
            raise FpemuInputError(f"--overflow-steps {text}: {part!r} goes past step {last_step:,}, the last of "
                                  f"the longest run (--steps is at most {last_step + 1:,}, a scaler spec's bound)")
        steps.update(range(lo, hi + 1))
    return sorted(steps)


def _json_float(value):
    from fpemu.traces.format import encode_float
    return encode_float(value) if isinstance(value, float) else value


def _simulated(name: str, option: str, flags, items, param_option: str):
    """(the ScalerTrace of profile ``name`` over ``flags``, its Profile, the parameters it ran with)."""
    from fpemu.scalers import simulate_scaler
    from fpemu.scalers.profiles import PROFILES
    if name not in PROFILES:
        raise FpemuInputError(f"{option} {name}: unknown profile; profiles: {', '.join(PROFILES)}")
    params = parse_params(items, option=param_option)
    try:
        return simulate_scaler(flags, name, **params), PROFILES[name], params
    except (TypeError, ValueError) as error:
        raise FpemuInputError(f"{param_option} ({option} {name}): {error}") from None


def _simulate_rows(trace) -> list:
    """The JSON rows of one simulated profile, a row per step."""
    events = {}
    for step, text in trace.events:
        events.setdefault(step, []).append(text)
    rows = []
    for step in range(trace.attempts):
        row = {"step": step, "overflow": bool(trace.overflow[step]), "scale": _json_float(float(trace.scales[step])),
               "scale_hex": float(trace.scales[step]).hex(), "applied": bool(trace.applied[step]),
               "growth_counter": int(trace.growth_counter[step])}
        if trace.hysteresis is not None:
            row["hysteresis"] = trace.hysteresis[step]
        if step in events:
            row["events"] = events[step]
        rows.append(row)
    return rows


def _simulate_summary(trace) -> dict:
    final = float(trace.final_scale)
    return {"attempts": trace.attempts, "completed_updates": trace.completed_updates,
            "skipped_updates": trace.skipped_updates, "final_scale": _json_float(final),
            "final_scale_hex": final.hex(), "stopped_at": trace.stopped_at}


def _summary_line(name: str, trace) -> str:
    final = float(trace.final_scale)
    line = (f"{name}: {trace.attempts} steps: {trace.completed_updates} updates applied, {trace.skipped_updates} "
            f"skipped; final scale {final:.9g} ({final.hex()})")
    if trace.stopped_at is not None:
        line += f"; the implementation raised at step {trace.stopped_at} and training stopped"
    return line


def _step_cells(trace, step: int) -> str:
    cells = (f"{trace.scales[step]:>15.9g}  {'applied' if trace.applied[step] else 'skipped':<8}  "
             f"{int(trace.growth_counter[step]):>7}")
    return cells + (f"  {trace.hysteresis[step]!s:>10}" if trace.hysteresis is not None else "")


def _step_header(name: str, trace) -> str:
    header = f"  {name + ' scale':>15}  {'update':<8}  {'counter':>7}"
    return header + (f"  {'hysteresis':>10}" if trace.hysteresis is not None else "")


def _simulation_trace(run, overflow_text: str, steps: int):
    """A trace (fpemu.traces) of one simulated profile: `fpemu compare` reads it.  Its scenario is the
    overflow steps and step count (not the profile), so two profiles' traces compare as one scenario."""
    import hashlib
    import types
    from fpemu.host import installed_versions
    from fpemu.traces import Trace
    from fpemu.traces.layout import REFERENCE, trace_metadata, trace_steps, trace_summary
    trace, profile, params = run
    text = f"fpemu simulate --overflow-steps {overflow_text or '(none)'} --steps {steps}"
    scenario = types.SimpleNamespace(name="simulate", path="", sha256=hashlib.sha256(text.encode()).hexdigest(),
                                     text=text)
    fields = ("scale", "overflow", "applied", "growth_counter", "hysteresis")
    metadata = trace_metadata(scenario, REFERENCE, profile.name, {**profile.defaults, **params},
                              installed_versions(("numpy", "ml_dtypes")), "cpu", verified=profile.verified)
    return Trace(metadata, trace_steps(trace, fields), trace_summary(trace))


def _save_simulations(folder: pathlib.Path, runs, overflow_text: str, steps: int) -> list:
    from fpemu.traces import trace_filename, write_trace
    return [write_trace(_simulation_trace(run, overflow_text, steps),
                        folder / trace_filename(f"simulate_{run[1].name}", "reference")) for run in runs]


def _cmd_simulate(args) -> int:
    import numpy as np
    overflow_steps = _parse_steps(args.overflow_steps or "")
    steps = args.steps if args.steps is not None else (overflow_steps[-1] + 1 if overflow_steps else 1)
    if not 1 <= steps <= _steps_bound():
        raise FpemuInputError(f"--steps {steps}: expected 1..{_steps_bound():,} (a scaler spec's steps bound: "
                              "each step is run and stored)")
    late = [s for s in overflow_steps if s >= steps]
    if late:
        raise FpemuInputError(f"--overflow-steps: step {late[0]} is past the last step ({steps - 1}; --steps {steps})")
    if args.vs_param and not args.vs:
        raise FpemuInputError("--vs-param: sets the parameters of the --vs profile; pass --vs PROFILE too")
    flags = np.zeros(steps, dtype=bool)
    flags[overflow_steps] = True
    runs = [_simulated(args.profile, "--profile", flags, args.param, "--param")]
    if args.vs:
        runs.append(_simulated(args.vs, "--vs", flags, args.vs_param, "--vs-param"))
    lines = []
    for trace, profile, params in runs:
        lines += [f"profile {profile.name}: {profile.implementation} ({profile.verified})",
                  "params: " + ", ".join(f"{k}={v!r}" for k, v in trace.params.items())]
    lines += ["scale: the scale each step used; counter: the growth counter after the step", "",
              f"{'step':>5}  {'overflow':<8}" + "".join(_step_header(p.name, t) for t, p, _ in runs)]
    traces = [trace for trace, _, _ in runs]
    for step in range(traces[0].attempts):
        line = f"{step:>5}  {'X' if flags[step] else '':<8}" + "".join(
            f"  {_step_cells(t, step)}" if step < t.attempts else "  (stopped)" for t in traces)
        events = [text for t in traces for at, text in t.events if at == step]
        if len(traces) == 2 and _steps_differ(*traces, step):
            events.insert(0, "differ")
        lines.append(line + ("  " + "; ".join(events) if events else ""))
    lines += [""] + [_summary_line(p.name, t) for t, p, _ in runs]
    payload = {**_profile_payload(runs[0]), "vs": _profile_payload(runs[1]) if args.vs else None}
    if args.save is not None:
        written = _save_simulations(args.save, runs, args.overflow_steps, steps)
        lines += [f"wrote {path} (a trace: `fpemu compare` reads it)" for path in written]
        payload["written"] = [str(path) for path in written]
    output.emit(args, payload, lines)
    return 0


def _steps_differ(a, b, step: int) -> bool:
    if step >= a.attempts or step >= b.attempts:
        return True
    return (float(a.scales[step]).hex() != float(b.scales[step]).hex() or bool(a.applied[step]) != bool(b.applied[step]))


def _profile_payload(run) -> dict:
    trace, profile, _ = run
    return {"profile": profile.name, "implementation": profile.implementation,
            "params": {k: _json_float(v) for k, v in trace.params.items()}, "steps": _simulate_rows(trace),
            "summary": _simulate_summary(trace)}


def _cmd_recipe(args) -> int:
    from fpemu.kinds.bounds import bound_for
    from fpemu.scalers.fp8_recipes import RECIPES, simulate_recipe
    names = [args.recipe] + ([args.vs] if args.vs else [])
    for name, option in zip(names, ("recipe", "--vs")):
        if name not in RECIPES:
            raise FpemuInputError(f"{option} {name}: unknown recipe; recipes: {', '.join(RECIPES)}")
    most = bound_for("steps").limit("recipe")
    if len(args.amax) > most:
        raise FpemuInputError(f"--amax: expected at most {most:,} amaxes (a recipe spec's steps bound), "
                              f"got {len(args.amax):,}")
    amaxes = [_number(text, "--amax") for text in args.amax]
    if any(a < 0 for a in amaxes):
        raise FpemuInputError("--amax: an amax is |x| at its largest: expected numbers >= 0, inf or nan")
    params = parse_params(args.param, words=("fp8_format", "amax_compute_algo", "granularity"),
                          bounds="recipe.params")
    try:
        runs = [simulate_recipe(amaxes, name, **params) for name in names]
    except ValueError as error:
        raise FpemuInputError(f"--param: {error}") from None
    rows = [{"step": step, "amax": _json_float(amax),
             **{f"{name}_{field}": _json_float(getattr(run, field)[step]) for name, run in zip(names, runs)
                for field in ("amax_used", "scale")}} for step, amax in enumerate(amaxes)]
    header = f"{'step':>5}  {'amax':>13}" + "".join(f"  {name + ' amax_used':>24}  {name + ' scale':>20}"
                                                    for name in names)
    lines = [f"recipe {name}: {RECIPES[name].source.package} {RECIPES[name].source.version}, "
             f"{RECIPES[name].source.files} ({RECIPES[name].source.verified})" for name in names]
    lines += ["params: " + ", ".join(f"{k}={v!r}" for k, v in params.items()),
              "scale: the scale computed at the step (delayed scaling: the one the next step casts with)", "", header]
    for step, amax in enumerate(amaxes):
        line = f"{step:>5}  {amax:>13.6g}" + "".join(f"  {run.amax_used[step]:>24.9g}  {run.scale[step]:>20.9g}"
                                                    for run in runs)
        if len(runs) == 2 and float(runs[0].scale[step]).hex() != float(runs[1].scale[step]).hex():
            line += "  differ"
        lines.append(line)
    output.emit(args, {"recipes": names, "params": {k: _json_float(v) for k, v in params.items()}, "steps": rows}, lines)
    return 0


def _flatten(value, name: str, out: list) -> None:
    """(name, array) for every tensor or array in a torch.load result (dicts and lists nested)."""
    if isinstance(value, dict):
        for key, item in value.items():
            _flatten(item, f"{name}.{key}" if name else str(key), out)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _flatten(item, f"{name}.{index}" if name else str(index), out)
    elif hasattr(value, "detach") and hasattr(value, "dtype"):
        tensor = value.detach().cpu()
        if tensor.is_floating_point() and str(tensor.dtype) not in ("torch.float32", "torch.float64"):
            tensor = tensor.float()  # bf16, fp16 and fp8 widen exactly
        out.append((name or "tensor", tensor.numpy()))


def _load_tensors(path: pathlib.Path) -> list:
    """[(name, array)] of a .npy, .npz or .pt file; errors name the file."""
    import numpy as np
    if not path.is_file():
        raise FpemuInputError(f"{path}: no such file")
    suffix = path.suffix.lower()
    try:
        if suffix == ".npy":
            with open(path, "rb") as file:
                if file.read(6) != b"\x93NUMPY":  # else numpy reads it as a pickle and names that
                    raise ValueError("not a .npy file (it does not start with numpy's magic string)")
            # mapped, not read: a header declaring more than the file holds is refused before any allocation
            return [(path.name, np.load(path, mmap_mode="r", allow_pickle=False))]
        if suffix == ".npz":
            with np.load(path, allow_pickle=False) as archive:
                return [(f"{path.name}:{key}", archive[key]) for key in archive.files]
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as error:
        raise FpemuInputError(f"{path}: cannot read as {suffix}: {error}") from None
    except MemoryError:  # an .npz member's header declaring more than memory holds
        raise FpemuInputError(f"{path}: cannot read as {suffix}: an array's header declares more elements than "
                              "memory holds") from None
    if suffix in (".pt", ".pth"):
        import importlib.util
        if importlib.util.find_spec("torch") is None:
            raise FpemuInputError(f"{path}: reading {suffix} files needs torch, which is not installed "
                                  "(pip install torch; or save the tensors with numpy.save / numpy.savez)")
        import torch
        try:
            loaded = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:  # noqa: BLE001 -- whatever torch refuses, the file is the problem
            raise FpemuInputError(f"{path}: torch.load (weights_only) cannot read it: "
                                  f"{(str(error).strip().splitlines() or [''])[0]}") from None
        found = []
        _flatten(loaded, "", found)
        return [(f"{path.name}:{name}", array) for name, array in found]
    raise FpemuInputError(f"{path}: unknown tensor file type {suffix or '(none)'!r}; expected .npy, .npz or .pt")


def _cmd_underflow(args) -> int:
    from fpemu.formats import FORMATS
    from fpemu.formats.rounding import as_float_array
    if args.format not in FORMATS:
        raise FpemuInputError(f"--format {args.format}: unknown format; formats: {', '.join(FORMATS)}")
    scales = [_number(text, "--scale") for text in args.scale]
    for scale in scales:
        if not (math.isfinite(scale) and scale > 0):
            raise FpemuInputError(f"--scale {scale:g}: expected a positive finite number")
    measure = _block_measure(args) if args.block_rule is not None else _range_measure(args)
    rows, notes = [], []
    for path in args.files:
        for name, array in _load_tensors(path):
            try:
                values = as_float_array(array, name)
            except TypeError:
                notes.append(f"{name}: left out, dtype {array.dtype} is not floating point")
                continue
            try:
                measured = [measure.row(values, scale) for scale in scales]
            except FpemuInputError as error:  # (this array's shape does not fit the blocks)
                notes.append(f"{name}: left out, {error}")
                continue
            rows += [{"array": name, "shape": list(array.shape), "dtype": str(array.dtype), **row} for row in measured]
    if not rows:
        raise FpemuInputError(f"{', '.join(map(str, args.files))}: nothing to measure"
                              + (f" ({'; '.join(notes)})" if notes else ""))
    width = max(len(r["array"]) for r in rows)
    lines = [measure.title, "", f"{'array':<{width}}  {'shape':<12}  {'dtype':<9}  {'scale':>12}  " + measure.header]
    for r in rows:
        lines.append(f"{r['array']:<{width}}  {'x'.join(map(str, r['shape'])) or 'scalar':<12}  {r['dtype']:<9}  "
                     f"{r['scale']:>12.9g}  " + measure.cells(r))
    lines += notes
    output.emit(args, {**measure.settings, "arrays": [{k: _json_float(v) for k, v in r.items()} for r in rows],
                 "notes": notes}, lines)
    return 0


class _Measure(typing.NamedTuple):
    """One kind of `fpemu underflow` row: what it measures (row), its settings, title and columns."""
    settings: dict
    title: str
    header: str
    row: typing.Callable     # (float array, scale) -> the row's measured fields
    cells: typing.Callable   # row -> the table cells after the scale


def _range_measure(args) -> _Measure:
    from fpemu.formats import range_stats

    def row(values, scale):
        stats = range_stats(values, args.format, scale, rounding=args.rounding, overflow=args.overflow,
                            subnormals=not args.flush_subnormals)
        return {**stats.as_dict(), "underflow_share": stats.underflow_share,
                "subnormal_share": stats.subnormal_share, "overflow_share": stats.overflow_share}

    return _Measure(
        {"format": args.format, "rounding": args.rounding, "overflow": args.overflow,
         "subnormals": not args.flush_subnormals},
        f"{args.format}, round {args.rounding}, overflow {args.overflow}"
        + (", subnormals flushed" if args.flush_subnormals else "")
        + ": the share of each array's elements that x * scale (float32) loses",
        f"{'elements':>10}  {'underflow':>9}  {'subnormal':>9}  {'overflow':>9}  {'nan':>5}  {'max |x*s|':>10}", row,
        lambda r: (f"{r['total']:>10}  {r['underflow_share']:>9.2%}  {r['subnormal_share']:>9.2%}  "
                   f"{r['overflow_share']:>9.2%}  {r['nan']:>5}  {r['max_abs']:>10.4g}"))


def _block_measure(args) -> _Measure:
    import numpy as np
    from fpemu.blocks import SCALE_RULES
    from fpemu.blocks.stats import block_stats
    if args.block_rule not in SCALE_RULES:
        raise FpemuInputError(f"--block-rule {args.block_rule}: unknown scale rule; rules: {', '.join(SCALE_RULES)}")
    fixed = [flag for flag, given in (("--rounding", args.rounding != "nearest_even"),
                                      ("--overflow", args.overflow != "inf"),
                                      ("--flush-subnormals", args.flush_subnormals)) if given]
    if fixed:
        raise FpemuInputError(f"{', '.join(fixed)}: a --block-rule fixes the elements' rounding, saturation and "
                              f"subnormals as the implementation computes them; drop {' and '.join(fixed)}")
    rule = SCALE_RULES[args.block_rule]
    if args.format not in rule.elements:
        raise FpemuInputError(f"--format {args.format}: scale rule {rule.name} takes the element formats "
                              f"{', '.join(rule.elements)}")
    if args.block_size is not None and args.block_size < 1:
        raise FpemuInputError(f"--block-size {args.block_size}: expected a positive number of values per scale")

    def row(values, scale):
        with np.errstate(over="ignore"):
            scaled = values.astype(np.float32) * np.float32(scale)
        stats = block_stats(scaled, args.format, args.block_size, scale_rule=rule.name, axis=args.axis)
        return {"scale": scale, **stats.as_dict(), **{f"{field}_share": stats.share(field) for field in
                                                       ("underflow", "subnormal", "saturated", "flushed_blocks")}}

    block_size = rule.block_size if args.block_size is None else args.block_size
    return _Measure(
        {"format": args.format, "block_rule": rule.name, "block_size": block_size, "axis": args.axis},
        f"{args.format} in blocks of {block_size} along axis {args.axis}, scale rule {rule.name} ({rule.source}): "
        "the share of each array's elements (and blocks) that block quantization of x * scale (float32) loses",
        f"{'elements':>10}  {'underflow':>9}  {'subnormal':>9}  {'saturated':>9}  {'flushed blocks':>14}  "
        f"{'nan scales':>10}  {'rel rms err':>11}", row,
        lambda r: (f"{r['total']:>10}  {r['underflow_share']:>9.2%}  {r['subnormal_share']:>9.2%}  "
                   f"{r['saturated_share']:>9.2%}  {r['flushed_blocks_share']:>14.2%}  {r['nan_scale_blocks']:>10}  "
                   f"{r['relative_rms_error']:>11.4g}"))


def add_commands(registry) -> None:
    """simulate, recipe and underflow."""
    command = registry.command
    simulate = command("simulate", "simulate a loss-scaler profile over your overflow steps: a per-step table",
                       _cmd_simulate)
    simulate.add_argument("--profile", default="torch", help="the profile (default torch); `python -c \"import "
                          "fpemu; print(sorted(fpemu.PROFILES))\"` lists them, reports/profiles.md compares them")
    simulate.add_argument("--overflow-steps", default="", metavar="STEPS",
                          help="the steps whose gradients overflow: 3,7,8 or 10-12 (0-based, each below the steps bound)")
    simulate.add_argument("--steps", type=int, help="steps to run (default: one past the last overflow step; at "
                          "most a scaler spec's steps bound, docs/bounds.md)")
    simulate.add_argument("--param", action="append", metavar="NAME=VALUE",
                          help="a parameter of the profile, as the implementation names it (init_scale=1024, "
                               "growth_interval=4, 2**16 allowed); repeat for several")
    simulate.add_argument("--vs", metavar="PROFILE", help="a second profile run over the same overflow steps, "
                          "shown beside the first (a step where their scale or update differ is marked differ)")
    simulate.add_argument("--vs-param", action="append", metavar="NAME=VALUE",
                          help="a parameter of the --vs profile (its own names: initial_scale for keras)")
    simulate.add_argument("--save", type=pathlib.Path, metavar="DIR", help="also write each profile's run as a "
                          "trace, DIR/simulate_<profile>.json, for `fpemu compare` (--json prints a "
                          "result, not a trace)")

    recipe = command("recipe", "run an fp8 scaling recipe (TE delayed or current scaling, torchao) over your "
                     "amaxes, alone or beside another: a per-step table", _cmd_recipe)
    recipe.add_argument("recipe", help="the recipe: te_delayed, te_delayed_unfused, te_current, "
                        "te_current_reference, torchao_tensorwise, torchao_rowwise (docs/fp8_recipes.md)")
    recipe.add_argument("--amax", nargs="+", required=True, help="each step's amax (0, inf and nan allowed)")
    recipe.add_argument("--vs", help="a second recipe run on the same amaxes with the same parameters")
    recipe.add_argument("--param", action="append", metavar="NAME=VALUE",
                        help="a parameter of the recipe (amax_history_len=16, margin=1, fp8_format=fp8_e5m2, "
                             "power_2_scales=true); repeat for several")

    underflow = command("underflow", "the underflow, subnormal and overflow share of each array of tensor files "
                        "(.npy, .npz, .pt with torch installed) in a format at a loss scale", _cmd_underflow)
    underflow.add_argument("files", nargs="+", type=pathlib.Path, help=".npy, .npz or .pt files")
    underflow.add_argument("--format", default="fp16", help="the format (default fp16; e.g. bf16, fp8_e4m3fn)")
    underflow.add_argument("--scale", nargs="+", default=["1"], help="loss scales to multiply by in float32 "
                           "(default 1; several give one row each; 2**16 allowed)")
    underflow.add_argument("--rounding", default="nearest_even",
                           choices=("nearest_even", "nearest_away", "toward_zero", "up", "down"))
    underflow.add_argument("--overflow", default="inf", choices=("inf", "saturate"),
                           help="past the largest finite value: inf (IEEE) or saturate")
    underflow.add_argument("--flush-subnormals", action="store_true", help="flush subnormal results to zero")
    underflow.add_argument("--block-rule", default=None, help="block-quantize instead (MX, NVFP4): a scale rule of "
                           "fpemu.SCALE_RULES (ocp, torchao_floor, te_mxfp8, torchao_nvfp4_2level, ...); --format "
                           "is then the element format")
    underflow.add_argument("--block-size", type=int, default=None, help="values per scale (default: the rule's)")
    underflow.add_argument("--axis", type=int, default=-1, help="the axis the blocks run along (default -1)")
