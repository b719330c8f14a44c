"""Block quantization: fpemu against torchao 0.18 and Transformer Engine's Python references on a larger
sweep, each rule's departures from the exact OCP rule (MX) or exact two-level NVFP4, TE's NVFP4 against
torchao's, and speed (4M values to MXFP8 against fpemu's own fp8 quantize and torchao's CPU path).

Writes reports/blocks.md and reports/blocks.json.  Run: python -m benchmarks.bench_blocks [--rows N]
"""

from __future__ import annotations

import argparse

import numpy as np

import fpemu
from benchmarks._common import TIMING_NOTE, best_times_interleaved, write_report
from fpemu.blocks import SCALE_RULES, block_quantize
from fpemu.blocks.probes import PROBE_KINDS, probe_blocks

EXACT_KINDS = ("random", "wide", "edges", "tiny")  # finite inputs, where exact arithmetic is defined
NVFP4_RULES = ("te_nvfp4", "te_nvfp4_reference", "torchao_nvfp4_2level")
TORCHAO_RULES = ["torchao_floor", "torchao_ceil", "torchao_even", "torchao_rceil", "torchao_nvfp4",
                 "torchao_nvfp4_2level"]


def _same(a, b) -> np.ndarray:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return (a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))


def _mismatch_total(rule: str, elem: str) -> dict:
    return {"rule": rule, "element": elem, "scale_codes": 0, "element_codes": 0, "values": 0, "blocks": 0,
            "elements": 0}


def _add_mismatches(total: dict, x, ours, theirs, scale_differs) -> None:
    """Adds one input's mismatches to ``total``: the scales ``scale_differs`` marks, the element codes and
    the values (float32 bits, NaN-aware) that differ."""
    total["scale_codes"] += int(np.count_nonzero(scale_differs))
    total["element_codes"] += int(np.count_nonzero(ours.element_codes != theirs.element_codes))
    total["values"] += int(np.count_nonzero(~_same(ours.values, theirs.values)))
    total["blocks"] += ours.scale_codes.size
    total["elements"] += x.size


def sweep_against_torchao(rows: int) -> list:
    from fpemu.adapters.torchao_blocks import torchao_block_quantize
    out = []
    for rule in TORCHAO_RULES:
        for elem in SCALE_RULES[rule].elements:
            total = _mismatch_total(rule, elem)
            for seed, kind in enumerate(PROBE_KINDS):
                x = probe_blocks(kind, elem, rows=rows, block_size=32, seed=100 + seed)
                ours, theirs = block_quantize(x, elem, scale_rule=rule), torchao_block_quantize(x, elem, rule)
                _add_mismatches(total, x, ours, theirs, ours.scale_codes != theirs.scale_codes)
            out.append(total)
    return out


def departures_from_exact(rows: int) -> list:
    """Blocks whose scale code, and elements whose dequantized value, differ from the exact OCP rule."""
    out = []
    for rule in ("torchao_floor", "torchao_ceil", "torchao_even", "torchao_rceil", "te_mxfp8", "te_mxfp8_reference",
                 "microxcaling"):
        for kind in EXACT_KINDS:
            x = probe_blocks(kind, "fp8_e4m3fn", rows=rows, block_size=32, seed=7)
            exact, other = block_quantize(x, "fp8_e4m3fn", scale_rule="ocp"), block_quantize(x, "fp8_e4m3fn", scale_rule=rule)
            out.append({"rule": rule, "kind": kind, "blocks": exact.scale_codes.size,
                        "scale_differs": int(np.count_nonzero(exact.scale_codes != other.scale_codes)),
                        "values_differ": int(np.count_nonzero(~_same(exact.values, other.values)))})
    return out


def sweep_against_te_references(rows: int) -> list:
    """fpemu's TE reference rules against TE's own Python reference code (skipped without TE's source)."""
    from fpemu.adapters import te_block_reference as te
    if te.te_reference_unavailable():
        return []
    out = []
    for label, rule, elem, block, run in (
            ("te_nvfp4_reference", "te_nvfp4_reference", "fp4_e2m1fn", 16, lambda x: te.te_nvfp4_reference(x)[0]),
            ("te_nvfp4_reference, TE's 16 x 16 tiles", "te_nvfp4_reference", "fp4_e2m1fn", 16,
             lambda x: te.te_nvfp4_reference(x, 16)[0]),
            ("te_mxfp8_reference", "te_mxfp8_reference", "fp8_e4m3fn", 32, te.te_mxfp8_reference)):
        total = _mismatch_total(label, elem)
        for seed, kind in enumerate(PROBE_KINDS):
            x = probe_blocks(kind, elem, rows=rows, block_size=block, seed=100 + seed).reshape(rows // 4, 4 * block)
            ours, theirs = block_quantize(x, elem, scale_rule=rule), run(x)
            _add_mismatches(total, x, ours, theirs, ~_same(ours.scales, theirs.scales)  # (any NaN code alike)
                            | ((ours.scale_codes != theirs.scale_codes) & ~np.isnan(ours.scales)))
        out.append(total)
    return out


def ceil_scale_edges() -> dict:
    """Scale codes that differ from the exact ceil(log2(amax / 448)) (clamped to e8m0) for amaxes within
    3 float32 ulps of 448 * 2**k, k = -140..119, per rule: the rules that round the scale up."""
    centre = (448 * np.exp2(np.arange(-140, 120, dtype=np.float64))).astype(np.float32).view(np.uint32)
    amax = (centre[:, None].astype(np.int64) + np.arange(-3, 4)).ravel().astype(np.uint32).view(np.float32)
    amax = amax[amax > 0]
    # (amax / 448 in float64 is a power of two only where the exact quotient is one: amax has 24 bits)
    mantissa, exponent = np.frexp(amax.astype(np.float64) / 448)
    exact = np.clip(np.where(mantissa == 0.5, exponent - 1, exponent), -127, 127) + 127
    x = np.zeros((amax.size, 32), np.float32)
    x[:, 0] = amax
    codes = {rule: block_quantize(x, "fp8_e4m3fn", scale_rule=rule).scale_codes[:, 0]
             for rule in ("te_mxfp8", "te_mxfp8_reference", "torchao_rceil")}
    return {"amaxes": int(amax.size), **{rule: int(np.count_nonzero(c != exact)) for rule, c in codes.items()},
            "te_mxfp8_vs_reference": int(np.count_nonzero(codes["te_mxfp8"] != codes["te_mxfp8_reference"]))}


def exact_nvfp4_codes(x: np.ndarray, scale_codes: np.ndarray) -> tuple:
    """Exact two-level NVFP4 of 2-D finite ``x`` (float64, one rounding each): the scale codes
    e4m3(amax_b * 2688 / (6 * amax_t)), and the element codes of x * 2688 / (amax_t * s) for the
    given ``scale_codes`` (so element departures are counted apart from scale departures)."""
    x64 = x.astype(np.float64)
    tensor = np.abs(x64).max() / (448 * 6)
    blocks = x64.reshape(*x.shape[:-1], -1, 16)
    scales = fpemu.encode(np.abs(blocks).max(axis=-1) / 6 / tensor, "fp8_e4m3fn", overflow="saturate")
    chosen = fpemu.decode(scale_codes, "fp8_e4m3fn")
    chosen = np.where(chosen == 0, 1.0, chosen)  # (scale-0 blocks: no exact elements; not counted)
    elements = fpemu.encode(blocks / (tensor * chosen[..., None]), "fp4_e2m1fn", overflow="saturate")
    return scales, elements.reshape(x.shape)


def nvfp4_inputs(kind: str, rows: int, seed: int = 7) -> np.ndarray:
    """2-D float32 of ``rows`` NVFP4 blocks: a probe kind, ``bf16`` (bf16-valued randn * 1e-3, whose
    block-to-tensor amax ratios hit e4m3 ties exactly), or ``midpoints`` (block amaxes within 3 float32
    ulps of amax_t * m / 448 for every e4m3 midpoint m, amax_t = 0.01234)."""
    if kind in PROBE_KINDS:
        return probe_blocks(kind, "fp4_e2m1fn", rows=rows, block_size=16, seed=seed).reshape(rows // 4, 64)
    if kind == "bf16":
        import ml_dtypes
        randn = np.random.default_rng(seed).standard_normal((rows // 4, 64)) * 1e-3
        return randn.astype(ml_dtypes.bfloat16).astype(np.float32)
    codes = fpemu.decode(np.arange(0, 127), "fp8_e4m3fn")
    tensor_amax = np.float32(0.01234)
    centre = ((codes[:-1] + codes[1:]) / 2 * np.float64(tensor_amax) / 448).astype(np.float32)
    near = (centre.view(np.uint32)[:, None].astype(np.int64) + np.arange(-3, 4)).astype(np.uint32).view(np.float32)
    blocks = np.zeros((near.size + (-near.size - 1) % 4 + 1, 16), np.float32)
    blocks[:near.size, 0], blocks[-1, 0] = near.ravel(), tensor_amax
    return blocks.reshape(-1, 64)


def nvfp4_departures(rows: int) -> list:
    """Per rule and input: blocks whose scale code, and elements (in blocks with a non-zero scale) whose
    code, differ from exact two-level NVFP4; blocks of scale 0 holding non-zero element codes."""
    from fpemu.adapters.torchao_blocks import torchao_block_quantize
    out = []
    for rule in NVFP4_RULES:
        for kind in (*EXACT_KINDS, "bf16", "midpoints"):
            x = nvfp4_inputs(kind, rows)
            run = torchao_block_quantize if rule.startswith("torchao") else None
            q = run(x, "fp4_e2m1fn", rule) if run else block_quantize(x, "fp4_e2m1fn", scale_rule=rule)
            scales, elements = exact_nvfp4_codes(x, q.scale_codes)
            live = np.repeat(q.scale_codes != 0, 16, axis=-1)
            codes = (q.element_codes & 0x7).reshape(*q.scale_codes.shape, 16)  # (magnitudes: -0 is 0)
            out.append({"rule": rule, "kind": kind, "blocks": q.scale_codes.size,
                        "scale_differs": int(np.count_nonzero(scales != q.scale_codes)),
                        "elements_differ": int(np.count_nonzero((elements != q.element_codes) & live)),
                        "zero_scale_nonzero_codes": int(np.count_nonzero((codes != 0).any(axis=-1)
                                                                         & (q.scale_codes == 0)))})
    return out


def te_against_torchao_nvfp4(rows: int) -> list:
    """TE's NVFP4 kernel rule against torchao's two-level NVFP4 (run for real) and TE's own reference
    rule, on the same tensors: where they differ, and in what."""
    from fpemu.adapters.torchao_blocks import torchao_block_quantize
    out = []
    for seed, kind in enumerate((*PROBE_KINDS, "bf16", "midpoints")):
        x = nvfp4_inputs(kind, rows, seed=100 + seed)
        te, ref = (block_quantize(x, "fp4_e2m1fn", scale_rule=r) for r in ("te_nvfp4", "te_nvfp4_reference"))
        ao = torchao_block_quantize(x, "fp4_e2m1fn", "torchao_nvfp4_2level")
        scale_differs = te.scale_codes != ao.scale_codes
        same_scale = np.repeat(~scale_differs, 16, axis=-1)
        out.append({"kind": kind, "blocks": te.scale_codes.size,
                    "scales_vs_torchao": int(np.count_nonzero(scale_differs)),
                    "of_which_te_below_2^-6": int(np.count_nonzero(scale_differs & (te.scale_codes < 8))),
                    "elements_vs_torchao": int(np.count_nonzero(te.element_codes != ao.element_codes)),
                    "of_which_same_scale": int(np.count_nonzero((te.element_codes != ao.element_codes) & same_scale)),
                    "values_vs_torchao": int(np.count_nonzero(~_same(te.values, ao.values))),
                    "scales_vs_reference": int(np.count_nonzero(te.scale_codes != ref.scale_codes)),
                    "elements_vs_reference": int(np.count_nonzero(te.element_codes != ref.element_codes))})
    return out


def speed(n: int) -> dict:
    """Best-of-3 seconds of MXFP8 (torchao FLOOR) on n values: fpemu's block_quantize (scale codes,
    element codes and dequantized values), fpemu's plain fp8 and bf16 quantize of the same array, and
    torchao's CPU path giving the same three (to_mx, then to_dtype to dequantize) and to_mx alone, at
    torch's default thread count and at one thread (fpemu runs on one)."""
    x = _randn(n)
    fns = {"fpemu_block_quantize_mxfp8": lambda: block_quantize(x, "fp8_e4m3fn", scale_rule="torchao_floor"),
           "fpemu_fp8_quantize": lambda: fpemu.quantize(x, "fp8_e4m3fn"),
           "fpemu_bf16_quantize": lambda: fpemu.quantize(x, "bf16")}
    try:
        import torch
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx
    except ImportError:
        torch = None
    if torch is not None:
        tx, floor = torch.from_numpy(x), ScaleCalculationMode.FLOOR

        def same_outputs():
            scale, data = to_mx(tx, torch.float8_e4m3fn, 32, floor)
            return scale, data, to_dtype(data, scale, torch.float8_e4m3fn, 32, torch.float32)

        default_threads = torch.get_num_threads()
        for count in sorted({default_threads, 1}, reverse=True):
            def pinned(fn, count=count):
                def run():
                    torch.set_num_threads(count)
                    try:
                        return fn()
                    finally:
                        torch.set_num_threads(default_threads)
                return run
            fns[f"torchao_to_mx_to_dtype_{count}_threads"] = pinned(same_outputs)
            fns[f"torchao_to_mx_only_{count}_threads"] = pinned(lambda: to_mx(tx, torch.float8_e4m3fn, 32, floor))
    times = best_times_interleaved(list(fns.values()), 3)
    return {name: seconds for name, (seconds, _) in zip(fns, times)}


def _randn(n: int) -> np.ndarray:
    """The speed tests' n float32 standard normal values, in rows of 1024."""
    return np.random.default_rng(0).standard_normal(n).astype(np.float32).reshape(-1, 1024)


def _speed_inputs(n: int) -> dict:
    """The speed test's float32 inputs: :func:`_randn`, it with every other 32-value block zero, and
    ReLU'd (half of each block's elements 0, below any element format's min normal)."""
    x = _randn(n)
    half_zero = x.copy()
    half_zero.reshape(-1, 32)[::2] = 0
    return {"randn": x, "half the blocks zero": half_zero, "ReLU'd randn": np.maximum(x, 0)}


def speed_by_rule(n: int) -> list:
    """Best-of-3 milliseconds of block_quantize under every rule (its first element format) on n randn
    values, and of torchao FLOOR and OCP on the other inputs, with and without the compiled loops
    (fpemu.blocks.quantize._rules_own_arithmetic: no short path at all), each against fpemu's fp8
    quantize of the same array in the same run."""
    import fpemu.blocks.quantize as implementation
    inputs = _speed_inputs(n)
    cases = [(rule, SCALE_RULES[rule].elements[0], "randn") for rule in SCALE_RULES]
    cases += [(rule, "fp8_e4m3fn", kind) for kind in list(inputs)[1:] for rule in ("torchao_floor", "ocp")]

    def own_arithmetic(rule, elem, x):
        with implementation._rules_own_arithmetic():
            return block_quantize(x, elem, scale_rule=rule)

    fns = [lambda: fpemu.quantize(inputs["randn"], "fp8_e4m3fn")]
    for rule, elem, kind in cases:
        fns.append(lambda rule=rule, elem=elem, x=inputs[kind]: block_quantize(x, elem, scale_rule=rule))
        fns.append(lambda rule=rule, elem=elem, x=inputs[kind]: own_arithmetic(rule, elem, x))
    times = [seconds for seconds, _ in best_times_interleaved(fns, 3)]
    fp8 = times[0]
    return [{"rule": rule, "element": elem, "input": kind, "ms": fast * 1e3, "vs_fp8_quantize": fast / fp8,
             "own_arithmetic_ms": own * 1e3}
            for (rule, elem, kind), fast, own in zip(cases, times[1::2], times[2::2])]


def speed_rows(times: dict) -> list:
    block = times["fpemu_block_quantize_mxfp8"]
    return [{"implementation": name, "ms": seconds * 1e3, "vs_fp8_quantize": seconds / times["fpemu_fp8_quantize"],
             "vs_fpemu_block": seconds / block} for name, seconds in times.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=512, help="blocks per input kind (default 512)")
    parser.add_argument("--values", type=int, default=1 << 22, help="values in the speed test (default 4M)")
    args = parser.parse_args()
    sweep, departs, times = sweep_against_torchao(args.rows), departures_from_exact(args.rows), speed(args.values)
    by_rule = speed_by_rule(args.values)
    te_sweep, nvfp4, te_vs_torchao = (sweep_against_te_references(args.rows), nvfp4_departures(args.rows),
                                      te_against_torchao_nvfp4(args.rows))
    edges = ceil_scale_edges()
    result = {"sweep_vs_torchao": sweep, "departures_from_ocp": departs, "seconds": times, "values": args.values,
              "sweep_vs_te_references": te_sweep, "nvfp4_departures_from_exact": nvfp4,
              "te_nvfp4_vs_torchao": te_vs_torchao, "ceil_scale_edges": edges, "speed_by_rule": by_rule}
    notes = [f"Where each rule differs from the exact OCP rule (fp8_e4m3fn, {args.rows} blocks per kind; CEIL, EVEN, "
             "RCEIL and TE pick other scales by design, FLOOR differs only in byte-0 blocks): "
             + "; ".join(f"{d['rule']} {d['kind']}: {d['scale_differs']} scales, {d['values_differ']} values"
                         for d in departs if d["scale_differs"] or d["values_differ"]),
             f"Scales rounded up, against the exact ceil(log2(amax / 448)) on {edges['amaxes']:,} amaxes within 3 "
             f"ulps of 448 * 2**k: te_mxfp8 {edges['te_mxfp8']}, te_mxfp8_reference {edges['te_mxfp8_reference']} "
             f"(TE's round-up skips subnormal quotients <= 2**-127), torchao_rceil {edges['torchao_rceil']} (float32 "
             f"log2); the TE kernel and reference rows differ in {edges['te_mxfp8_vs_reference']}.",
             "A page per rule, fpemu against torchao, OCP and the exact result on the same probe blocks with "
             "example blocks: [recipes/README.md](recipes/README.md) (`python -m benchmarks.recipe_pages`)."]
    speed_notes = [f"{args.values:,} float32 values (standard normal, rows of 1024), MXFP8 with torchao's FLOOR "
                   "rule, best of 3, all taking turns. Goals (issue 15): fpemu's block quantize within 2x of its "
                   "own fp8 quantize of the same array, and far ahead of torchao's CPU path.",
                   "torchao's to_mx gives scales and element codes; to_dtype then gives the dequantized values "
                   "fpemu's result also holds. fpemu runs on one thread.", TIMING_NOTE]
    mismatch_columns = [("rule", "rule"), ("element", "element"), ("blocks", "blocks"), ("elements", "elements"),
                        ("scale_codes", "scale code mismatches"), ("element_codes", "element code mismatches"),
                        ("values", "value mismatches")]
    te_notes = (["TE's own Python code at d0067d0 (fpemu.adapters.te_block_reference): NVFP4QuantizerRef._quantize "
                 "(1 x 16 tiles, and 16 x 16 tiles with each 1 x 16 block the first row of a tile of zeros; no RHT; "
                 "values: TE's dequantize-kernel formula on its codes) and _mxfp8_2d_quantize_reference (each "
                 "1 x 32 block the first row of a 32 x 32 tile of zeros). NaN scale codes compare NaN-aware: the "
                 "reference's torch.min(scales, FLT_MAX) makes a NaN 0xFFFFFFFF in its vector loop (whole chunks "
                 "of 16 floats with AVX2) and the canonical NaN in its scalar tail, so a NaN scale is 0xFF or 0x7F "
                 "by its position and the CPU's vector width."]
                if te_sweep else ["TE's source is not available here (FPEMU_TE_SOURCE): not run."])
    sections = [
        ("fpemu vs Transformer Engine's Python references (CPU), mismatches", te_sweep, mismatch_columns, te_notes),
        ("NVFP4 departures from exact two-level arithmetic (float64, one rounding each)", nvfp4,
         [("rule", "rule"), ("kind", "kind"), ("blocks", "blocks"), ("scale_differs", "scale codes differ"),
          ("elements_differ", "element codes differ (non-zero scale)"),
          ("zero_scale_nonzero_codes", "scale-0 blocks with non-zero codes")],
         ["Exact: scale e4m3(amax_b * 2688 / (6 * amax_t)); elements x * 2688 / (amax_t * s) rounded once, s the "
          "rule's own scale. torchao clamps scales to >= 2**-6; TE keeps e4m3 subnormal and zero scales, and a "
          "zero scale's elements are x * FLT_MAX saturated to +-6 (they dequantize to 0)."]),
        ("TE NVFP4 kernel vs torchao two-level NVFP4 and TE's reference, same tensors", te_vs_torchao,
         [("kind", "kind"), ("blocks", "blocks"), ("scales_vs_torchao", "scales vs torchao"),
          ("of_which_te_below_2^-6", "of which TE's < 2**-6"), ("elements_vs_torchao", "elements vs torchao"),
          ("of_which_same_scale", "of which in same-scale blocks"), ("values_vs_torchao", "values vs torchao"),
          ("scales_vs_reference", "scales vs TE reference"), ("elements_vs_reference", "elements vs TE reference")],
         ["Values differ even where codes agree: TE dequantizes with fl32(fl32(s * amax) * fl32(1/2688)), torchao "
          "with t * s, t = fl32(amax / 2688). Finite probes and bf16: every scale difference is a TE scale "
          "below 2**-6 against torchao's clamp, and same-scale blocks get the same element codes; near e4m3 "
          "midpoints the rest are their roundings parting (torchao: fl32(fl32(amax / 6) / t)). zeros: torchao's tensor "
          "scale is 0 and its block scales 0 / 0 = NaN (TE: scale 0, S_enc 1). inf: torchao's tensor scale is "
          "inf and every scale NaN; TE's S_enc becomes 1 (2688 / inf = 0 -> 1), the block scales 448. nan: "
          "torchao's tensor scale is NaN; TE's kernel leaves NaN out of both amaxes (fmaxf), its reference "
          "propagates it (every scale NaN, every element code 0). The kernel and reference otherwise differ "
          "only where the reference's cast_to_fp4x2 gives -0.0 code 0 (the kernel's cvt keeps the sign: 0x8)."]),
        ("Speed", speed_rows(times), [("implementation", "implementation"), ("ms", "ms"),
                                      ("vs_fp8_quantize", "time / fpemu fp8 quantize"),
                                      ("vs_fpemu_block", "time / fpemu block quantize")], speed_notes),
        ("Speed by rule and input", by_rule,
         [("rule", "rule"), ("element", "element"), ("input", "input"), ("ms", "ms"),
          ("vs_fp8_quantize", "time / fpemu fp8 quantize"), ("own_arithmetic_ms", "ms, the rule's own arithmetic")],
         [f"{args.values:,} float32 values (rows of 1024), best of 3, all taking turns with fpemu's fp8 quantize of "
          "the randn array. The MX rules rounding to nearest even take the compiled pass (fpemu_mx_blocks: peak, "
          "scale, elements per block; RCEIL's float32-log2 scales computed in numpy first); microxcaling "
          "(ties away) and the NVFP4 rules compute in numpy. The last column is the same call by the rule's "
          "own arithmetic alone (x scaled, quantize, the code table: no short path), the reference the "
          "compiled pass is checked against (reports/exhaustive_blocks.md).", TIMING_NOTE]),
    ]
    write_report("blocks", "Block quantization: fpemu vs torchao 0.18.0 (CPU), mismatches",
                 result, sweep, mismatch_columns, notes, sections)


if __name__ == "__main__":
    main()
