"""Shards merged vs one run: a version matrix of 4 jax releases in 2 shards, and `fpemu run` in 2 shards.

Each command runs as its own process (`python -m fpemu ...`, as on separate machines): the unsharded
command, then shard 1/2 and shard 2/2 into another folder, then the merge; every file the merge wrote is
compared, byte for byte, with the unsharded command's.  The matrix environments are built by the first
command (pip or uv, cached) and reused by the shards, as on a shared cache; each row says whether its
environments were already built.

Writes reports/bench_shards.md and .json.  Run: python -m benchmarks.bench_shards [--jax V1,V2,V3,V4]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import shutil
import tempfile

from benchmarks._common import ROOT, TIMING_NOTE, run_fpemu, tree_digests, write_report

MATRIX_SPECS = ("specs/step_bf16_jax_default.toml", "specs/step_fp16_jax_default.toml")
RUN_SPECS = ("seed_example_1", "floor_jmp", "floor_torch", "timing_flax", "static_scale", "bernoulli_torch",
             "ranks_ddp_grad_scaler", "model_fp16_linear_settle")


def _fpemu(*args, cwd=ROOT) -> tuple:
    return run_fpemu(*args, cwd=cwd, env={"FPEMU_SHARD": ""})  # the shard is the command line's alone


def _compare(what: str, whole: pathlib.Path, merged: pathlib.Path, timings: list) -> dict:
    a, b = tree_digests(whole, skip=("shards",)), tree_digests(merged, skip=("shards",))
    differ = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    return {"what": what, "files": len(a), "identical": "yes" if not differ else f"NO: {', '.join(differ[:5])}",
            **{key: round(value, 1) for key, value in timings}}


def matrix_row(versions: str, folder: pathlib.Path) -> dict:
    from fpemu import environments
    from fpemu.harness.matrix import plan_from_options
    plan = plan_from_options("shards_jax", [ROOT / s for s in MATRIX_SPECS], {"jax": versions},
                             ("numpy==2.4.6", "ml_dtypes==0.6.0"), ("jax_step",))
    built = sum(environments.environment_python(f"matrix-{s.slug}", s.requirements) is not None for s in plan.sets)
    common = ["matrix", "--name", "shards_jax", "--specs", *MATRIX_SPECS, "--jax", versions, "--impl", "jax_step",
              "--with", "numpy==2.4.6", "ml_dtypes==0.6.0", "--quiet"]
    whole, _ = _fpemu(*common, "--reports", folder / "whole", "--traces", folder / "whole-traces")
    shards = [_fpemu(*common, "--shard", f"{i}/2", "--traces", folder / "split-traces")[0] for i in (1, 2)]
    merge, _ = _fpemu(*common, "--merge", "--reports", folder / "split", "--traces", folder / "split-traces")
    row = _compare(f"`fpemu matrix`: {len(plan.sets)} jax releases ({versions.replace(',', ', ')}) x "
                   f"{len(MATRIX_SPECS)} step specs, 2 shards", folder / "whole", folder / "split",
                   [("unsharded_s", whole), ("shard_1_s", shards[0]), ("shard_2_s", shards[1]), ("merge_s", merge)])
    from fpemu.harness.shards import Shard, matrix_shard_sets
    taken = ["; ".join(f"shard {i}/2: " + ", ".join(v.label for v in matrix_shard_sets(plan, Shard(i, 2)))
                       for i in (1, 2))]
    row["what"] += f" ({taken[0]})"
    row["environments"] = f"{built} of {len(plan.sets)} built before (the unsharded run built the others)"
    return row


def run_row(folder: pathlib.Path) -> dict:
    specs = folder / "run" / "specs"
    specs.mkdir(parents=True)
    for name in RUN_SPECS:
        shutil.copy(ROOT / "specs" / f"{name}.toml", specs)
    cwd = folder / "run"
    whole, _ = _fpemu("run", "--reports", "whole", "--quiet", "--allow-skips", cwd=cwd)
    shards = [_fpemu("run", "--reports", "split", "--shard", f"{i}/2", "--quiet", "--allow-skips", cwd=cwd)[0]
              for i in (1, 2)]
    merge, _ = _fpemu("merge", "--reports", "split", "--quiet", "--allow-skips", cwd=cwd)
    return {**_compare(f"`fpemu run`: {len(RUN_SPECS)} specs of specs/ (a [ranks] one among them), 2 shards",
                       cwd / "whole", cwd / "split",
                       [("unsharded_s", whole), ("shard_1_s", shards[0]), ("shard_2_s", shards[1]),
                        ("merge_s", merge)]), "environments": "-"}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jax", default="0.4.31,0.4.33,0.4.35,0.5.3", help="the releases of the matrix (4)")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="fpemu-bench-shards-") as tmp:
        rows = [matrix_row(args.jax, pathlib.Path(tmp)), run_row(pathlib.Path(tmp))]
    result = {"rows": rows, "python": platform.python_version(), "cpus": os.cpu_count(),
              "load_average_1min_before": round(load_before, 1)}
    columns = [("what", "what"), ("identical", "merged = unsharded, byte for byte"), ("files", "files compared"),
               ("unsharded_s", "unsharded s"), ("shard_1_s", "shard 1/2 s"), ("shard_2_s", "shard 2/2 s"),
               ("merge_s", "merge s"), ("environments", "matrix environments")]
    notes = ["Every file under the merged `--reports` (less `shards/`) against the unsharded command's: the "
             "matrix's `upgrades.md`, `upgrades/shards_jax.json`, its plot and the index; the run's goldens, "
             "observed and per-rank traces, `diff.json`, `harness.md`, `ranks.md`, plots and index.",
             "Each command is a process of its own, as on separate machines; the shards ran one after the other "
             "here (2 cores), so their times add up; on two machines a shard's time is the wall time.",
             f"One run on {os.cpu_count()} CPUs with a 1-minute load average of {load_before:.1f} when it started. "
             + TIMING_NOTE]
    write_report("bench_shards", "Shards merged vs one run (fpemu matrix, fpemu run)", result, rows, columns, notes)
    return result


if __name__ == "__main__":
    print(main())
