"""Block quantization: fpemu against torchao 0.18 on a larger sweep, each rule's departures from the
exact OCP rule, and speed (4M values to MXFP8 against fpemu's own fp8 quantize and torchao's CPU path).

Writes reports/blocks.md and reports/blocks.json.  Run: python -m benchmarks.bench_blocks [--rows N]
"""

from __future__ import annotations

import argparse

import numpy as np

import fpemu
from benchmarks._common import best_times_interleaved, write_report
from fpemu.blocks import SCALE_RULES, block_quantize
from fpemu.blocks.probes import PROBE_KINDS, probe_blocks

TORCHAO_RULES = ["torchao_floor", "torchao_ceil", "torchao_even", "torchao_rceil", "torchao_nvfp4",
                 "torchao_nvfp4_2level"]


def _same(a, b) -> np.ndarray:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return (a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))


def sweep_against_torchao(rows: int) -> list:
    from fpemu.adapters.torchao_blocks import torchao_block_quantize
    out = []
    for rule in TORCHAO_RULES:
        for elem in SCALE_RULES[rule].elements:
            total = {"rule": rule, "element": elem, "scale_codes": 0, "element_codes": 0, "values": 0,
                     "blocks": 0, "elements": 0}
            for seed, kind in enumerate(PROBE_KINDS):
                x = probe_blocks(kind, elem, rows=rows, block_size=32, seed=100 + seed)
                ours, theirs = block_quantize(x, elem, scale_rule=rule), torchao_block_quantize(x, elem, rule)
                total["scale_codes"] += int(np.count_nonzero(ours.scale_codes != theirs.scale_codes))
                total["element_codes"] += int(np.count_nonzero(ours.element_codes != theirs.element_codes))
                total["values"] += int(np.count_nonzero(~_same(ours.values, theirs.values)))
                total["blocks"] += ours.scale_codes.size
                total["elements"] += x.size
            out.append(total)
    return out


def departures_from_exact(rows: int) -> list:
    """Blocks whose scale code, and elements whose dequantized value, differ from the exact OCP rule."""
    out = []
    for rule in ("torchao_floor", "torchao_ceil", "torchao_even", "torchao_rceil", "te_mxfp8", "microxcaling"):
        for kind in ("random", "wide", "edges", "tiny"):
            x = probe_blocks(kind, "fp8_e4m3fn", rows=rows, block_size=32, seed=7)
            exact, other = block_quantize(x, "fp8_e4m3fn", scale_rule="ocp"), block_quantize(x, "fp8_e4m3fn", scale_rule=rule)
            out.append({"rule": rule, "kind": kind, "blocks": exact.scale_codes.size,
                        "scale_differs": int(np.count_nonzero(exact.scale_codes != other.scale_codes)),
                        "values_differ": int(np.count_nonzero(~_same(exact.values, other.values)))})
    return out


def speed(n: int) -> dict:
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32).reshape(-1, 1024)
    fns = [lambda: block_quantize(x, "fp8_e4m3fn", scale_rule="torchao_floor"),
           lambda: fpemu.quantize(x, "fp8_e4m3fn"),
           lambda: fpemu.quantize(x, "bf16")]
    names = ["mxfp8_torchao_floor", "fpemu_fp8_quantize", "fpemu_bf16_quantize"]
    try:
        from fpemu.adapters.torchao_blocks import torchao_block_quantize
        fns.append(lambda: torchao_block_quantize(x, "fp8_e4m3fn", "torchao_floor"))
        names.append("torchao_to_mx_cpu")
    except ImportError:
        pass
    times = best_times_interleaved(fns, 3)
    return {name: seconds for name, (seconds, _) in zip(names, times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=512, help="blocks per input kind (default 512)")
    parser.add_argument("--values", type=int, default=1 << 22, help="values in the speed test (default 4M)")
    args = parser.parse_args()
    sweep, departs, times = sweep_against_torchao(args.rows), departures_from_exact(args.rows), speed(args.values)
    result = {"sweep_vs_torchao": sweep, "departures_from_ocp": departs, "seconds": times, "values": args.values}
    notes = [f"Where each rule differs from the exact OCP rule (fp8_e4m3fn, {args.rows} blocks per kind; CEIL, EVEN, "
             "RCEIL and TE pick other scales by design, FLOOR differs only in byte-0 blocks): "
             + "; ".join(f"{d['rule']} {d['kind']}: {d['scale_differs']} scales, {d['values_differ']} values"
                         for d in departs if d["scale_differs"] or d["values_differ"]),
             "Speed on " + f"{args.values:,} float32 values (best of 3, s): "
             + ", ".join(f"{k} {v:.3f}" for k, v in times.items()),
             "Timings were measured on a shared machine; rerun on a quiet one.",
             "A page per rule, fpemu against torchao, OCP and the exact result on the same probe blocks with "
             "example blocks: [recipes/README.md](recipes/README.md) (`python -m benchmarks.recipe_pages`)."]
    write_report("blocks", "Block quantization: fpemu vs torchao 0.18.0 (CPU), mismatches",
                 result, sweep, [("rule", "rule"), ("element", "element"), ("blocks", "blocks"),
                                 ("elements", "elements"), ("scale_codes", "scale code mismatches"),
                                 ("element_codes", "element code mismatches"), ("values", "value mismatches")], notes)


if __name__ == "__main__":
    main()
