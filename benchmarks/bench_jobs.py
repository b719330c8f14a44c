"""Parallel jobs vs one after another: `fpemu run` and `fpemu record` over all of specs/ at --jobs 1 and N.

Each command runs as a process of its own (`python -m fpemu ...`) from a fresh folder, at --jobs 1 and then at
--jobs N (default: the usable cores); every file each wrote is compared, byte for byte, and so
are the exit codes. The wall time of --jobs N against --jobs 1 is the speed-up on this machine.

Writes reports/bench_jobs.md and .json.  Run: python -m benchmarks.bench_jobs [--jobs N]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import tempfile

from benchmarks._common import ROOT, TIMING_NOTE, run_fpemu, tree_digests, write_report
from fpemu.harness.pool import usable_cores

COMMANDS = {
    "`fpemu run` (all of specs/: goldens, every installed implementation, reports)":
        lambda out: ["run", "--specs", ROOT / "specs", "--reports", out, "--quiet"],
    "`fpemu record` (all of specs/: every installed implementation's trace)":
        lambda out: ["record", ROOT / "specs", "--out", out, "--quiet", "--allow-skips"],
}


def row(what: str, command, jobs: int, folder: pathlib.Path) -> dict:
    one = run_fpemu(*command(folder / "one"), "--jobs", 1)
    many = run_fpemu(*command(folder / "many"), "--jobs", jobs)
    a, b = tree_digests(folder / "one"), tree_digests(folder / "many")
    differ = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    same = "yes" if not differ and one[1] == many[1] else f"NO: exit {one[1]} vs {many[1]}; {', '.join(differ[:5])}"
    return {"what": what, "files": len(a), "identical": same, "jobs_1_s": round(one[0], 1),
            "jobs_n_s": round(many[0], 1), "speedup": round(one[0] / many[0], 2), "jobs": jobs}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=usable_cores(), help="N (default: the usable cores)")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="fpemu-bench-jobs-") as tmp:
        rows = []
        for index, (what, command) in enumerate(COMMANDS.items()):
            (pathlib.Path(tmp) / str(index)).mkdir()
            rows.append(row(what, command, args.jobs, pathlib.Path(tmp) / str(index)))
    result = {"rows": rows, "python": platform.python_version(), "cpus": usable_cores(),
              "load_average_1min_before": round(load_before, 1)}
    columns = [("what", "command"), ("jobs", "N"), ("identical", "--jobs N = --jobs 1, byte for byte"),
               ("files", "files compared"), ("jobs_1_s", "--jobs 1 s"), ("jobs_n_s", "--jobs N s"),
               ("speedup", "speed-up")]
    notes = ["Every file each command wrote (reports, golden, observed and per-rank traces, plots) and its exit code, "
             "at --jobs 1 against --jobs N. Each command is a process of its own; each worker process imports the "
             "frameworks its jobs use once, which --jobs 1 does once in all.",
             f"One run on {usable_cores()} usable CPUs with a 1-minute load average of {load_before:.1f} when it "
             "started. " + TIMING_NOTE]
    write_report("bench_jobs", "Parallel jobs (--jobs N) vs one after another", result, rows, columns, notes)
    return result


if __name__ == "__main__":
    print(main())
