"""fp8 per-tensor scaling recipes side by side on the same amaxes and tensors: reports/fp8_recipes.md and .json.

Transformer Engine's DelayedScaling (fused kernel and unfused path), Float8CurrentScaling (CUDA
kernel and Python reference) and torchao.float8 (tensorwise and rowwise, with and without
power-of-two scales), each as fpemu's model (fpemu.scalers.fp8_recipes), and beside it the real
code where it runs here: TE's own Python recipe code from its source tree (fpemu.adapters.te_recipes)
and torchao 0.18 (fpemu.adapters.torchao_float8), counted in mismatches against the model.

Everything here is a pure function of seeded inputs and the versions named in the page (no
timings, nothing of the host); a column whose real code is absent says why it was not run.

Run: python -m benchmarks.fp8_recipes_report
"""

from __future__ import annotations

import json
import math

import numpy as np

from benchmarks._common import REPORTS, markdown_table
from fpemu.fileio import atomic_write
from fpemu.scalers import fp8_recipes as rec
from fpemu.specs import AmaxSource

NAN, INF = float("nan"), float("inf")
WORKED = [  # (name, recipe params, amaxes, what it shows)
    ("zero amax", {"amax_history_len": 2}, [4.0, 0.0, 0.0, 1.0, 1.0], "the fused kernel does not roll on a zero amax"),
    ("NaN amax", {"amax_history_len": 3}, [1.0, NAN, 2.0, 2.0, 2.0], "fmaxf ignores NaN, torch.max propagates it"),
    ("tiny amax, margin 1", {"amax_history_len": 1, "margin": 1}, [1e-36, 1e-45, 117.0, 0.0],
     "the unfused quotient overflows before the margin divides it"),
    ("inf amax, most_recent", {"amax_history_len": 2, "amax_compute_algo": "most_recent"}, [2.0, INF, 8.0, 0.0],
     "both keep the old scale"),
]
GENERATED = AmaxSource("generated", seed=5, magnitude=3.0, spread=30.0, zero_rate=0.08, inf_rate=0.03, nan_rate=0.03)
EDGE_AMAXES = [0.0, 1e-45, 1e-40, 1e-36, 9.4e-5, 0.43750003, 1.0, 3.0, 56.000004, 117.0, 448.0, 469762100.0,
               3e38, INF, NAN]


def _show(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:.9g}"


def _same(a, b) -> bool:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return a.shape == b.shape and bool(np.all((np.isnan(a) & np.isnan(b)) | (a.view(np.uint64) == b.view(np.uint64))))


def _mismatches(a, b) -> int:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return int(np.count_nonzero(~((np.isnan(a) & np.isnan(b)) | (a.view(np.uint64) == b.view(np.uint64)))))


def _te():
    """fpemu.adapters.te_recipes where TE's source is here, else the reason it is not."""
    from fpemu.adapters import unavailable_reason
    reason = unavailable_reason("te_unfused")
    if reason:
        return None, reason
    from fpemu.adapters import te_recipes
    return te_recipes, None


def _torchao():
    from fpemu.adapters import unavailable_reason
    reason = unavailable_reason("torchao_float8")
    if reason:
        return None, reason
    from fpemu.adapters import torchao_float8
    return torchao_float8, None


# --- TE delayed scaling ------------------------------------------------------------------

def delayed_section(te) -> tuple:
    rows, result = [], {"worked": [], "generated": {}}
    for name, params, amaxes, why in WORKED:
        fused = rec.DelayedScaling(**params).run(amaxes)
        unfused = rec.DelayedScaling(**params, path="unfused").run(amaxes)
        real = te.run_delayed_unfused(amaxes, **params)["scale"] if te else None
        for step, amax in enumerate(amaxes):
            rows.append({"case": name if step == 0 else "", "step": step, "amax": _show(amax),
                         "fused": _show(fused.scale[step]), "unfused": _show(unfused.scale[step]),
                         "te": _driven_cell(real, step, unfused.scale[step]),
                         "differ": "yes" if not _same(fused.scale[step], unfused.scale[step]) else ""})
        result["worked"].append({"case": name, "params": params, "amax": [_show(a) for a in amaxes],
                                 "fused": list(map(_show, fused.scale)), "unfused": list(map(_show, unfused.scale)),
                                 "te_unfused_mismatches": None if real is None else _mismatches(real, unfused.scale),
                                 "shows": why})
    amaxes = GENERATED.amaxes(200)
    params = {"amax_history_len": 16, "margin": 2}
    fused = np.array(rec.DelayedScaling(**params).run(amaxes).scale, np.float32)
    unfused = np.array(rec.DelayedScaling(**params, path="unfused").run(amaxes).scale, np.float32)
    differ = fused.view(np.uint32) != unfused.view(np.uint32)
    last_bit = differ & (np.abs(fused.view(np.int32).astype(np.int64) - unfused.view(np.int32).astype(np.int64)) <= 1)
    real = te.run_delayed_unfused(amaxes.tolist(), **params)["scale"] if te else None
    result["generated"] = {"steps": 200, "params": params,
                           "source": "seed 5, 3 * 2^U(-30, 30), 8% zero, 3% inf, 3% NaN",
                           "steps_differing": int(differ.sum()), "of_which_last_bit": int(last_bit.sum()),
                           "te_unfused_mismatches": None if real is None else _mismatches(real, unfused)}
    binade = np.arange(0x3F800000, 0x40000000, dtype=np.uint32).view(np.float32)
    one_division = np.float32(448) / binade
    reciprocal = (np.float32(1) / binade) * np.float32(448)
    result["reciprocal_binade"] = {"amaxes": int(binade.size),
                                   "differ": int(np.count_nonzero(one_division != reciprocal))}
    return rows, result


# --- current scaling and torchao on the same amaxes ----------------------------------------

SCALE_COLUMNS = [  # (key, title, model)
    ("te_current", "TE kernel", rec.CurrentScaling()),
    ("te_current_pow2", "TE kernel pow2", rec.CurrentScaling(power_2_scales=True)),
    ("te_reference", "TE reference", rec.CurrentScaling(implementation="reference")),
    ("te_reference_pow2", "TE reference pow2", rec.CurrentScaling(power_2_scales=True, implementation="reference")),
    ("torchao", "torchao", rec.TorchaoScaling()),
    ("torchao_pow2", "torchao pow2", rec.TorchaoScaling(power_of_2=True)),
]


def current_section(te, torchao) -> tuple:
    rows = []
    for amax in EDGE_AMAXES:
        row = {"amax": _show(amax)}
        for key, _, model in SCALE_COLUMNS:
            row[key] = _show(float(model.scale_from_amax(np.float32(amax))))
        rows.append(row)
    amaxes = np.float32(448.0) / rec.scales_near_powers_of_2()
    rng = np.random.default_rng(3)
    random = rng.integers(1, 0x7F800000, 1_000_000, dtype=np.uint32).view(np.float32)
    kernel = np.array([rec.CurrentScaling().scale_from_amax(a) for a in random[:20000]], np.float32)
    torchao_scale = rec.TorchaoScaling().scale_from_amax(random[:20000])
    floor = random[:20000] >= np.float32(rec.TORCHAO_EPS)  # above torchao's clamp
    result = {
        "edge_amaxes": [dict(r) for r in rows],
        "pow2_edges": {"scales": int(amaxes.size), "torchao_rounds_up": rec.power_of_2_departures(
            rec.TorchaoScaling().scale_from_amax(amaxes))},
        "pow2_random": {"amaxes": int(random.size), "torchao_rounds_up": rec.power_of_2_departures(
            rec.TorchaoScaling().scale_from_amax(random))},
        "kernel_vs_torchao_random": {"amaxes": int(floor.sum()),
                                     "differ": _mismatches(kernel[floor], torchao_scale[floor])},
    }
    driven = {}
    if te is not None:
        sample = list(amaxes[::4]) + EDGE_AMAXES
        for pow2 in (False, True):
            model = rec.CurrentScaling(power_2_scales=pow2, implementation="reference")
            real = [te.reference_current_scale(a, pow_2_scales=pow2)[0] for a in sample]
            driven[f"te_reference{'_pow2' * pow2}"] = {"amaxes": len(sample), "mismatches": _mismatches(
                real, [model.scale_from_amax(np.float32(a)) for a in sample])}
    if torchao is not None:
        for pow2 in (False, True):
            real = torchao.amax_to_scale(np.concatenate([random, amaxes]), power_of_2=pow2)
            model = rec.TorchaoScaling(power_of_2=pow2).scale_from_amax(np.concatenate([random, amaxes]))
            driven[f"torchao{'_pow2' * pow2}"] = {"amaxes": int(real.size), "mismatches": _mismatches(real, model)}
    result["driven"] = driven
    return rows, result


# --- casts on the same tensors ------------------------------------------------------------------

def _tensors():
    rng = np.random.default_rng(7)
    randn = rng.standard_normal((64, 64)).astype(np.float32)
    specials = randn.copy()
    specials[0, :3] = [NAN, INF, -INF]
    return {"randn": randn, "wide": (randn * np.exp2(rng.uniform(-40, 40, randn.shape))).astype(np.float32),
            "with NaN/inf": specials, "tiny (1e-30)": (randn * 1e-30).astype(np.float32)}


CASTERS = [("TE kernel", lambda fmt: rec.CurrentScaling(fp8_format=fmt)),
           ("TE reference", lambda fmt: rec.CurrentScaling(fp8_format=fmt, implementation="reference")),
           ("torchao", lambda fmt: rec.TorchaoScaling(fp8_format=fmt)),
           ("torchao pow2", lambda fmt: rec.TorchaoScaling(fp8_format=fmt, power_of_2=True)),
           ("torchao rowwise pow2",
            lambda fmt: rec.TorchaoScaling(fp8_format=fmt, granularity="rowwise", power_of_2=True))]


def _code_differences(a, b, fmt) -> int:
    from fpemu.formats import decode
    nan = np.isnan(decode(a.ravel(), fmt)) & np.isnan(decode(b.ravel(), fmt))
    return int(np.count_nonzero(~nan & (a.ravel() != b.ravel())))


def cast_section(te, torchao) -> tuple:
    rows, result = [], []
    for name, x in _tensors().items():
        for fmt in rec.FP8_FORMATS:
            casts = {label: make(fmt).quantize(x) for label, make in CASTERS}
            base = casts["TE kernel"]
            row = {"tensor": name, "format": fmt}
            for label, cast in casts.items():
                row[label] = _code_differences(cast.codes, base.codes, fmt)
            if te is not None:
                _, codes = te.reference_current_quantize(x, fmt)
                row["driven TE ref"] = _code_differences(codes, casts["TE reference"].codes, fmt)
            if torchao is not None:
                total = 0
                for label, granularity, pow2 in (("torchao", "tensorwise", False), ("torchao pow2", "tensorwise", True),
                                                 ("torchao rowwise pow2", "rowwise", True)):
                    _, codes = torchao.quantize(x, fmt, granularity, -1, pow2)
                    total += _code_differences(codes, casts[label].codes, fmt)
                row["driven torchao"] = total
            rows.append(row)
            result.append(dict(row, elements=int(x.size)))
    return rows, result


# --- Float8Linear training ------------------------------------------------------------------------

def training_section(torchao) -> dict:
    if torchao is None:
        return {}
    from fpemu.compare import compare_traces
    from fpemu.harness import float8_training_traces
    out = {}
    for recipe in ("tensorwise", "rowwise"):
        observed, model = float8_training_traces(recipe, steps=20)
        verdict = compare_traces(model, observed)
        out[recipe] = {"steps": verdict.steps_compared, "status": verdict.status,
                       "casts_per_step": len(observed.steps[0]["fp8_casts"]),
                       "scales_per_step": sum(map(len, observed.steps[0]["tensor_scale"])),
                       "first_divergence": None if verdict.divergence is None else verdict.divergence.as_dict()}
    return out


# --- the page ---------------------------------------------------------------------------------

# fpemu's models give the same bits on every numpy and ml_dtypes release pyproject.toml supports (CI stage 2
# checks the oldest and newest), so a page names the range, not this host's releases: regenerated with newer
# ones it stays byte-identical.
MODELS_VERSIONS = "numpy and ml_dtypes, any release pyproject.toml supports"


def _versions(te_reason, torchao_reason) -> list:
    from fpemu.adapters import package_versions
    lines = [f"- fpemu's models: {MODELS_VERSIONS}"]
    for name, source in rec.RECIPES.items():
        lines.append(f"- `{name}`: {source.source.package} {source.source.version}, {source.source.files} "
                     f"({source.source.verified})")
    te_versions = ", ".join(f"{k} {v}" for k, v in package_versions(["torch", "pydantic"]).items())
    lines.append("- driven TE code: " + (te_reason or f"TE's Python source at d0067d0 with {te_versions}"))
    lines.append("- driven torchao: " + (torchao_reason or ", ".join(
        f"{k} {v}" for k, v in package_versions(["torchao", "torch"]).items())))
    return lines


def build() -> tuple:
    te, te_reason = _te()
    torchao, torchao_reason = _torchao()
    delayed_rows, delayed = delayed_section(te)
    current_rows, current = current_section(te, torchao)
    cast_rows, casts = cast_section(te, torchao)
    training = training_section(torchao)
    result = {"delayed": delayed, "current": current, "casts": casts, "training": training,
              "not_run": {"te": te_reason, "torchao": torchao_reason}}
    return result, _page(result, delayed_rows, current_rows, cast_rows, te_reason, torchao_reason)


def _page(result, delayed_rows, current_rows, cast_rows, te_reason, torchao_reason) -> str:
    gen, binade, cur = result["delayed"]["generated"], result["delayed"]["reciprocal_binade"], result["current"]
    delayed_table = markdown_table(delayed_rows, [("case", "case"), ("step", "step"), ("amax", "amax"),
                                                  ("fused", "fused (kernel_bulk)"), ("unfused", "unfused (model)"),
                                                  ("te", "TE's unfused code"), ("differ", "fused != unfused")])
    current_table = markdown_table(current_rows, [("amax", "amax")] + [(k, t) for k, t, _ in SCALE_COLUMNS])
    cast_columns = [("tensor", "tensor"), ("format", "format")] + [(label, label) for label, _ in CASTERS[1:]]
    cast_columns += [(k, k) for k in ("driven TE ref", "driven torchao") if k in cast_rows[0]]
    driven = cur["driven"]
    lines = [
        "# fp8 per-tensor scaling recipes, side by side",
        "",
        "Written by `python -m benchmarks.fp8_recipes_report`; a pure function of seeded inputs and the versions below "
        "(docs/fp8_recipes.md explains every rule). Scales are float32, shown to 9 digits; \"same\" means bit for bit.",
        "",
        "A page per recipe, its implementations and the exact reference on the same probe tensors: "
        "[recipes/README.md](recipes/README.md) (`python -m benchmarks.recipe_pages`).",
        "",
        "Versions and sources:",
        "",
        *_versions(te_reason, torchao_reason),
        "",
        "## Transformer Engine DelayedScaling: fused vs unfused",
        "",
        "The scale each step's update computes (the next step casts with it), on TE's worked cases. fused: "
        "`kernel_bulk` (TE's default, source-derived: it runs on a GPU only); unfused: `NVTE_UNFUSED_FP8_UPDATE=1`, "
        "fpemu's model, and TE's own Python update run on the CPU.",
        "",
        delayed_table,
        "",
        f"- Generated amaxes ({gen['source']}, history 16, margin 2, {gen['steps']} steps): the paths give different "
        f"scales on {gen['steps_differing']} steps, {gen['of_which_last_bit']} of them in the last bit only. "
        f"TE's unfused code vs the model: {_count(gen['te_unfused_mismatches'], te_reason)}.",
        f"- The last bit: the unfused `fp8_max / amax` is torch's `Tensor.__rtruediv__`, `amax.reciprocal() * fp8_max` "
        f"(two roundings); the kernel divides once. Over every float32 amax in [1, 2) ({binade['amaxes']:,}) "
        f"they differ on {binade['differ']:,} ({binade['differ'] / binade['amaxes']:.1%}); the pattern repeats in "
        f"every binade where neither result is subnormal or overflows.",
        "",
        "## Float8CurrentScaling and torchao: the scale of one amax",
        "",
        "TE kernel: `compute_scale_from_amax` (source-derived). TE reference: the Python reference quantizer. "
        "torchao: `amax_to_scale` (float64 division, clamp at 1e-12).",
        "",
        current_table,
        "",
        "- Power-of-two scales: torchao's `exp2(floor(log2(s)))` in float32 rounds up "
        f"{cur['pow2_edges']['torchao_rounds_up']} "
        f"of {cur['pow2_edges']['scales']} scales within 3 ulp of 2^k (for k in -40..40), and "
        f"{cur['pow2_random']['torchao_rounds_up']} of {cur['pow2_random']['amaxes']:,} random float32 amaxes; TE's "
        "mask (`& 0xFF800000`) and its reference's `frexp` are exact floors.",
        f"- TE kernel vs torchao on {cur['kernel_vs_torchao_random']['amaxes']:,} random amaxes above torchao's clamp: "
        f"{cur['kernel_vs_torchao_random']['differ']} scales differ (torchao's float64 quotient rounded once to "
        "float32 "
        "equals the float32 division there).",
    ]
    for key, entry in driven.items():
        lines.append(f"- Driven `{key}` vs fpemu's model: {entry['mismatches']} mismatches in "
                     f"{entry['amaxes']:,} amaxes.")
    if te_reason:
        lines.append(f"- TE's reference not run: {te_reason}.")
    if torchao_reason:
        lines.append(f"- torchao not run: {torchao_reason}.")
    lines += [
        "",
        "## The fp8 codes of the same tensors",
        "",
        "Codes that differ from the TE kernel's cast of the same 64x64 tensor (its own scale each; NaN codes equal). "
        "`driven` columns: the real code vs fpemu's model of it (every torchao variant summed).",
        "",
        markdown_table(cast_rows, cast_columns),
        "",
        "- TE kernel vs reference: the kernel's amax ignores NaN (an inf amax gives scale 1, and its saturating cast "
        "maps inf to the format's max); the reference's torch.amax propagates NaN, so one NaN makes every code NaN "
        "(torchao alike). torch's eager e5m2 cast, which the reference uses, overflows to inf where the kernel "
        "saturates, but a scale of fp8_max / amax never takes a finite element past the rounding threshold.",
        "- torchao vs TE kernel: the same scale on finite tensors whose amax is above torchao's clamp of 1e-12. "
        "Below it (the `tiny` rows, amax about 4e-30) torchao's scale is 448e12 and every element becomes 0: "
        "the clamp flushes small tensors, such as small gradients, where TE scales them up to 448. torchao's "
        "power-of-two scales are up to 2x smaller, so codes move; rowwise scales each row by its own amax.",
        "",
        "## A Float8Linear MLP trained for real (torchao), against fpemu's model on the same tensors",
        "",
    ]
    for recipe, entry in result["training"].items():
        lines.append(f"- `{recipe}`: {entry['steps']} SGD steps, {entry['casts_per_step']} casts per step "
                     f"({entry['scales_per_step']} scales): {entry['status']} (amaxes, scales and fp8 codes of every "
                     "cast, bit for bit; `fpemu.harness.float8_training_traces`; as specs: "
                     "`specs/fp8_training_torchao_*.toml`).")
    if torchao_reason:
        lines.append(f"- not run: {torchao_reason}")
    return "\n".join(lines) + "\n"


def _driven_cell(real, step, model) -> str:
    """The real code's value at ``step``: "same" where it is the model's bit for bit; "-" when not run."""
    if real is None:
        return "-"
    return "same" if _same(real[step], model) else _show(real[step])


def _count(mismatches, reason) -> str:
    return f"not run ({reason})" if mismatches is None else f"{mismatches} mismatches"


def main() -> None:
    result, page = build()
    atomic_write(REPORTS / "fp8_recipes.md", page)
    atomic_write(REPORTS / "fp8_recipes.json", json.dumps(result, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
