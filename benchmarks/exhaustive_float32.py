"""Every float32 bit pattern through fpemu's rounding kernel and the native casts.

For fp16 (numpy), bf16 and each fp8 format (ml_dtypes), all 2**32 float32
inputs are rounded by fpemu's bit kernel (never a native cast), both as
``quantize`` runs it and as ``round_to_format`` runs it (with overflow flags),
and by ``x.astype(dtype).astype(float32)``; results are compared bit for bit,
any NaN equal to any NaN.  Goal: 0 mismatches.

The 2**32 inputs are split into 256 slices of 2**24; ``--shard K/N`` runs
every N-th slice starting at K, so N processes (or machines) share the sweep.
Each shard writes reports/exhaustive/shard-K-of-N.json; ``--merge`` folds the
shards into reports/exhaustive_float32.md.

Run: python -m benchmarks.exhaustive_float32 --shard 0/2 & python -m benchmarks.exhaustive_float32 --shard 1/2
     python -m benchmarks.exhaustive_float32 --merge --shards 2
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

import fpemu
from benchmarks._common import REPORTS, atomic_write, write_report
from fpemu.formats import round_to_format
from fpemu.formats.rounding import _round_array

FORMATS = ["fp16", "bf16", "fp8_e4m3fn", "fp8_e5m2", "fp8_e4m3fnuz", "fp8_e5m2fnuz",
           "fp8_e4m3", "fp8_e3m4", "fp8_e4m3b11fnuz", "fp6_e2m3fn", "fp6_e3m2fn", "fp4_e2m1fn"]
SLICE_BITS = 24
SLICES = 1 << (32 - SLICE_BITS)
SHARD_DIR = REPORTS / "exhaustive"


def sweep_slice(index: int, names) -> dict:
    start = index << SLICE_BITS
    x = np.arange(start, start + (1 << SLICE_BITS), dtype=np.uint64).astype(np.uint32).view(np.float32)
    out = {}
    for name in names:
        fmt = fpemu.get_format(name)
        t0 = time.perf_counter()
        # quantize's kernel path (no overflow flags), as quantize runs it for every format
        # whose native cast it does not use
        ours = _round_array(x, fmt, "nearest_even", "inf", True, None, flags=False).values
        t1 = time.perf_counter()
        with np.errstate(over="ignore", invalid="ignore"):
            native = x.astype(fmt.dtype).astype(np.float32)
        t2 = time.perf_counter()
        flagged = round_to_format(x, fmt).values  # the same kernel with overflow flags
        differ = (ours.view(np.uint32) != native.view(np.uint32)) & ~(np.isnan(ours) & np.isnan(native))
        differ |= (flagged.view(np.uint32) != native.view(np.uint32)) & ~(np.isnan(flagged) & np.isnan(native))
        if not fmt.has_nan:  # NaN stays NaN in fpemu; ml_dtypes' formats without NaN make it -0
            differ &= ~np.isnan(x)
        examples = x[differ][:3].view(np.uint32).tolist()
        out[name] = {"mismatches": int(np.count_nonzero(differ)), "fpemu_s": t1 - t0,
                     "native_s": t2 - t1, "examples": [hex(v) for v in examples]}
    return out


def run_shard(shard: int, shards: int, names) -> None:
    totals = {name: {"mismatches": 0, "fpemu_s": 0.0, "native_s": 0.0, "examples": []} for name in names}
    slices = list(range(shard, SLICES, shards))
    for done, index in enumerate(slices, 1):
        for name, res in sweep_slice(index, names).items():
            total = totals[name]
            total["mismatches"] += res["mismatches"]
            total["fpemu_s"] += res["fpemu_s"]
            total["native_s"] += res["native_s"]
            total["examples"] = (total["examples"] + res["examples"])[:5]
        print(f"shard {shard}/{shards}: slice {done}/{len(slices)}", flush=True)
    result = {"shard": shard, "shards": shards, "slices": slices, "formats": totals}
    atomic_write(SHARD_DIR / f"shard-{shard}-of-{shards}.json", json.dumps(result, indent=2) + "\n")


def merge(shards: int) -> dict:
    parts = [json.loads((SHARD_DIR / f"shard-{k}-of-{shards}.json").read_text()) for k in range(shards)]
    covered = sorted(i for part in parts for i in part["slices"])
    if covered != list(range(SLICES)):
        raise SystemExit(f"shards cover {len(covered)} of {SLICES} slices; run the missing ones first")
    rows = []
    for name in parts[0]["formats"]:
        row = {"format": name, "inputs": 1 << 32,
               "mismatches": sum(p["formats"][name]["mismatches"] for p in parts),
               "fpemu_s": sum(p["formats"][name]["fpemu_s"] for p in parts),
               "native_s": sum(p["formats"][name]["native_s"] for p in parts),
               "examples": sum((p["formats"][name]["examples"] for p in parts), [])[:5]}
        row["fpemu_mvals"] = row["inputs"] / row["fpemu_s"] / 1e6
        rows.append(row)
    result = {"inputs_per_format": 1 << 32, "shards": shards, "rows": rows}
    columns = [("format", "format"), ("inputs", "float32 inputs"), ("mismatches", "mismatches"),
               ("fpemu_s", "fpemu kernel s"), ("native_s", "native cast s"),
               ("fpemu_mvals", "fpemu M values/s")]
    notes = ["Every float32 bit pattern, rounded by fpemu's bit kernel (both as quantize runs it and as "
             "round_to_format runs it, with overflow flags) and by the numpy/ml_dtypes cast (nearest even, "
             "IEEE overflow; NaN for fn/fnuz overflow); NaN-aware bit comparison. 'mismatches' counts inputs "
             "where either kernel path differs from the cast; the kernel time is quantize's path. For the "
             "formats without NaN (fp6, fp4) NaN inputs are left out: fpemu keeps them NaN, ml_dtypes makes "
             "them -0.",
             f"Times are summed over {shards} shards (CPU seconds of each process)."]
    write_report("exhaustive_float32", "Exhaustive float32 sweep", result, rows, columns, notes)
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shard", default="0/1", help="K/N: run slices K, K+N, K+2N, ...")
    parser.add_argument("--formats", nargs="+", default=FORMATS)
    parser.add_argument("--merge", action="store_true", help="fold finished shards into the report")
    parser.add_argument("--shards", type=int, default=1, help="with --merge: how many shards ran")
    args = parser.parse_args(argv)
    if args.merge:
        merge(args.shards)
        return
    shard, shards = (int(v) for v in args.shard.split("/"))
    if not 0 <= shard < shards:
        parser.error(f"--shard {args.shard}: K must be in 0..N-1")
    run_shard(shard, shards, args.formats)


if __name__ == "__main__":
    main()
