"""A page per fp8 scaling recipe and per block scale rule: reports/recipes/<page>.md and .json, and an index.

Every per-tensor recipe of :data:`fpemu.scalers.fp8_recipes.RECIPES` (a recipe's paths share a page:
rows that differ only in :data:`IMPLEMENTATION_FIELDS`) and every block rule of
:data:`fpemu.blocks.SCALE_RULES` gets a page that runs its implementations side by side on the same
seeded tensors (:func:`fpemu.blocks.probes.probe_blocks`, every input kind): fpemu's model, the real
code where it runs here (the recipe and blocks adapters of ``fpemu.adapters.ADAPTERS``) and the exact
reference (a correctly rounded scale and one rounding of the scaled elements; for e8m0 rules also
the OCP rule), counting the scales, element codes and values that differ (bit for bit, NaN-aware)
and showing blocks or tensors where they differ, with the cause.

A page is a pure function of the seeded inputs and the versions it names (no timings, nothing of
the host): rerunning writes the same bytes (tests/test_recipe_pages.py checks it).

Run: python -m benchmarks.recipe_pages [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
from typing import Optional

import numpy as np

from benchmarks._common import REPORTS, markdown_table
from benchmarks.bench_blocks import _same as _same_bits
from benchmarks.fp8_recipes_report import EDGE_AMAXES, GENERATED, MODELS_VERSIONS, _code_differences, _mismatches, _show
from fpemu.adapters import (BLOCKS, RECIPE, adapters_of_kind, driven_rules, get_adapter, record_recipe,
                            unavailable_reason)
from fpemu.blocks import APPLICATIONS, EXPONENTS, NAN_ELEMENTS, SCALE_RULES, block_quantize
from fpemu.blocks.probes import PROBE_KINDS, probe_blocks
from fpemu.fileio import atomic_write
from fpemu.formats import encode
from fpemu.formats.rounding import codes_of_values, quantize
from fpemu.adapters import adapter_versions
from fpemu.scalers import fp8_recipes as rec

PAGES_DIR = REPORTS / "recipes"
# The model fields that pick one implementation of a recipe (TE's fused/unfused path, its kernel or
# Python reference): RECIPES rows differing only in these are one recipe, compared on one page.
IMPLEMENTATION_FIELDS = ("path", "implementation")
TENSORS, ROWS, COLUMNS = 16, 4, 32  # per input kind: 16 tensors of 4 x 32 (per-tensor recipes)
BLOCKS_PER_KIND = 64  # per input kind and element format: 64 rows of 32 values (block rules)
# Parameters each recipe model runs under, beyond its RECIPES row (fields of the model class).
VARIANTS = {
    rec.DelayedScaling: ({"amax_history_len": 4}, {"amax_history_len": 4, "margin": 2},
                         {"amax_history_len": 4, "fp8_format": "fp8_e5m2"}),
    rec.CurrentScaling: ({}, {"power_2_scales": True}, {"fp8_format": "fp8_e5m2"}),
    rec.TorchaoScaling: ({}, {"power_of_2": True}, {"fp8_format": "fp8_e5m2"}),
}


@dataclasses.dataclass(frozen=True)
class Page:
    """One page of reports/recipes/.

    Attributes:
      stem: the file name without .md (the first member's name).
      members: the RECIPES rows (one recipe and its paths) or the one SCALE_RULES row it covers.
      table: ``"RECIPES"`` or ``"SCALE_RULES"``.
    """

    stem: str
    members: tuple
    table: str


def pages() -> dict:
    """Every page by stem: the RECIPES rows grouped by recipe, then one page per SCALE_RULES row.

    Example:
      >>> pages()["te_delayed"].members
      ('te_delayed', 'te_delayed_unfused')
    """
    groups = {}
    for name, recipe in rec.RECIPES.items():
        shared = tuple(sorted((k, v) for k, v in recipe.fixed.items() if k not in IMPLEMENTATION_FIELDS))
        groups.setdefault((recipe.model, shared), []).append(name)
    out = {names[0]: Page(names[0], tuple(names), "RECIPES") for names in groups.values()}
    clash = sorted(set(out) & set(SCALE_RULES))
    if clash:
        raise ValueError(f"{', '.join(clash)}: named both in RECIPES and in SCALE_RULES; pages need one name each")
    out.update({name: Page(name, (name,), "SCALE_RULES") for name in SCALE_RULES})
    return out


def real_adapters(page: Page) -> list:
    """The adapters driving the page's real code: recipe adapters whose profile is a member, or the
    blocks adapters whose module lists the rule in its DRIVEN_RULES."""
    if page.table == "RECIPES":
        return [name for name, adapter in adapters_of_kind(RECIPE).items() if adapter.profile in page.members]
    return [name for name in adapters_of_kind(BLOCKS) if page.stem in driven_rules(name)]


def not_run(page: Page) -> dict:
    """adapter -> why it cannot run here, for the page's real adapters that cannot."""
    return {name: reason for name in real_adapters(page) if (reason := unavailable_reason(name))}


def _not_run_text(adapter: str) -> str:
    # The reason itself may name a folder of this host; the page names where to read it instead.
    return f"not run here (`fpemu.adapters.unavailable_reason({adapter!r})` says why)"


def _versions(page: Page, skipped: dict) -> dict:
    versions = {"fpemu's models": MODELS_VERSIONS}
    for name in real_adapters(page):
        versions[name] = _not_run_text(name) if name in skipped else adapter_versions(get_adapter(name))
    return versions


def _versions_lines(versions: dict) -> list:
    return [f"- {who}: " + (v if isinstance(v, str) else ", ".join(f"{k} {n}" for k, n in v.items()))
            for who, v in versions.items()]


# --- per-tensor recipes ------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Casts:
    """One implementation run over a sequence of tensors (one step each).

    Attributes:
      observed: (tensors, k) each tensor's amax as the implementation reads it (k: 1, or rows for rowwise).
      amax: (tensors, k) the amax each scale came from (delayed scaling: from the history).
      scale: (tensors, k) the scale computed (delayed scaling: the one the next step casts with).
      cast_scale: (tensors, k) the scale each tensor was cast with.
      codes: (tensors, rows, columns) fp8 codes, or None where no cast was driven (the real code's,
        or an amax stream's).
    """

    observed: np.ndarray
    amax: np.ndarray
    scale: np.ndarray
    cast_scale: np.ndarray
    codes: Optional[np.ndarray]


def _stacked(values) -> np.ndarray:
    return np.stack([np.asarray(v, np.float32).reshape(-1) for v in values])


def _model_casts(model, tensors) -> Casts:
    rows = []
    if isinstance(model, rec.DelayedScaling):  # stateful: cast with the last step's scale, then update
        state = model.init()
        for x in tensors:
            fp8 = model.quantize(state, x)
            state = model.update(state, float(fp8.amax))
            rows.append((fp8.amax, state.amax, state.scale, fp8.scale, fp8.codes))
    else:
        rows = [(q.amax, q.amax, q.scale, q.scale, q.codes) for q in map(model.quantize, tensors)]
    observed, amax, scale, cast_scale, codes = zip(*rows)
    return Casts(_stacked(observed), _stacked(amax), _stacked(scale), _stacked(cast_scale), np.stack(codes))


def _model_run(model, amaxes) -> Casts:
    """The model driven through an amax stream alone (``run``: one amax per step, no tensors)."""
    run = model.run(amaxes)
    column = [np.asarray(v, np.float32)[:, None] for v in (run.amax, run.amax_used, run.scale)]
    return Casts(column[0], column[1], column[2], column[2], None)


def _te_reference_codes(x, model) -> np.ndarray:
    from fpemu.adapters import te_recipes
    return te_recipes.reference_current_quantize(x, model.fp8_format, model.amax_epsilon, model.power_2_scales)[1]


def _torchao_codes(x, model) -> np.ndarray:
    from fpemu.adapters import torchao_float8
    return torchao_float8.quantize(x, model.fp8_format, model.granularity, model.axis, model.power_of_2)[1]


# The real code's whole cast of a tensor (its own amax, scale and fp8 codes), by recipe adapter; the
# adapters themselves drive scales from amaxes.  TE's delayed-scaling cast is a CUDA kernel.
REAL_CASTS = {"te_reference": _te_reference_codes, "torchao_float8": _torchao_codes,
              "torchao_float8_rowwise": _torchao_codes}


def _real_casts(adapter: str, model, params: dict, tensors, ours: Casts) -> Casts:
    """The adapter's scales of the amaxes the model read (and its own cast of each tensor, where driven;
    ``tensors`` None for an amax stream)."""
    scale = np.asarray(record_recipe(adapter, ours.observed.ravel(), **params)["scale"], np.float32)
    scale = scale.reshape(ours.observed.shape)
    cast = REAL_CASTS.get(adapter)
    codes = None if cast is None or tensors is None else np.stack([cast(x, model) for x in tensors])
    return Casts(ours.observed, ours.observed, scale, scale, codes)


def _power_of_2(model) -> bool:
    return bool(getattr(model, "power_2_scales", False) or getattr(model, "power_of_2", False))  # TE's / torchao's name


def exact_scale(model, amax) -> np.ndarray:
    """The exact scale of each amax: fp8_max * 2^-margin / amax rounded once to float32 (floored to a
    power of two when the model asks), an overflow taken as FLT_MAX (then floored) as the recipes do; NaN
    where the amax is not finite and positive (the recipes then keep or invent a scale by rule).

    The float64 quotient of float32 operands, rounded to float32, is the correctly rounded one
    (53 >= 2 * 24 + 2 bits), and it never crosses a power of two the exact quotient does not reach.

    Example:
      >>> exact_scale(rec.CurrentScaling(), [117.0, 0.0]).tolist()
      [3.8290598392486572, nan]
    """
    amax = np.asarray(amax, np.float64)
    finite = np.isfinite(amax) & (amax > 0)
    top = float(rec.fp8_max(model.fp8_format)) * 2.0 ** -getattr(model, "margin", 0)
    with np.errstate(over="ignore"):
        scale = (top / np.where(finite, amax, 1.0)).astype(np.float32)
    scale = np.where(np.isinf(scale), rec.FLT_MAX, scale).astype(np.float64)  # before the floor, as the recipes do
    if _power_of_2(model):
        scale = np.ldexp(1.0, np.frexp(scale)[1] - 1)
    return np.where(finite, scale, np.float32(np.nan)).astype(np.float32)


def exact_codes(tensors, cast_scale, fmt: str) -> np.ndarray:
    """fp8 codes of x * scale rounded once (nearest even, saturating), with each tensor's own scale."""
    scale = cast_scale.astype(np.float64)[:, :, None]  # (tensors, 1 or rows, 1)
    with np.errstate(invalid="ignore", over="ignore"):
        return encode(np.asarray(tensors, np.float64) * scale, fmt, overflow="saturate")


def per_tensor_inputs(kind: str, fmt: str) -> np.ndarray:
    """(TENSORS, ROWS, COLUMNS) float32: the probe blocks of ``kind``, tensor t holding rows t, t + TENSORS, ...
    (so the all-zero rows of ``zeros`` make the even tensors all zero)."""
    blocks = probe_blocks(kind, fmt, rows=TENSORS * ROWS, block_size=COLUMNS, seed=PROBE_KINDS.index(kind))
    return blocks.reshape(ROWS, TENSORS, COLUMNS).transpose(1, 0, 2).copy()


def _params_text(params: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items()) or "defaults"


def _codes_differing(a, b, fmt: str) -> Optional[int]:
    return None if a is None or b is None else _code_differences(a, b, fmt)


def _comparisons(members, adapters, casts: dict, exact: dict, fmt: str) -> dict:
    """label -> (scales differing, codes differing or None where no codes were driven)."""
    out = {}
    for i, a in enumerate(members):
        for b in members[i + 1:]:
            out[f"{a} vs {b}"] = (_mismatches(casts[a].scale, casts[b].scale),
                                  _codes_differing(casts[a].codes, casts[b].codes, fmt))
    for adapter, recipe in adapters:
        out[f"{recipe} vs {adapter}"] = (_mismatches(casts[recipe].scale, casts[adapter].scale),
                                         _codes_differing(casts[recipe].codes, casts[adapter].codes, fmt))
    for name in members:
        scale, codes = exact[name]
        defined = ~np.isnan(scale)
        out[f"{name} vs exact"] = (_mismatches(casts[name].scale[defined], scale[defined]),
                                   _codes_differing(casts[name].codes, codes, fmt))
    return out


AMAX_STREAM = "amax stream"  # the input kind of the amaxes fed alone (no tensors)


def amax_stream() -> np.ndarray:
    """fp8_recipes_report's edge amaxes, then 200 of its generated ones (seeded; 0, inf and NaN among them)."""
    return np.concatenate([np.asarray(EDGE_AMAXES, np.float32), GENERATED.amaxes(200).astype(np.float32)])


def _inputs(fmt: str):
    """(kind, tensors or None, the models' run over them) per input: each probe kind, then the amax stream."""
    for kind in PROBE_KINDS:
        tensors = per_tensor_inputs(kind, fmt)
        yield kind, tensors, lambda model, x=tensors: _model_casts(model, x)
    amaxes = amax_stream()
    yield AMAX_STREAM, None, lambda model: _model_run(model, amaxes)


EXAMPLES_PER_KIND = 3  # example rows per input kind at most, one per distinct cause


def _recipe_examples(members, adapters, casts, exact, kind, params, differing) -> list:
    """The first tensor (or row, or step) of each distinct cause (an amax of 0, inf or NaN counting as its
    own) where two scales differ, or one departs from exact."""
    rows, causes = [], set()
    for at in np.flatnonzero(differing):
        row = _recipe_example(members, adapters, casts, exact, kind, params, int(at))
        amax = float(casts[members[0]].observed.ravel()[at])
        cause = (row["cause"], row["amax"] if not np.isfinite(amax) or amax <= 0 else "")  # 0, inf, NaN: each its own
        if cause not in causes:
            causes.add(cause)
            rows.append(row)
        if len(rows) == EXAMPLES_PER_KIND:
            break
    return rows


def _recipe_example(members, adapters, casts, exact, kind, params, at: int) -> dict:
    """Scale index ``at``: its amax and every implementation's scale, and why they differ."""
    names = [*members, *(a for a, _ in adapters)]
    row = {"variant": _params_text(params), "input": kind, "tensor": at // casts[members[0]].scale.shape[1],
           "amax": _show(float(casts[members[0]].observed.ravel()[at]))}
    for name in names:
        row[name] = _show(float(casts[name].scale.ravel()[at]))
    exact_at = float(exact[members[0]][0].ravel()[at])
    row["exact"] = "-" if np.isnan(exact_at) else _show(exact_at)
    used = {n: float(casts[n].amax.ravel()[at]) for n in members}
    cause = []
    if any(not _same_bits(casts[a].scale.ravel()[at], casts[r].scale.ravel()[at]) for a, r in adapters):
        cause.append("the real code and fpemu's model differ: a bug in the model")
    if len(set(map(_show, used.values()))) > 1:
        cause.append("the amax used differs (" + ", ".join(f"{n} {_show(v)}" for n, v in used.items()) + ")")
    if np.isnan(exact_at):
        cause.append("no exact scale for this amax: each recipe's own rule")
    departing = [n for n in members if _departs(casts[n].scale.ravel()[at], exact[n][0].ravel()[at])]
    cause += [f"{n} departs from exact" for n in departing]
    row["cause"] = "; ".join(cause)
    return row


def _departs(scale, exact) -> bool:
    """Whether a scale is not the exact one (False where no exact scale is defined)."""
    return not np.isnan(exact) and not _same_bits(scale, exact)


def recipe_page(page: Page) -> tuple:
    """(markdown, result) of a RECIPES page."""
    members = page.members
    model_class = rec.RECIPES[members[0]].model
    if model_class not in VARIANTS:
        raise ValueError(f"recipe {members[0]!r}: its model {model_class.__name__} has no VARIANTS row in "
                         "benchmarks/recipe_pages.py (the parameters its page runs under)")
    skipped = not_run(page)
    adapters = [(name, adapters_of_kind(RECIPE)[name].profile) for name in real_adapters(page) if name not in skipped]
    counts, examples = [], []
    for params in VARIANTS[model_class]:
        models = {name: rec.make_recipe(name, **params) for name in members}
        fmt = models[members[0]].fp8_format
        for kind, tensors, run in _inputs(fmt):
            casts = {name: run(model) for name, model in models.items()}
            for adapter, recipe in adapters:
                casts[adapter] = _real_casts(adapter, models[recipe], params, tensors, casts[recipe])
            exact = {name: (exact_scale(models[name], casts[name].amax),
                            None if tensors is None else exact_codes(tensors, casts[name].cast_scale, fmt))
                     for name in members}
            compared = _comparisons(members, adapters, casts, exact, fmt)
            row = {"variant": _params_text(params), "input": kind, "scales": int(casts[members[0]].scale.size)}
            for label, (scales, codes) in compared.items():
                row[f"{label}: scales"], row[f"{label}: codes"] = scales, codes
            counts.append(row)
            differing = _scales_differing(members, adapters, casts, exact)
            if differing.any() and kind not in {e["input"] for e in examples}:
                examples += _recipe_examples(members, adapters, casts, exact, kind, params, differing)
    versions = _versions(page, skipped)
    result = {"page": page.stem, "table": page.table, "members": {n: _recipe_row(n) for n in members},
              "versions": versions, "real": {a: r for a, r in adapters}, "not_run": sorted(skipped),
              "counts": counts, "examples": examples}
    return _recipe_markdown(page, model_class, result), result


def _scales_differing(members, adapters, casts, exact) -> np.ndarray:
    base = casts[members[0]].scale.ravel()
    differing = np.zeros(base.shape, bool)
    for name in [*members[1:], *(a for a, _ in adapters)]:
        differing |= ~_same_bits(base, casts[name].scale.ravel())
    for name in members:
        scale = exact[name][0].ravel()
        differing |= ~np.isnan(scale) & ~_same_bits(casts[name].scale.ravel(), scale)
    return differing


def _recipe_row(name: str) -> dict:
    row = rec.RECIPES[name]
    return {"model": f"{row.model.__name__}({', '.join(f'{k}={v!r}' for k, v in row.fixed.items())})",
            **dataclasses.asdict(row.source), "departs": row.departs}


def _title(model_class) -> str:
    return model_class.__doc__.strip().splitlines()[0].replace("``", "`")


def _recipe_markdown(page: Page, model_class, result: dict) -> str:
    members = ", ".join(f"`{n}`" for n in page.members)
    lines = [f"# {members}: {_title(model_class)}", "", _PREAMBLE, "", "## What it is", ""]
    for name, row in result["members"].items():
        lines.append(f"- `{name}` = `{row['model']}`: {row['package']} {row['version']}, {row['files']} "
                     f"({row['verified']}). Departs from exact: {row['departs']}.")
    lines += ["", "## Implementations, side by side", ""]
    lines += [f"- fpemu's model of `{n}` (`fpemu.make_recipe({n!r}, ...)`)" for n in page.members]
    lines += [f"- `{n}`'s own code: not run here: it is a CUDA kernel, modelled from its source (its RECIPES row: "
              "source-derived)" for n, row in result["members"].items() if row["verified"] == "source-derived"]
    for adapter, recipe in result["real"].items():
        cast = "its scales and its own cast of each tensor" if adapter in REAL_CASTS else \
            "its scales from the amaxes the model read (its cast is not driven)"
        lines.append(f"- `{adapter}`: the real code of `{recipe}` (fpemu.adapters), {cast}")
    lines += [f"- `{a}`: {_not_run_text(a)}" for a in result["not_run"]]
    lines += ["- exact: the scale fp8_max * 2^-margin / amax of each implementation's own amax, rounded once to "
              "float32 (floored to a power of two when asked; defined where the amax is finite and > 0), and the "
              "codes of x * scale rounded once (nearest even, saturating) with each implementation's own scale",
              "", "Versions:", "", *_versions_lines(result["versions"]), "",
              "## Inputs", "",
              f"Per input kind (`fpemu.blocks.probes.PROBE_KINDS`: {', '.join(PROBE_KINDS)}), {TENSORS} tensors of "
              f"{ROWS} x {COLUMNS} from `probe_blocks(kind, fp8_format, rows={TENSORS * ROWS}, block_size={COLUMNS}, "
              f"seed=index of kind)`, tensor t holding rows t, t + {TENSORS}, ...; one step per tensor in order "
              "(the delayed recipe casts each with the scale of the step before, starting from 1). Then the "
              f"`{AMAX_STREAM}`: {len(amax_stream())} amaxes alone, one per step (no tensors, so no codes): "
              "`benchmarks.fp8_recipes_report`'s edge amaxes, then 200 from its seeded `GENERATED` source "
              "(3 * 2^U(-30, 30) with 8% zero, 3% inf and 3% NaN amaxes), each fed as the amax the "
              "implementation read.", "",
              "## How many differ", "",
              "Scales (float32 bits) and fp8 codes that differ, NaN-aware, per parameter set and input kind; "
              "`X vs exact: scales` counts only the scales whose exact value is defined; - : not driven.", "",
              markdown_table(result["counts"], [(k, k) for k in result["counts"][0]]), "",
              "## Where they differ", ""]
    if result["examples"]:
        lines += [f"Per input kind, in the first parameter set where scales differ, the first tensor (a row for "
                  f"rowwise scales, a step for the {AMAX_STREAM}) of each distinct cause, up to {EXAMPLES_PER_KIND}: "
                  "where two scales differ, or one differs from exact.", "",
                  markdown_table(result["examples"], [(k, k) for k in result["examples"][0]]), "",
                  "Why an implementation departs from exact (its RECIPES row's `departs`):", ""]
        lines += [f"- `{name}`: {row['departs']}." for name, row in result["members"].items()]
    else:
        lines.append("Nowhere: every scale is the same in every implementation and exact.")
    return "\n".join(lines) + "\n"


_PREAMBLE = ("Written by `python -m benchmarks.recipe_pages`: a pure function of the seeded inputs and the versions "
             "named here ([all pages](README.md); docs/fp8_recipes.md and docs/blocks.md explain the rules).")


# --- block rules ----------------------------------------------------------------------------

def exact_blocks(x: np.ndarray, q) -> tuple:
    """(element codes, values, defined) of x / scale rounded once (nearest even, saturating) with ``q``'s
    own block scales (times its tensor scale), dequantized exactly (one rounding to float32).
    ``defined``: where the scale is finite and > 0 (a NaN block scale, or a tensor scale of 0, leaves
    nothing exact to compare); codes are -1 where undefined or the element is NaN."""
    scale = q.scales.astype(np.float64) * (1.0 if q.tensor_scale is None else float(q.tensor_scale))
    scale = np.repeat(scale, q.block_size, axis=-1)
    defined = np.isfinite(scale) & (scale > 0)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        elements = quantize(x.astype(np.float64) / np.where(defined, scale, 1.0), q.element_format,
                            overflow="saturate")
        values = (elements * scale).astype(np.float32)
    nan = np.isnan(elements) | ~defined
    codes = np.where(nan, -1, codes_of_values(np.where(nan, 0.0, elements), q.element_format).astype(np.int64))
    return codes, values, defined


def _code_mismatches(a, b) -> int:
    a, b = np.asarray(a, np.int64), np.asarray(b, np.int64)
    return int(np.count_nonzero((a != b) & (b != -1) & (a != -1)))


def _scale_mismatches(a, b) -> int:
    tensor = int(not np.array_equal(np.float32(a.tensor_scale or 0).view(np.uint32),
                                    np.float32(b.tensor_scale or 0).view(np.uint32)))
    # any NaN scale code alike: e4m3 has two (0x7F, 0xFF), and TE's reference picks one by where torch's
    # vector loop put the block (bench_blocks' TE notes)
    both_nan = np.isnan(np.asarray(a.scales, np.float32)) & np.isnan(np.asarray(b.scales, np.float32))
    return int(np.count_nonzero((a.scale_codes != b.scale_codes) & ~both_nan)) + tensor


def _scale_text(q, at) -> str:
    code = int(q.scale_codes.ravel()[at])
    return f"0x{code:02x} ({_show(float(q.scales.ravel()[at]))})"


def block_page(page: Page) -> tuple:
    """(markdown, result) of a SCALE_RULES page."""
    rule = SCALE_RULES[page.stem]
    skipped = not_run(page)
    adapters = [name for name in real_adapters(page) if name not in skipped]
    with_ocp = rule.scale_format == "e8m0" and rule.name != "ocp"
    counts, examples = [], []
    for elem in rule.elements:
        for kind in PROBE_KINDS:
            x = probe_blocks(kind, elem, rows=BLOCKS_PER_KIND, block_size=32, seed=PROBE_KINDS.index(kind))
            ours = block_quantize(x, elem, scale_rule=rule.name)
            codes, values, defined = exact_blocks(x, ours)
            row = {"element": elem, "input": kind, "blocks": int(ours.scale_codes.size), "elements": int(x.size)}
            per_block = {}
            for adapter in adapters:
                real = get_adapter(adapter).function()(x, elem, rule.name)  # the blocks adapter's own entry
                row[f"vs {adapter}: scale codes"] = _scale_mismatches(ours, real)
                row[f"vs {adapter}: element codes"] = _code_mismatches(ours.element_codes, real.element_codes)
                row[f"vs {adapter}: values"] = _mismatches(ours.values, real.values)
                per_block[adapter] = real
            if with_ocp:
                ocp = block_quantize(x, elem, scale_rule="ocp")
                row["vs ocp: scale codes"] = int(np.count_nonzero(ours.scale_codes != ocp.scale_codes))
                row["vs ocp: values"] = _mismatches(ours.values, ocp.values)
                per_block["ocp"] = ocp
            row["vs exact: element codes"] = _code_mismatches(ours.element_codes, codes)
            row["vs exact: values"] = _mismatches(ours.values[defined], values[defined])
            counts.append(row)
            if kind not in {e["input"] for e in examples}:
                example = _block_example(x, ours, per_block, codes, np.where(defined, values, ours.values), elem, kind)
                if example:
                    examples.append(example)
    result = {"page": page.stem, "table": page.table, "rule": _rule_row(rule), "versions": _versions(page, skipped),
              "real": adapters, "not_run": sorted(skipped), "counts": counts, "examples": examples}
    return _block_markdown(rule, result, with_ocp), result


def _block_example(x, ours, others: dict, codes, values, elem, kind) -> Optional[dict]:
    """The first block where the model's scale differs from another's, or its values from exact."""
    size = ours.block_size
    value_off = ~_same_bits(ours.values, values).reshape(*ours.scale_codes.shape, size)
    code_off = ((ours.element_codes != codes) & (codes != -1)).reshape(value_off.shape)
    differing = value_off.any(-1) | code_off.any(-1)
    for other in others.values():
        differing |= ours.scale_codes != other.scale_codes
    if not differing.any():
        return None
    at = int(np.flatnonzero(differing)[0])
    block = np.abs(x.reshape(-1, size)[at])
    row = {"element": elem, "input": kind, "block": at,
           "amax": _show(float(np.max(block))) if not np.isnan(block).any() else "NaN",
           "model scale": _scale_text(ours, at)}
    for name, other in others.items():
        row[f"{name} scale"] = _scale_text(other, at)
    row["elements off exact"] = int(value_off.reshape(-1, size)[at].sum())
    return row


def _power_text(value: float) -> str:
    exponent = np.log2(value)
    return f"2**{int(exponent)}" if exponent == int(exponent) else _show(value)


def _rule_row(rule) -> dict:
    return {**dataclasses.asdict(rule), "elements": list(rule.elements), "exponent_text": EXPONENTS[rule.exponent],
            "application_text": APPLICATIONS[rule.application]}


def _block_markdown(rule, result: dict, with_ocp: bool) -> str:
    lines = [f"# `{rule.name}`: {rule.source}", "", _PREAMBLE, "", "## What it is", "",
             f"- source: {rule.source}",
             f"- scales: {rule.scale_format}, one per {rule.block_size} values"
             + (", and a float32 tensor scale" if rule.levels == 2 else ""),
             f"- elements: {', '.join(rule.elements)}, rounded {rule.rounding}",
             f"- scale: {EXPONENTS[rule.exponent]}",
             f"- applied: {APPLICATIONS[rule.application]}"
             + ("" if rule.rcp_byte0 is None else f"; rcp_byte0 = {_power_text(rule.rcp_byte0)}"),
             f"- NaN: the amax {'ignores' if rule.amax_nan == 'ignore' else 'propagates'} it; a NaN element becomes "
             f"{NAN_ELEMENTS[rule.nan_element]}",
             f"- departs from exact: {rule.departs}", "",
             "## Implementations, side by side", "",
             f"- fpemu's model: `fpemu.block_quantize(x, element, scale_rule={rule.name!r})`"]
    lines += [f"- `{a}`: the real code (fpemu.adapters), run on the same blocks" for a in result["real"]]
    lines += [f"- `{a}`: {_not_run_text(a)}" for a in result["not_run"]]
    if not result["real"] and not result["not_run"]:
        drivers = {name: driven_rules(name) for name in adapters_of_kind(BLOCKS)}
        lines.append("- the real code: not run: no blocks adapter drives this rule here ("
                     + "; ".join(f"`{n}` drives {', '.join(rules)}" for n, rules in drivers.items()) + ")")
    if with_ocp:
        lines.append("- `ocp`: the OCP MX v1.0 rule (exact arithmetic) on the same blocks")
    lines += ["- exact: x / scale rounded once (nearest even, saturating) with the model's own scales, dequantized "
              "with one rounding (compared where the scale is finite and > 0; element codes where x is not NaN)"
              + (": the rule rounds its dequantization scale fl32(t * s) and then the product, so values can differ "
                 "from exact where the element codes do not" if rule.levels == 2 else ""), "",
              "Versions:", "", *_versions_lines(result["versions"]), "",
              "## Inputs", "",
              f"Per element format and input kind (`fpemu.blocks.probes.PROBE_KINDS`: {', '.join(PROBE_KINDS)}): "
              f"`probe_blocks(kind, element, rows={BLOCKS_PER_KIND}, block_size=32, seed=index of kind)`, "
              "the same blocks every rule's page uses.", "",
              "## How many differ", "",
              "Scale codes (with the tensor scale of two-level NVFP4), element codes and dequantized values "
              "(float32 bits, NaN-aware) that differ from the model's.", "",
              markdown_table(result["counts"], [(k, k) for k in result["counts"][0]]), "",
              "## Where they differ", ""]
    if result["examples"]:
        lines += ["The first block of each input kind (in the first element format where one does) whose scale code "
                  "differs from another implementation's, or whose values differ from exact; scale: code (value).", "",
                  markdown_table(result["examples"], [(k, k) for k in result["examples"][0]]), "",
                  f"Cause: {rule.departs}."]
    else:
        lines.append("Nowhere: every scale code and value is the same in every implementation and exact.")
    return "\n".join(lines) + "\n"




# --- the files --------------------------------------------------------------------------------

def build(page: Page) -> tuple:
    """(markdown, result) of one page."""
    return (recipe_page if page.table == "RECIPES" else block_page)(page)


def as_json(result: dict) -> str:
    """A page's .json: its result, keys sorted."""
    return json.dumps(result, indent=2, sort_keys=True) + "\n"


def real_mismatches(result: dict) -> Optional[int]:
    """Everything the page counts between fpemu's model and the real code (None when none ran)."""
    if not result["real"]:
        return None
    return sum(value for row in result["counts"] for key, value in row.items()
               if isinstance(value, int) and any(f"vs {adapter}:" in key for adapter in result["real"]))


def index(results: dict) -> str:
    """reports/recipes/README.md: a row per page (``results``: each page's result by stem)."""
    rows = []
    for stem, page in pages().items():
        if page.table == "RECIPES":
            source = rec.RECIPES[stem].source
            source = f"{source.package} {source.version}"
        else:
            source = SCALE_RULES[stem].source
        real = results[stem]["real"]
        mismatches = real_mismatches(results[stem])
        rows.append({"page": f"[{stem}]({stem}.md)", "covers": ", ".join(f"`{m}`" for m in page.members),
                     "table": page.table, "source": source,
                     "real code run": ", ".join(f"`{a}`" for a in real) or "none here",
                     "model vs real code": "-" if mismatches is None else f"{mismatches} mismatches"})
    return ("# A page per fp8 scaling recipe and block scale rule, implementations side by side\n\n"
            "Written by `python -m benchmarks.recipe_pages`: each page runs one recipe's (or block rule's) "
            "implementations side by side on the same seeded tensors: fpemu's model, the real code where it runs "
            "here, and the exact reference; it counts what differs per input kind and shows where, "
            "with the cause. A pure function of the seeded inputs and the versions each page names; "
            "tests/test_recipe_pages.py regenerates every page and compares.\n\n"
            + markdown_table(rows, [(k, k) for k in rows[0]]) + "\n")


def write_pages(out: pathlib.Path = PAGES_DIR) -> list:
    """Write every page (.md and .json) and the index into ``out``; returns the paths written."""
    written, results = [], {}
    for stem, page in pages().items():
        markdown, result = build(page)
        results[stem] = result
        written += [atomic_write(out / f"{stem}.md", markdown), atomic_write(out / f"{stem}.json", as_json(result))]
    written.append(atomic_write(out / "README.md", index(results)))
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=PAGES_DIR, help="folder (default reports/recipes)")
    args = parser.parse_args()
    for path in write_pages(args.out):
        print(path)


if __name__ == "__main__":
    main()
