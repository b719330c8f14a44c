"""Multi-rank specs: a [ranks] table instead of [scaler] and [overflow].

::

    description = "DDP + GradScaler: an inf after the all-reduce reaches one rank only"
    steps = 12

    [ranks]
    layout = "ddp"                       # fpemu.ranks.LAYOUTS: ddp | fsdp1 | fsdp2 | zero1 | zero2 | megatron
    scaler = "torch"                     # fpemu.ranks.SCALERS: torch (GradScaler) | torch_sharded | deepspeed |
                                         # megatron
    world_sizes = [2, 4]                 # one case per world size and injection point
    inject = ["loss", "grad_before_reduce", "grad_after_reduce"]   # fpemu.ranks.INJECTIONS
    params = { init_scale = 65536.0, growth_interval = 3 }          # the scaler profile's names
    step_keyed_collective = false        # optional: a collective sized by each rank's update count
    model_parallel = 2                   # optional: ranks per model replica (world = dp x mp; zero1, zero2, megatron)
    reduce_over = ["dp"]                 # optional: configure the found-inf collectives over these groups only
    timeout_s = 900                      # optional: seconds a case may run before it counts as a hang (default
                                         # 60 + 0.05 x steps x ranks; `fpemu run --rank-timeout` overrides both)

    [ranks.overflow.1]                   # rank 1's overflow source (any [overflow] source but model);
    source = "explicit"                  # ranks without one never overflow
    sequence = [false, false, true, ...]

    [ranks.expect_divergence.grad_after_reduce]    # ranks part at this injection point, and why
    step = 2
    reason = "GradScaler reduces no found-inf, and the inf came after DDP's all-reduce"
    ends = "abort"                       # optional: the run then crashes (gloo) or hangs (NCCL)
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from fpemu.ranks import FOUND_INF_REDUCTIONS, GROUPS, INJECTIONS, LAYOUTS, SCALERS, RanksCase, found_inf_reduction
from fpemu.scalers.profiles import get_profile
from fpemu.kinds.scaler.spec import overflow_source
from fpemu.kinds.scenario import ScenarioBase
from fpemu.kinds.schema import Checker, build_scenario

RANKS_FIELDS = ("scale", "overflow", "applied", "growth_counter")
ENDINGS = ("completes", "abort")
_RANKS_KEYS = {"layout", "scaler", "world_sizes", "inject", "params", "overflow", "expect_divergence",
               "step_keyed_collective", "model_parallel", "reduce_over", "timeout_s"}


@dataclasses.dataclass(frozen=True)
class RanksDivergence:
    """A declared cross-rank divergence: the first step at which ranks part, why, and how the run ends."""

    step: int
    reason: str
    ends: str = "completes"


@dataclasses.dataclass(frozen=True, kw_only=True)
class RanksScenario(ScenarioBase):
    """A multi-rank spec: one layout and scaler, run at each world size and injection point.

    Attributes:
      layout, scaler: keys of fpemu.ranks.LAYOUTS and SCALERS.
      params: the scaler profile's parameters.
      world_sizes, injections: the cases' axes.
      overflow: rank -> its OverflowSource.
      expected: injection point -> the RanksDivergence declared there.
      step_keyed_collective: each step ends with a collective sized by the rank's own update count.
      model_parallel, reduce_over: see fpemu.ranks.RanksCase.
      timeout_s: seconds each case may run before it counts as a hang; None: the launcher's default
        for its steps and world size (fpemu.adapters.torch_ranks.default_case_timeout).
    """

    layout: str
    scaler: str
    params: dict
    world_sizes: tuple
    injections: tuple
    overflow: dict
    expected: dict
    step_keyed_collective: bool = False
    model_parallel: int = 1
    reduce_over: Optional[tuple] = None
    timeout_s: Optional[float] = None

    @property
    def adapter(self) -> str:
        """The ADAPTERS row that runs it (fpemu.ranks.Layout.adapter)."""
        return LAYOUTS[self.layout].adapter

    def case_name(self, inject: str, world_size: int) -> str:
        return f"{self.name}.{inject}.{world_size}ranks"

    def cases(self) -> list:
        """(name, RanksCase, declared RanksDivergence or None) for every world size and injection point."""
        out = []
        for world_size in self.world_sizes:
            flags = tuple(tuple(bool(v) for v in self.overflow[rank].flags(self.steps)) if rank in self.overflow
                          else (False,) * self.steps for rank in range(world_size))
            for inject in self.injections:
                case = RanksCase(world_size, self.layout, self.scaler, inject, flags, dict(self.params),
                                 self.model_parallel, self.reduce_over)
                out.append((self.case_name(inject, world_size), case, self.expected.get(inject)))
        return out


def _strings(check: Checker, raw, key: str, options) -> tuple:
    if not isinstance(raw, list) or not raw:
        check.fail(key, f"expected a non-empty list of {', '.join(options)}")
    return tuple(check.choice(value, f"{key}[{i}]", tuple(options)) for i, value in enumerate(raw))


def _world_sizes(check: Checker, raw) -> tuple:
    if not isinstance(raw, list) or not raw:
        check.fail("ranks.world_sizes", "expected a non-empty list of integers >= 2")
    return tuple(check.integer(v, f"ranks.world_sizes[{i}]", 2) for i, v in enumerate(raw))  # 2..16: fpemu.kinds.bounds


def _rank_overflows(check: Checker, raw, steps: Optional[int], smallest_world: int) -> dict:
    if not isinstance(raw, dict):
        check.fail("ranks.overflow", f"expected a table of rank tables ([ranks.overflow.1]), got {raw!r}")
    out = {}
    for key, body in raw.items():
        where = f"ranks.overflow.{key}"
        if not key.isdigit() or int(key) >= smallest_world:
            check.fail(where, f"expected a rank 0..{smallest_world - 1} (below the smallest world size), got {key!r}")
        source = overflow_source(check, body, where)
        if source.kind == "model":
            check.fail(f"{where}.source", "a multi-rank spec takes explicit, bernoulli, bursts or periodic")
        if source.kind == "explicit" and steps is not None and len(source.sequence) != steps:
            check.fail(f"{where}.sequence", f"expected steps={steps} flags, got {len(source.sequence)}")
        out[int(key)] = source
    if not out:
        check.fail("ranks.overflow", "expected at least one rank's overflow source ([ranks.overflow.N])")
    return out


def _expected(check: Checker, raw, injections: tuple, steps: Optional[int]) -> dict:
    table = check.table(raw, "ranks.expect_divergence", set(injections))
    out = {}
    for inject, body in table.items():
        where = f"ranks.expect_divergence.{inject}"
        body = check.table(body, where, {"step", "reason", "ends"})
        for required in ("step", "reason"):
            if required not in body:
                check.fail(f"{where}.{required}", "missing required key (a declared divergence names the first "
                                                  "step at which ranks part, and why)")
        step = check.integer(body["step"], f"{where}.step", 0)
        if steps is not None and step >= steps:
            check.fail(f"{where}.step", f"expected a step of the run (0..{steps - 1}: steps = {steps}), got {step}")
        out[inject] = RanksDivergence(step,
                                      check.string(body["reason"], f"{where}.reason"),
                                      check.choice(body.get("ends", "completes"), f"{where}.ends", ENDINGS))
    return out


def _checked_injections(check: Checker, raw, layout: Optional[str]) -> tuple:
    injections = _strings(check, raw, "ranks.inject", INJECTIONS)
    for inject in injections:
        if layout is not None and INJECTIONS[inject].needs_shards and not LAYOUTS[layout].probe_per_rank:
            able = ", ".join(name for name, row in LAYOUTS.items() if row.probe_per_rank)
            check.fail("ranks.inject", f"{inject!r} needs a layout whose shards split the probe one element per "
                                       f"rank ({able}); {layout} has no such shards")
    return injections


def _reduction_known(check: Checker, scaler: str, layout: str) -> None:
    try:
        found_inf_reduction(scaler, layout)
    except ValueError:
        usable = ", ".join(sorted({row.framework for row in FOUND_INF_REDUCTIONS if row.framework in SCALERS
                                   and (layout in row.layouts or "*" in row.layouts)}))
        check.fail("ranks.scaler", f"{scaler!r} does not run on layout {layout!r}; expected one of {usable}")


def _model_parallel(check: Checker, raw, layout: Optional[str], sizes: Optional[tuple]) -> int:
    size = check.integer(raw, "ranks.model_parallel", 1)
    if size > 1 and layout is not None and not LAYOUTS[layout].groups:
        able = ", ".join(name for name, row in LAYOUTS.items() if row.groups)
        check.fail("ranks.model_parallel", f"layout {layout} runs data parallelism only; model-parallel groups run "
                                           f"on {able}")
    for world in sizes or ():
        if world % size or world == size:
            check.fail("ranks.model_parallel", f"expected a divisor of every world size that leaves at least two "
                                               f"data-parallel ranks, got {size} for {world} ranks")
    return size


def _reduce_over(check: Checker, raw, scaler: Optional[str], layout: Optional[str]) -> tuple:
    groups = _strings(check, raw, "ranks.reduce_over", GROUPS)
    if scaler and layout:
        if not LAYOUTS[layout].groups:
            check.fail("ranks.reduce_over", f"layout {layout}'s real run cannot configure its found-inf groups")
        own = [group for _, group, _ in found_inf_reduction(scaler, layout).ops]
        if set(groups) - set(own):
            check.fail("ranks.reduce_over", f"expected some of {scaler}'s own found-inf groups ({', '.join(own)}): a "
                                            "real run can leave a collective out, not add one")
    return groups


def _params(check: Checker, scaler: str, raw) -> dict:
    if not isinstance(raw, dict):
        check.fail("ranks.params", f"expected a table, got {type(raw).__name__}")
    for name, value in raw.items():
        check.parameter(value, f"ranks.params.{name}")
    try:
        get_profile(SCALERS[scaler].profile).rules(**raw)
    except (TypeError, ValueError) as error:
        check.fail("ranks.params", str(error))
    return dict(raw)


def _timeout(check: Checker, raw) -> float:
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not 0 < raw < float("inf"):
        check.fail("ranks.timeout_s", f"expected seconds > 0 (a finite number), got {raw!r}")
    return float(raw)


def parse_ranks_spec(check: Checker, raw: dict, text: str, path: str) -> RanksScenario:
    """Validate a spec with a [ranks] table (every independent mistake reported at once)."""
    for key in ("scaler", "overflow", "step", "record", "implementations"):
        if key in raw:
            check.attempt(check.fail, key, "a [ranks] spec says its scaler, overflows and layout in [ranks] (its "
                                           "implementation is its layout's); remove this table")
    steps = check.attempt(check.integer, raw["steps"], "steps", 1) if "steps" in raw else None
    if steps is None and "steps" not in raw:
        check.attempt(check.fail, "steps", "missing required key")
    ranks = check.attempt(check.table, raw["ranks"], "ranks", _RANKS_KEYS) or {}
    for required in ("layout", "scaler", "world_sizes", "inject", "overflow"):
        if ranks and required not in ranks:
            check.attempt(check.fail, f"ranks.{required}", "missing required key")
    layout = check.attempt(check.choice, ranks.get("layout"), "ranks.layout", tuple(LAYOUTS)) if "layout" in ranks else None
    scaler = check.attempt(check.choice, ranks.get("scaler"), "ranks.scaler", tuple(SCALERS)) if "scaler" in ranks else None
    if scaler and layout:
        check.attempt(_reduction_known, check, scaler, layout)
    params = check.attempt(_params, check, scaler, ranks.get("params", {})) if scaler else None
    sizes = check.attempt(_world_sizes, check, ranks["world_sizes"]) if "world_sizes" in ranks else None
    injections = check.attempt(_checked_injections, check, ranks["inject"], layout) if "inject" in ranks else None
    overflow = (check.attempt(_rank_overflows, check, ranks["overflow"], steps, min(sizes))
                if "overflow" in ranks and sizes else None)
    expected = (check.attempt(_expected, check, ranks.get("expect_divergence", {}), injections, steps)
                if injections else None)
    model_parallel = (check.attempt(_model_parallel, check, ranks["model_parallel"], layout, sizes)
                      if "model_parallel" in ranks else 1)
    reduce_over = (check.attempt(_reduce_over, check, ranks["reduce_over"], scaler, layout)
                   if "reduce_over" in ranks else None)
    timeout_s = check.attempt(_timeout, check, ranks["timeout_s"]) if "timeout_s" in ranks else None
    keyed = ranks.get("step_keyed_collective", False)
    if not isinstance(keyed, bool):
        check.attempt(check.fail, "ranks.step_keyed_collective", f"expected true or false, got {keyed!r}")
    check.raise_errors()
    return build_scenario(check, RanksScenario, raw, text, path, steps=steps, implementations=(), record=RANKS_FIELDS,
                     layout=layout, scaler=scaler, params=params, world_sizes=sizes, injections=injections,
                     overflow=overflow, expected=expected, step_keyed_collective=keyed,
                     model_parallel=model_parallel, reduce_over=reduce_over, timeout_s=timeout_s)

