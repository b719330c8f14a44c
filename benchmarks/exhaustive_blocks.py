"""Block quantization's compiled pass against each rule's own arithmetic on every float32 pattern of edge binades.

``fpemu_mx_blocks`` (fpemu/formats/_ckernels.c) computes each MX block's e8m0 scale code with C twins of
quantize.py's numpy rules (or takes the codes numpy computed, for the float32-log2 rules) and rounds the
elements in C; the blocks it does not take go to the numpy arithmetic.  Two sweeps, each compared
(scale codes, scales, element codes, values, byte for byte) against ``block_quantize`` by the rule's
own arithmetic alone (x scaled as the rule scales it, quantize, the code table; no short path):

- peaks: each positive float32 pattern (all 2**23 mantissas) of the binades where the rule's scale
  code meets the compiled pass's bounds (the lowest code it takes, the peak bound) and of 1's binade,
  as one-value blocks, for every rule the pass takes and each of its element formats;
- elements: each pattern x of every binade from three below the element's least subnormal to its max,
  at three scales (the lowest the pass takes, 2**0, the highest under the peak bound), as the block
  [x, peak], peak the largest float32 of the scale's top binade, for each element format (rules
  ``ocp`` and ``te_mxfp8``: an exact and a reciprocal application).

Goal: 0 mismatches.  Run: python -m benchmarks.exhaustive_blocks; or in shards, each row (rule x element
x sweep) taken by one: python -m benchmarks.exhaustive_blocks --shard 0/2 & ... --shard 1/2, each writing
reports/exhaustive/blocks-K-of-N.json, then python -m benchmarks.exhaustive_blocks --merge 2 writes the
report the unsharded run writes.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

import fpemu
import fpemu.blocks.quantize as implementation
from benchmarks._common import REPORTS, write_report
from benchmarks.exhaustive_shortcuts import binade
from fpemu.blocks import SCALE_RULES, block_quantize
from fpemu.fileio import atomic_write

_FIELDS = ("scale_codes", "scales", "element_codes", "values")
SHARD_DIR = REPORTS / "exhaustive"


def _mismatches(x: np.ndarray, elem: str, rule: str) -> int:
    """Blocks that differ in any field between the compiled pass and the rule's own arithmetic."""
    compiled = block_quantize(x, elem, block_size=x.shape[1], scale_rule=rule)
    with implementation._rules_own_arithmetic():
        reference = block_quantize(x, elem, block_size=x.shape[1], scale_rule=rule)
    differ = np.zeros(x.shape[0], bool)
    for field in _FIELDS:  # (bytes: NaN payloads must agree too)
        ours, theirs = (getattr(q, field).view(np.uint8).reshape(x.shape[0], -1) for q in (compiled, reference))
        differ |= (ours != theirs).any(axis=1)
    return int(np.count_nonzero(differ))


def peak_fields(fmt) -> list:
    """The exponent fields where a scale code meets the compiled pass's bounds: the lowest code it takes
    (code = bias, amax about 2**(bias - 127 + emax)), the peak bound 2**(104 + m), and 1's."""
    lowest = fmt.bias + fmt.emax
    bound = implementation._peak_bound(fmt) >> 23
    return sorted({*range(max(1, lowest - 2), lowest + 3), *range(bound - 2, bound + 1), 127})


def peak_row(name: str, elem: str) -> dict:
    fmt = fpemu.get_format(elem)
    fields = peak_fields(fmt)
    mismatches = sum(_mismatches(binade(field, 0)[:, None], elem, name) for field in fields)
    return {"sweep": "peaks", "rule": name, "element": elem, "binades": len(fields), "inputs": len(fields) << 23,
            "mismatches": mismatches}


def element_row(name: str, elem: str) -> dict:
    fmt = fpemu.get_format(elem)
    bound = implementation._peak_bound(fmt) >> 23
    # the scale's top binade is 127 + X + emax; X from the lowest code the pass takes to the bound's
    scales = (fmt.bias - 127, 0, bound - 1 - 127 - fmt.emax)
    inputs = mismatches = 0
    for exponent in scales:
        top = 127 + exponent + fmt.emax
        peak = np.uint32((top << 23) | 0x7FFFFF).view(np.float32)
        for field in range(max(0, top - fmt.emax + fmt.emin - fmt.mantissa_bits - 3), top + 1):
            for sign in (0, 1):
                x = binade(field, sign)
                blocks = np.stack([x, np.full_like(x, peak)], axis=1)
                mismatches += _mismatches(blocks, elem, name)
                inputs += x.size
    return {"sweep": "elements", "rule": name, "element": elem, "binades": inputs >> 23, "inputs": inputs,
            "mismatches": mismatches}


def rows_to_sweep() -> list:
    """(sweep, rule, element) of every row of the report, in its order: the peaks of each rule the pass
    takes (e8m0 scales, nearest even) and element format, then the elements of ocp's and te_mxfp8's."""
    peaks = [("peaks", name, elem) for name, rule in SCALE_RULES.items()
             if rule.scale_format == "e8m0" and rule.rounding == "nearest_even" for elem in rule.elements]
    return peaks + [("elements", name, elem) for name in ("ocp", "te_mxfp8") for elem in SCALE_RULES[name].elements]


def sweep(key: tuple) -> dict:
    kind, name, elem = key
    row = (peak_row if kind == "peaks" else element_row)(name, elem)
    print(row, flush=True)
    return row


def _shard_path(shard: int, shards: int):
    return SHARD_DIR / f"blocks-{shard}-of-{shards}.json"


def run_shard(shard: int, shards: int) -> None:
    """Rows shard, shard + shards, ... into reports/exhaustive/blocks-K-of-N.json, rewritten after each row."""
    keys = rows_to_sweep()
    done = {}
    for index in range(shard, len(keys), shards):
        done[index] = sweep(keys[index])
        atomic_write(_shard_path(shard, shards), json.dumps(
            {"shard": shard, "shards": shards, "rows": {str(i): row for i, row in done.items()}}, indent=2) + "\n")


def merged_rows(shards: int) -> list:
    """Every row from the shard files of N = ``shards``, in the report's order; a row no shard holds, or a
    row of another sweep (a changed rule table), ends the merge naming it."""
    keys, rows = rows_to_sweep(), {}
    for shard in range(shards):
        path = _shard_path(shard, shards)
        if not path.exists():
            raise SystemExit(f"{path}: missing; run --shard {shard}/{shards} first")
        rows.update({int(i): row for i, row in json.loads(path.read_text())["rows"].items()})
    for index, key in enumerate(keys):
        if index not in rows:
            raise SystemExit(f"row {index} ({'/'.join(key)}) is in no shard of {shards}; rerun its shard")
        if (rows[index]["sweep"], rows[index]["rule"], rows[index]["element"]) != key:
            raise SystemExit(f"row {index} of the shards is {rows[index]['rule']}/{rows[index]['element']}, the "
                             f"sweep's is {'/'.join(key)}: the shards are of another version; rerun them")
    return [rows[index] for index in range(len(keys))]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shard", metavar="K/N", help="sweep rows K, K+N, ... only, into reports/exhaustive/")
    parser.add_argument("--merge", type=int, metavar="N", help="write the report from the N shards' files")
    args = parser.parse_args(argv)
    if implementation.KERNELS is None and args.merge is None:
        raise SystemExit("fpemu's compiled loops were not built here (or FPEMU_COMPILED=0): nothing to compare")
    if args.shard is not None:
        shard, _, shards = args.shard.partition("/")
        if not (shard.isdigit() and shards.isdigit() and int(shard) < int(shards)):
            parser.error(f"--shard {args.shard}: expected K/N with 0 <= K < N")
        run_shard(int(shard), int(shards))
        return
    rows = merged_rows(args.merge) if args.merge is not None else [sweep(key) for key in rows_to_sweep()]
    columns = [("sweep", "sweep"), ("rule", "rule"), ("element", "element"), ("binades", "float32 binades"),
               ("inputs", "float32 inputs"), ("mismatches", "mismatches")]
    notes = ["block_quantize with fpemu's compiled loops (fpemu_mx_blocks: peak, scale code and elements in one "
             "pass) against the same call by the rule's own arithmetic alone (quantize.py's numpy: x scaled as "
             "the rule scales it, quantize, the code table), all four outputs byte for byte (NaN payloads too); "
             "a mismatch is a block differing in any of them.",
             "peaks: every positive pattern of the binades where the scale rules meet the pass's bounds, as "
             "one-value blocks (the value is the block's peak and its only element). elements: every pattern of "
             "every binade from three below the element's least subnormal to its max, each in a block with a "
             "fixed peak, at the lowest scale the pass takes, at 2**0 and at the highest below the peak bound.",
             "Swept with the build this CPU loads (the AVX2 clone on x86-64 with AVX2)."]
    write_report("exhaustive_blocks", "Block quantization's compiled pass against each rule's own arithmetic",
                 {"rows": rows}, rows, columns, notes)


if __name__ == "__main__":
    main()
