"""Wall time of every multi-rank case of specs/ on real torch.distributed ranks (gloo, CPU).

The issue's target: all [ranks] cases together (2 and 4 ranks) in at most 30 s.  Measures
`fpemu.harness.ranks.run_ranks` end to end (the `fpemu run` path: the model, one forked process
group per world size, the comparisons, the traces), then each world size's process group alone
(the first case of a fresh group pays its lazy initialisation).

Writes reports/bench_ranks.md and .json.  Run: python -m benchmarks.bench_ranks
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import statistics
import tempfile
import time

from benchmarks._common import write_report
from fpemu.harness.ranks import case_payload, ranks_scenarios, run_ranks
from fpemu.specs import load_specs

SPECS = pathlib.Path(__file__).resolve().parent.parent / "specs"


def _groups() -> dict:
    groups = {}
    for scenario in ranks_scenarios(load_specs([SPECS])):
        for _, case, _ in scenario.cases():
            groups.setdefault(case.world_size, []).append(case_payload(scenario, case))
    return groups


def main(argv=None) -> dict:
    from fpemu.adapters.torch_ranks import run_cases
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    load_before = os.getloadavg()[0]
    from fpemu.adapters.torch_ranks import _preload
    start = time.perf_counter()
    _preload([case for payload in _groups().values() for case in payload])
    rows = [{"what": "imports before forking (torch._dynamo, DeepSpeed, megatron-core: once per process)",
             "wall_s": time.perf_counter() - start}]
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        outcomes, _ = run_ranks([SPECS], pathlib.Path(folder) / "golden", pathlib.Path(folder) / "observed")
        total = time.perf_counter() - start
    rows.append({"what": "run_ranks: every [ranks] case, model + real ranks + comparisons", "cases": len(outcomes),
                 "wall_s": total, "failing": sum(o.verdict.failed for o in outcomes)})
    for world, payload in sorted(_groups().items()):
        start = time.perf_counter()
        results = run_cases(payload, world)
        wall = time.perf_counter() - start
        seconds = [r.seconds for r in results]
        rows.append({"what": f"{world} ranks: one process group for all its cases", "cases": len(payload),
                     "wall_s": wall, "first_case_s": seconds[0], "median_case_s": statistics.median(seconds[1:]),
                     "max_case_s": max(seconds[1:]), "crashed": sum(r.error is not None for r in results)})
    result = {"rows": rows, "python": platform.python_version(), "cpus": os.cpu_count(),
              "load_average_1min_before": round(load_before, 1)}
    columns = [("what", "what"), ("cases", "cases"), ("wall_s", "wall s"), ("first_case_s", "first case s"),
               ("median_case_s", "median case s (after the first)"), ("max_case_s", "max case s"),
               ("failing", "failing verdicts"), ("crashed", "cases that crashed or hung")]
    notes = ["gloo on the CPU, ranks forked from this process (`fpemu.adapters.torch_ranks.run_cases`), a "
             "`file://` rendezvous, one process group per world size, a barrier between cases.",
             "The imports before forking are timed apart: `fpemu run` pays them once, and without them every "
             "forked rank paid them on its first case (torch.optim's first optimizer imports torch._dynamo; "
             "deepspeed.initialize imports its Muon optimizer, which calls torch.compile).",
             "The step-keyed abort spec crashes its process group on purpose (gloo aborts the collective "
             "mismatch): it is counted under 'crashed or hung', and the cases after it run in a fresh group.",
             f"One run on {os.cpu_count()} CPUs with a 1-minute load average of {load_before:.1f} when it started; "
             "on a machine shared with other jobs the figures vary by several times: re-measure on a quiet "
             "machine before quoting them."]
    write_report("bench_ranks", "Multi-rank cases on torch.distributed (gloo, CPU)", result, rows, columns, notes)
    return result


if __name__ == "__main__":
    print(main())
