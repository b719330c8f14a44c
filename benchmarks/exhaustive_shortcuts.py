"""Every float32 bit pattern through quantize's short paths and through the bit kernel they replace.

``fpemu.quantize`` takes a short path (``fpemu/formats/_shortcuts.py``) for some formats and
modes; this sweep runs all 2**32 float32 inputs through each numpy short path (or, ``--compiled``,
each compiled loop of ``_ckernels.c``, which quantize takes first where it was built) and through
the kernel (``_round_array``, which quantize ran before) for every case the path admits, and
compares the results bit for bit, any NaN equal to any NaN.  Goal: 0 mismatches.

``--shard K/N`` runs every N-th of 256 slices (2**24 inputs each) starting at K, so N processes
share the sweep; each writes reports/exhaustive/shortcuts-K-of-N.json and ``--merge --shards N``
folds them into reports/exhaustive_shortcuts.md (``--compiled``: compiled-K-of-N.json and
reports/exhaustive_compiled.md).

Run: python -m benchmarks.exhaustive_shortcuts --shard 0/2 & python -m benchmarks.exhaustive_shortcuts --shard 1/2
     python -m benchmarks.exhaustive_shortcuts --merge --shards 2
     python -m benchmarks.exhaustive_shortcuts --edges   (the binades around each format's range only)
"""

from __future__ import annotations

import argparse
import itertools
import json

import numpy as np

import fpemu
from benchmarks._common import REPORTS, atomic_write, write_report
from benchmarks.exhaustive_float32 import SLICE_BITS, SLICES
from fpemu.formats._shortcuts import _SHORTCUTS
from fpemu.formats.rounding import _round_array

SHARD_DIR = REPORTS / "exhaustive"


def cases(compiled: bool = False) -> list:
    """(path, format name, rounding, overflow, subnormals) for the cases the numpy short paths (or with
    ``compiled``, the compiled loops of _ckernels.c) admit, in nearest even (the fp32 path's other modes
    are the same code: a float32 input loses nothing in any mode).  Each case runs its path directly."""
    out = []
    for name in fpemu.format_names():
        fmt = fpemu.get_format(name)
        for path in _SHORTCUTS:
            if path.compiled != compiled or not path.admits(fmt):
                continue
            if len(path.roundings) > 1:
                # fp32's path: the default mode only (its kernel, widening to float64, is the
                # sweep's slowest part; the digests check the path's other modes)
                out.append((path, name, "nearest_even", "inf", True))
            else:
                for overflow, subnormals in itertools.product(fpemu.OVERFLOW_MODES, path.subnormals):
                    out.append((path, name, "nearest_even", overflow, subnormals))
    return out


def _key(case) -> str:
    return "/".join(str(part) for part in case[1:])


def _mismatches(case, x: np.ndarray) -> tuple:
    """(count, up to three example inputs) where the case's path and the bit kernel differ on x."""
    path, name, rounding, overflow, subnormals = case
    fmt = fpemu.get_format(name)
    with np.errstate(all="ignore"):
        short = path.run(x, fmt, overflow, subnormals)
        kernel = _round_array(x, fmt, rounding, overflow, subnormals, None, flags=False).values
    differ = (short.view(np.uint32) != kernel.view(np.uint32)) & ~(np.isnan(short) & np.isnan(kernel))
    return int(np.count_nonzero(differ)), [hex(v) for v in x[differ][:3].view(np.uint32).tolist()]


def sweep_slice(index: int, compiled: bool = False) -> dict:
    start = index << SLICE_BITS
    x = np.arange(start, start + (1 << SLICE_BITS), dtype=np.uint64).astype(np.uint32).view(np.float32)
    out = {}
    for case in cases(compiled):
        count, examples = _mismatches(case, x)
        out[_key(case)] = {"mismatches": count, "examples": examples}
    return out


def _stem(compiled: bool) -> str:
    return "compiled" if compiled else "shortcuts"


def run_shard(shard: int, shards: int, compiled: bool = False) -> None:
    totals = {_key(case): {"mismatches": 0, "examples": []} for case in cases(compiled)}
    slices = list(range(shard, SLICES, shards))
    for done, index in enumerate(slices, 1):
        for key, res in sweep_slice(index, compiled).items():
            totals[key]["mismatches"] += res["mismatches"]
            totals[key]["examples"] = (totals[key]["examples"] + res["examples"])[:5]
        print(f"shard {shard}/{shards}: slice {done}/{len(slices)}", flush=True)
        # written after every slice, so a sweep stopped early still says what it covered
        result = {"shard": shard, "shards": shards, "slices": slices[:done], "cases": totals}
        atomic_write(SHARD_DIR / f"{_stem(compiled)}-{shard}-of-{shards}.json", json.dumps(result, indent=2) + "\n")


def merge(shards: int, compiled: bool = False) -> dict:
    parts = [json.loads((SHARD_DIR / f"{_stem(compiled)}-{k}-of-{shards}.json").read_text()) for k in range(shards)]
    covered = sorted(i for part in parts for i in part["slices"])
    if covered != list(range(SLICES)):
        raise SystemExit(f"shards cover {len(covered)} of {SLICES} slices; run the missing ones first")
    rows = []
    for key in parts[0]["cases"]:
        name, rounding, overflow, subnormals = key.split("/")
        rows.append({"format": name, "rounding": rounding, "overflow": overflow, "subnormals": subnormals,
                     "inputs": 1 << 32, "mismatches": sum(p["cases"][key]["mismatches"] for p in parts),
                     "examples": sum((p["cases"][key]["examples"] for p in parts), [])[:5]})
    result = {"inputs_per_case": 1 << 32, "shards": shards, "rows": rows}
    columns = [("format", "format"), ("rounding", "rounding"), ("overflow", "overflow"),
               ("subnormals", "subnormals"), ("inputs", "float32 inputs"), ("mismatches", "mismatches")]
    which = ("the compiled loop (fpemu/formats/_ckernels.c)" if compiled
             else "quantize's numpy short path (what it runs without the compiled loops)")
    notes = [f"Every float32 bit pattern through {which} and through the bit kernel it replaces "
             "(_round_array, quantize's path before), NaN-aware bit comparison, in nearest "
             "even with each overflow and subnormals setting the path takes."]
    notes.append("Swept with the build this CPU loads (the AVX2 clone on x86-64 with AVX2); the baseline "
                 "clone is the same C, IEEE float operations only (no -ffast-math, no contraction), so the "
                 "same bits." if compiled else
                 "fp32 in the default mode only: its path's other settings and rounding modes are the same "
                 "code (a float32 input loses nothing in any mode), and the format digests "
                 "(tests/data/format_digests.json) check them all, stochastic rounding included, on 2**16 "
                 "patterns.")
    title = "Exhaustive float32 sweep of quantize's " + ("compiled loops" if compiled else "short paths")
    write_report(f"exhaustive_{_stem(compiled)}", title, result, rows, columns, notes)
    return result


def edge_fields(fmt) -> list:
    """float32 exponent fields around fmt's range: float32's subnormals, from three binades below
    fmt's least subnormal to three above its max finite, and the top (inf, NaN).  Below and above
    them every input rounds alike (to +-0, or past max), by the same passes.  A format as wide as
    float32 (tf32, bf16, e8m0) gets the lowest and highest eight binades and 2**-7 .. 2**8."""
    low, high = fmt.emin - fmt.mantissa_bits - 3 + 127, fmt.emax + 3 + 127
    if low < 8 or high > 247:
        return sorted({*range(0, 9), *range(120, 136), *range(247, 256)})
    return sorted({0, 1, 2, *range(low, high + 1), 200, 253, 254, 255})


_MANTISSAS = np.arange(1 << 23, dtype=np.uint32)


def binade(field: int, sign: int) -> np.ndarray:
    """Every float32 of one exponent field and sign: all 2**23 mantissas, in order."""
    return (_MANTISSAS | np.uint32((sign << 31) | (field << 23))).view(np.float32)


def run_edges() -> dict:
    """Every float32 pattern of every edge binade (both signs, all 2**23 mantissas) of each case."""
    rows = []
    for case in cases():
        _, name, rounding, overflow, subnormals = case
        fmt = fpemu.get_format(name)
        mismatches, examples, inputs = 0, [], 0
        for field in edge_fields(fmt):
            for sign in (0, 1):
                x = binade(field, sign)
                count, found = _mismatches(case, x)
                mismatches += count
                examples = (examples + found)[:5]
                inputs += x.size
        rows.append({"format": name, "rounding": rounding, "overflow": overflow, "subnormals": str(subnormals),
                     "binades": 2 * len(edge_fields(fmt)), "inputs": inputs, "mismatches": mismatches,
                     "examples": examples})
        print(rows[-1], flush=True)
    result = {"rows": rows}
    columns = [("format", "format"), ("rounding", "rounding"), ("overflow", "overflow"),
               ("subnormals", "subnormals"), ("binades", "float32 binades (both signs)"),
               ("inputs", "float32 inputs"), ("mismatches", "mismatches")]
    notes = ["Every float32 bit pattern of the binades around each format's range (float32's subnormals; "
             "three binades below the format's least subnormal to three above its max finite; 2^73, "
             "2^126, 2^127, inf/NaN; for the formats as wide as float32 the lowest and highest eight "
             "binades and 2^-7 .. 2^8; both signs, all 2^23 mantissas) through fpemu.quantize's short "
             "path and the bit kernel it replaces, NaN-aware. bf16 in the 'inf' mode is ml_dtypes' cast "
             "in quantize (the exhaustive_float32 sweep checks it). The full sweep (all 2^32 inputs) is "
             "`python -m benchmarks.exhaustive_shortcuts --shard K/N`."]
    write_report("exhaustive_shortcuts_edges", "Short paths against the kernel on every input of the edge binades",
                 result, rows, columns, notes)
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shard", default="0/1", help="K/N: run slices K, K+N, K+2N, ...")
    parser.add_argument("--merge", action="store_true", help="fold finished shards into the report")
    parser.add_argument("--shards", type=int, default=1, help="with --merge: how many shards ran")
    parser.add_argument("--edges", action="store_true",
                        help="only the binades around each format's range (reports/exhaustive_shortcuts_edges.md)")
    parser.add_argument("--compiled", action="store_true", help="the compiled loops (_ckernels.c) instead of "
                        "the numpy short paths (reports/exhaustive_compiled.md)")
    args = parser.parse_args(argv)
    if args.edges:
        run_edges()
        return
    if args.merge:
        merge(args.shards, args.compiled)
        return
    shard, shards = (int(v) for v in args.shard.split("/"))
    if not 0 <= shard < shards:
        parser.error(f"--shard {args.shard}: K must be in 0..N-1")
    run_shard(shard, shards, args.compiled)


if __name__ == "__main__":
    main()
