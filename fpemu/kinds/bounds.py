"""The one table of bounds on a spec's counts: every integer a spec gives has a row here.

A spec is a quick, exact check, so its counts are bounded where a run stays within minutes and
megabytes on one CPU core (and within the int64 arithmetic of numpy and the frameworks); the loader
refuses a value outside its row, naming the key and the bound, before anything is allocated or run.
docs/bounds.md lists this table (tests/test_bounds.py checks that page against it).

A row's key is a key path as a spec error names it: ``*`` stands for any one name (an implementation,
a parameter, a rank), ``[]`` for any list index.  A maximum that differs by scenario kind (``steps``)
is a table: the kind (``scaler``, ``model``, ``step``, ``recipe``, ``fp8_training``, ``ranks``) -> its
maximum.

Example:
  >>> bound_for("ranks.world_sizes[3]").maximum
  16
  >>> bound_for("steps").limit("model")
  10000
"""

from __future__ import annotations

import dataclasses
import re

from fpemu.scalers.fp8_recipes import MAX_MARGIN
from fpemu.traces.schema import MAX_TRACE_STEPS

MAX_STEPS = MAX_TRACE_STEPS  # a scaler or recipe model run: ~4 s and a 17 MB golden; reports on it take about a minute
MAX_SPEC_BYTES = 2 << 20  # 100,000 explicit flags take 700 kB; TOML parses 1 MB in about a second
MAX_SLOW_STEPS = 10_000  # a trained numpy model (a model overflow source, a [step] spec): ~7 ms a step
MAX_TRAINING_STEPS = 1_000  # a real torchao Float8Linear run, every cast traced
MAX_INTERVAL = 1_000_000_000  # a scaler's counters: far past MAX_STEPS, within every framework's int32/int64
MAX_SEED = (1 << 32) - 1  # numpy's, torch's and JAX's generators all take 32-bit seeds


@dataclasses.dataclass(frozen=True)
class Bound:
    """The values a spec's integer at ``key`` may take.

    Attributes:
      key: the key path (``*``: any one name, ``[]``: any list index).
      minimum: the smallest value.
      maximum: the largest value, or a table scenario kind -> largest value.
      why: what the bound protects (the error message and docs/bounds.md give it).
    """

    key: str
    minimum: int
    maximum: int | dict
    why: str

    def limit(self, kind: str = "") -> int:
        """The maximum for a spec of ``kind`` (the largest of any kind where ``kind`` has no row)."""
        if isinstance(self.maximum, dict):
            return self.maximum.get(kind, max(self.maximum.values()))
        return self.maximum

    @property
    def pattern(self) -> re.Pattern:
        parts = (re.escape(part) for part in re.split(r"(\*|\[\])", self.key))
        return re.compile("".join({r"\*": r"[^.\[]+", r"\[\]": r"\[\d+\]"}.get(p, p) for p in parts))


_STEPS = {"scaler": MAX_STEPS, "recipe": MAX_STEPS, "model": MAX_SLOW_STEPS, "step": MAX_SLOW_STEPS,
          "ranks": MAX_SLOW_STEPS, "fp8_training": MAX_TRAINING_STEPS}

BOUNDS = (
    Bound("steps", 1, _STEPS, "each step is run and stored: a scaler or recipe run of 100,000 steps takes seconds, "
          "a trained model's ~7 ms a step, a real fp8 run far more"),
    Bound("overflow.seed", 0, MAX_SEED, "a 32-bit seed"),
    Bound("overflow.length", 1, MAX_STEPS, "a burst no longer than the longest run"),
    Bound("overflow.period", 1, MAX_STEPS, "a period no longer than the longest run"),
    Bound("overflow.offset", 0, MAX_STEPS, "an offset within the longest run"),
    Bound("ranks.overflow.*.seed", 0, MAX_SEED, "a 32-bit seed"),
    Bound("ranks.overflow.*.length", 1, MAX_STEPS, "a burst no longer than the longest run"),
    Bound("ranks.overflow.*.period", 1, MAX_STEPS, "a period no longer than the longest run"),
    Bound("ranks.overflow.*.offset", 0, MAX_STEPS, "an offset within the longest run"),
    Bound("implementations.*.expect_divergence.step", 0, MAX_STEPS, "a step within the longest run"),
    Bound("ranks.expect_divergence.*.step", 0, MAX_STEPS, "a step within the longest run"),
    Bound("scaler.params.*", -MAX_INTERVAL, MAX_INTERVAL, "a scaler's interval or count (or a recipe's margin): past any run, within int32; the scaler checks its own minimum"),
    Bound("implementations.*.params.*", -MAX_INTERVAL, MAX_INTERVAL, "a scaler's interval or count (or a recipe's margin): past any run, within int32; the scaler checks its own minimum"),
    Bound("ranks.params.*", -MAX_INTERVAL, MAX_INTERVAL, "a scaler's interval or count (or a recipe's margin): past any run, within int32; the scaler checks its own minimum"),
    Bound("recipe.params.amax_history_len", 1, 1 << 16, "the history is an array of this many float32 amaxes "
          "(TE's default is 1024)"),
    Bound("implementations.*.params.amax_history_len", 1, 1 << 16, "the history is an array of this many float32 "
          "amaxes (TE's default is 1024)"),
    Bound("recipe.params.margin", -MAX_MARGIN, MAX_MARGIN,
          "2^margin and 2^-margin stay finite, nonzero float32 factors"),
    Bound("recipe.params.*", -1024, 1024, "an axis or a count: a tensor has fewer dims"),
    Bound("amax.seed", 0, MAX_SEED, "a 32-bit seed"),
    Bound("step.batch", 1, 4, "the fitted step orders (fpemu.steps) cover up to 4 rows"),
    Bound("step.features", 1, 4, "the fitted step orders (fpemu.steps) cover up to 4 features"),
    Bound("step.outputs", 1, 4, "the fitted step orders (fpemu.steps) cover up to 4 outputs"),
    Bound("step.seed", 0, MAX_SEED, "a 32-bit seed"),
    Bound("step.growth_interval", 1, MAX_INTERVAL, "a scaler's interval: past any run, within int32"),
    Bound("fp8_training.seed", 0, MAX_SEED, "a 32-bit seed (torch.manual_seed)"),
    Bound("blocks.rows", 1, 1 << 16, "rows of probe values per input kind: a spec is a quick check"),
    Bound("blocks.block_size", 1, 4096, "values per scale: every rule's own is 16 or 32"),
    Bound("blocks.seed", 0, MAX_SEED - 16, "kind i is probed with seed + i, a 32-bit seed"),
    Bound("ranks.world_sizes[]", 2, 16, "forked CPU processes: more is a typo, not a test"),
    Bound("ranks.model_parallel", 1, 16, "a divisor of a world size of at most 16"),
)


def bound_for(key: str) -> Bound:
    """The first row of :data:`BOUNDS` whose key matches ``key`` (a spec error's key path).

    Raises:
      LookupError: no row matches (a bug: every integer a spec gives has a bound).
    """
    for row in BOUNDS:
        if row.pattern.fullmatch(key):
            return row
    raise LookupError(f"no bound in fpemu.kinds.bounds.BOUNDS for spec key {key!r}")


def bounds_table() -> str:
    """:data:`BOUNDS` as the Markdown table docs/bounds.md shows."""
    rows = ["| key | minimum | maximum | why |", "|---|---|---|---|"]
    for row in BOUNDS:
        maximum = (", ".join(f"{kind}: {value:,}" for kind, value in row.maximum.items())
                   if isinstance(row.maximum, dict) else f"{row.maximum:,}")
        rows.append(f"| `{row.key}` | {row.minimum:,} | {maximum} | {row.why} |")
    return "\n".join(rows)
