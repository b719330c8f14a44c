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
    """Best-of-3 seconds of MXFP8 (torchao FLOOR) on n values: fpemu's block_quantize (scale codes,
    element codes and dequantized values), fpemu's plain fp8 and bf16 quantize of the same array, and
    torchao's CPU path giving the same three (to_mx, then to_dtype to dequantize) and to_mx alone, at
    torch's default thread count and at one thread (fpemu runs on one)."""
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32).reshape(-1, 1024)
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
    result = {"sweep_vs_torchao": sweep, "departures_from_ocp": departs, "seconds": times, "values": args.values}
    notes = [f"Where each rule differs from the exact OCP rule (fp8_e4m3fn, {args.rows} blocks per kind; CEIL, EVEN, "
             "RCEIL and TE pick other scales by design, FLOOR differs only in byte-0 blocks): "
             + "; ".join(f"{d['rule']} {d['kind']}: {d['scale_differs']} scales, {d['values_differ']} values"
                         for d in departs if d["scale_differs"] or d["values_differ"]),
             "A page per rule, fpemu against torchao, OCP and the exact result on the same probe blocks with "
             "example blocks: [recipes/README.md](recipes/README.md) (`python -m benchmarks.recipe_pages`)."]
    speed_notes = [f"{args.values:,} float32 values (standard normal, rows of 1024), MXFP8 with torchao's FLOOR "
                   "rule, best of 3, all taking turns. Goals (issue 15): fpemu's block quantize within 2x of its "
                   "own fp8 quantize of the same array, and far ahead of torchao's CPU path.",
                   "torchao's to_mx gives scales and element codes; to_dtype then gives the dequantized values "
                   "fpemu's result also holds. fpemu runs on one thread."]
    write_report("blocks", "Block quantization: fpemu vs torchao 0.18.0 (CPU), mismatches",
                 result, sweep, [("rule", "rule"), ("element", "element"), ("blocks", "blocks"),
                                 ("elements", "elements"), ("scale_codes", "scale code mismatches"),
                                 ("element_codes", "element code mismatches"), ("values", "value mismatches")], notes,
                 sections=[("Speed", speed_rows(times), [("implementation", "implementation"), ("ms", "ms"),
                                                         ("vs_fp8_quantize", "time / fpemu fp8 quantize"),
                                                         ("vs_fpemu_block", "time / fpemu block quantize")],
                            speed_notes)])


if __name__ == "__main__":
    main()
