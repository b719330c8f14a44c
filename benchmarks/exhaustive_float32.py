"""Every float32 bit pattern through fpemu's rounding kernel and the native casts.

For fp16 (numpy), bf16 and each fp8, fp6 and fp4 format (ml_dtypes), all 2**32 float32
inputs are rounded by fpemu, both as ``quantize`` runs it (its short path,
``fpemu/formats/_shortcuts.py``, where it has one, else the bit kernel without overflow
flags; bf16: the leading-bits short path, which quantize takes when saturating, never a native
cast) and as ``round_to_format`` runs it (the kernel, with overflow flags), and by
``x.astype(dtype).astype(float32)``; results are compared bit for bit, any NaN equal to any
NaN.  Goal: 0 mismatches.

e8m0 runs against two peers in the same sweep, ml_dtypes' float8_e8m0fnu and torch's
float8_e8m0fnu cast.
Both peers compute some inputs differently by design; :data:`DEPARTURES` names those inputs and
why, and the sweep counts them apart from the mismatches, whose goal stays 0.

The 2**32 inputs are split into 256 slices of 2**24; ``--shard K/N`` runs
every N-th slice starting at K, so N processes (or machines) share the sweep.
Each shard writes reports/exhaustive/shard-K-of-N.json, with the peers' package versions; ``--merge``
folds the shards into reports/exhaustive_float32.md (a format swept later on its own, with
``--formats`` and another N, is taken from its own shard set).

Run: python -m benchmarks.exhaustive_float32 --shard 0/2 & python -m benchmarks.exhaustive_float32 --shard 1/2
     python -m benchmarks.exhaustive_float32 --merge
     python -m benchmarks.exhaustive_float32 --shard 0/1 --formats e8m0 && python -m benchmarks.exhaustive_float32 --merge
"""

from __future__ import annotations

import argparse
import json
import time

import ml_dtypes
import numpy as np
from packaging.version import Version

import fpemu
from benchmarks._common import REPORTS, atomic_write, write_report
from fpemu.formats import round_to_format
from fpemu.formats._shortcuts import shortcut
from fpemu.formats.rounding import _round_array

FORMATS = ["fp16", "bf16", "fp8_e4m3fn", "fp8_e5m2", "fp8_e4m3fnuz", "fp8_e5m2fnuz",
           "fp8_e4m3", "fp8_e3m4", "fp8_e4m3b11fnuz", "fp6_e2m3fn", "fp6_e3m2fn", "fp4_e2m1fn", "e8m0"]
SLICE_BITS = 24
SLICES = 1 << (32 - SLICE_BITS)
SHARD_DIR = REPORTS / "exhaustive"


def _native_cast(x: np.ndarray, fmt) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return x.astype(fmt.dtype).astype(np.float32)


def _torch_e8m0_cast(x: np.ndarray, fmt) -> np.ndarray:
    import torch
    return torch.from_numpy(x).to(torch.float8_e8m0fnu).to(torch.float32).numpy()


def _e8m0_subnormals_up(x):
    return (x > 2.0**-127) & (x < 1.5 * 2.0**-127)


def _none(x):
    return np.zeros(x.shape, bool)


# ml_dtypes 0.7.0 rounds these subnormals to nearest, as fpemu; earlier releases send them up.
_ML_DTYPES_E8M0_UP = _e8m0_subnormals_up if Version(ml_dtypes.__version__) < Version("0.7.0") else _none


# Peers per format: label, the peer's rounding of a float32 array to float32 values.
PEERS = {"e8m0": (("ml_dtypes", _native_cast), ("torch", _torch_e8m0_cast))}
# Inputs a peer computes differently by design: (format, peer) -> (inputs, why).
DEPARTURES = {
    ("e8m0", "ml_dtypes"): (_ML_DTYPES_E8M0_UP, "before ml_dtypes 0.7.0, float32 subnormals in (2^-127, 1.5 * 2^-127) go "
                            "up to 2^-126, not to the nearer 2^-127 (0.7.0 rounds them to nearest, as fpemu: none)"),
    ("e8m0", "torch"): (lambda x: _e8m0_subnormals_up(np.abs(x)) | (x <= 0),
                        "the same subnormals go up to 2^-126; 0 and -0 become code 0 (2^-127) and x < 0 "
                        "the code of |x|, where e8m0 has no code (fpemu: NaN)"),
    # (formats without NaN: fpemu keeps NaN NaN, ml_dtypes makes it -0)
    **{(name, "ml_dtypes"): (np.isnan, "NaN: fpemu keeps it NaN (the format cannot encode it), "
                                       "ml_dtypes makes it -0")
       for name in ("fp6_e2m3fn", "fp6_e3m2fn", "fp4_e2m1fn")},
}


def _differ(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a.view(np.uint32) != b.view(np.uint32)) & ~(np.isnan(a) & np.isnan(b))


def sweep_slice(index: int, names) -> dict:
    start = index << SLICE_BITS
    x = np.arange(start, start + (1 << SLICE_BITS), dtype=np.uint64).astype(np.uint32).view(np.float32)
    out = {}
    for name in names:
        fmt = fpemu.get_format(name)
        t0 = time.perf_counter()
        # quantize's path: its short path where it has one, else the kernel without overflow flags
        # (bf16: the leading-bits path, never the native cast quantize would use)
        ours = shortcut(x, fmt, "nearest_even", "inf", True)
        if ours is None:
            ours = _round_array(x, fmt, "nearest_even", "inf", True, None, flags=False).values
        t1 = time.perf_counter()
        flagged = round_to_format(x, fmt).values  # the kernel with overflow flags
        peers = {}
        for label, cast in PEERS.get(name, (("ml_dtypes" if fmt.dtype != np.float16 else "numpy", _native_cast),)):
            t2 = time.perf_counter()
            theirs = cast(x, fmt)
            t3 = time.perf_counter()
            differ = _differ(ours, theirs) | _differ(flagged, theirs)
            known, _ = DEPARTURES.get((name, label), (_none, ""))
            departs = known(x)
            unexplained = differ & ~departs
            peers[label] = {"mismatches": int(np.count_nonzero(unexplained)),
                            "departures": int(np.count_nonzero(differ & departs)), "native_s": t3 - t2,
                            "examples": [hex(v) for v in x[unexplained][:3].view(np.uint32).tolist()]}
        out[name] = {"fpemu_s": t1 - t0, "peers": peers}
    return out


def run_shard(shard: int, shards: int, names) -> None:
    totals = {name: {"fpemu_s": 0.0, "peers": {}} for name in names}
    slices = list(range(shard, SLICES, shards))
    for done, index in enumerate(slices, 1):
        for name, res in sweep_slice(index, names).items():
            total = totals[name]
            total["fpemu_s"] += res["fpemu_s"]
            for label, peer in res["peers"].items():
                into = total["peers"].setdefault(label, {"mismatches": 0, "departures": 0, "native_s": 0.0,
                                                         "examples": []})
                for key in ("mismatches", "departures", "native_s"):
                    into[key] += peer[key]
                into["examples"] = (into["examples"] + peer["examples"])[:5]
        print(f"shard {shard}/{shards}: slice {done}/{len(slices)}", flush=True)
    result = {"shard": shard, "shards": shards, "slices": slices, "formats": totals, "versions": _versions()}
    atomic_write(SHARD_DIR / f"shard-{shard}-of-{shards}.json", json.dumps(result, indent=2) + "\n")


def _versions() -> dict:
    """The versions of the packages the peers' casts come from (torch where it is installed)."""
    versions = {"numpy": np.__version__, "ml_dtypes": ml_dtypes.__version__}
    try:
        import torch
    except ImportError:
        return versions
    return versions | {"torch": torch.__version__}


def _versions_note(parts_by_format: dict) -> str:
    """Which package versions each format's shards were measured with (shards written before the
    sweep recorded them: not recorded)."""
    measured = {}
    for name, parts in parts_by_format.items():
        for part in parts:
            found = part.get("versions")
            key = (", ".join(f"{k} {v}" for k, v in sorted(found.items())) if found
                   else "not recorded (shards written before the sweep recorded them)")
            measured.setdefault(key, []).append(name)
    return "Peers' package versions, from the shards: " + "; ".join(
        f"{', '.join(dict.fromkeys(names))}: {key}" for key, names in measured.items())


def _peers(entry: dict) -> dict:
    """A shard's per-peer results for one format (shards written before the peers were named held
    one peer, the native cast, at the top level)."""
    if "peers" in entry:
        return entry["peers"]
    return {"native": {key: entry[key] for key in ("mismatches", "native_s", "examples")} | {"departures": 0}}


def _covering(sets: dict, name: str) -> list:
    """The shards of the first set (by shard count) whose slices for format ``name`` cover the sweep."""
    for _, parts in sorted(sets.items()):
        parts = [p for p in parts if name in p["formats"]]
        if sorted(i for p in parts for i in p["slices"]) == list(range(SLICES)):
            return parts
    raise SystemExit(f"{name}: no shard set covers all {SLICES} slices; run the missing ones first")


def merge() -> dict:
    """Fold the shard files into the report, each format from a shard set (shard-K-of-N, the N it
    was run with) that covers all slices, so a format added later is swept on its own."""
    sets = {}
    for path in sorted(SHARD_DIR.glob("shard-*-of-*.json")):
        part = json.loads(path.read_text())
        sets.setdefault(part["shards"], []).append(part)
    rows = []
    names = list(dict.fromkeys(name for _, parts in sorted(sets.items()) for p in parts for name in p["formats"]))
    names.sort(key=lambda name: FORMATS.index(name) if name in FORMATS else len(FORMATS))
    covering = {name: _covering(sets, name) for name in names}
    for name, parts in covering.items():
        labels = list(dict.fromkeys(label for p in parts for label in _peers(p["formats"][name])))
        fpemu_s = sum(p["formats"][name]["fpemu_s"] for p in parts)
        for label in labels:
            peer = [_peers(p["formats"][name])[label] for p in parts]
            row = {"format": name, "peer": label, "inputs": 1 << 32,
                   "mismatches": sum(q["mismatches"] for q in peer),
                   "departures": sum(q["departures"] for q in peer),
                   "fpemu_s": fpemu_s, "native_s": sum(q["native_s"] for q in peer),
                   "examples": sum((q["examples"] for q in peer), [])[:5]}
            row["fpemu_mvals"] = row["inputs"] / row["fpemu_s"] / 1e6
            rows.append(row)
    result = {"inputs_per_format": 1 << 32, "rows": rows,
              "departures": {f"{name}/{label}": why for (name, label), (_, why) in DEPARTURES.items()}}
    columns = [("format", "format"), ("peer", "peer"), ("inputs", "float32 inputs"), ("mismatches", "mismatches"),
               ("departures", "known departures"), ("fpemu_s", "fpemu s"), ("native_s", "peer cast s"),
               ("fpemu_mvals", "fpemu M values/s")]
    notes = ["Every float32 bit pattern, rounded by fpemu (quantize's path: its short path where it has "
             "one, else the bit kernel; and round_to_format's kernel with overflow flags) and by the "
             "peer's cast (nearest even, IEEE overflow; NaN for fn/fnuz overflow); NaN-aware bit comparison. "
             "'mismatches' counts inputs where either fpemu path differs from the peer outside the known "
             "departures; 'known departures' the inputs where the peer computes differently by design:",
             *(f"{name} vs {label}: {why}" for (name, label), (_, why) in DEPARTURES.items()),
             "'native' is the numpy/ml_dtypes cast in sweeps run before the peers were named, and before "
             "quantize had short paths (their 'fpemu' is the kernel alone).",
             "Times are summed over the shards (CPU seconds of each process).", _versions_note(covering)]
    write_report("exhaustive_float32", "Exhaustive float32 sweep", result, rows, columns, notes)
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shard", default="0/1", help="K/N: run slices K, K+N, K+2N, ...")
    parser.add_argument("--formats", nargs="+", default=FORMATS)
    parser.add_argument("--merge", action="store_true", help="fold finished shards into the report")
    args = parser.parse_args(argv)
    if args.merge:
        merge()
        return
    shard, shards = (int(v) for v in args.shard.split("/"))
    if not 0 <= shard < shards:
        parser.error(f"--shard {args.shard}: K must be in 0..N-1")
    run_shard(shard, shards, args.formats)


if __name__ == "__main__":
    main()
