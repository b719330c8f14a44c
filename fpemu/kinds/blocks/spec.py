"""Block quantization scenarios: one scale rule run on seeded probe blocks, every input kind a step.

A blocks spec::

    description = "torchao FLOOR, MXFP8"

    [blocks]
    rule = "torchao_floor"                # a key of fpemu.blocks.SCALE_RULES
    element = "fp8_e4m3fn"                # one the rule takes (default: its first)
    kinds = ["random", "edges", "nan"]    # fpemu.blocks.probes.PROBE_KINDS (default: all, in that order)
    rows = 128                            # blocks rows per kind (default 64)
    seed = 0                              # kind i is probed with seed + i (default 0: the recipe pages' blocks)

    [implementations.torchao_blocks]      # a blocks adapter that drives the rule (default: every one that does)
    params = { rule = "torchao_ceil" }    # optional: run the adapter under another rule of the same family
    expect_divergence = { step = 0, field = "scale_codes", reason = "CEIL rounds the scale up" }

``block_size`` (default: the rule's) may differ from the rule's own only in a spec without real
implementations: the blocks adapters run each rule at its own block size.  The golden trace is
fpemu's model (numpy only); a recorded trace is the adapter run on the very same probe blocks
(fpemu.kinds.blocks.trace).
"""

from __future__ import annotations

import dataclasses

from fpemu.blocks import SCALE_RULES
from fpemu.blocks.probes import PROBE_KINDS
from fpemu.adapters import BLOCKS, adapters_of_kind, driven_rules
from fpemu.kinds.scenario import Implementation, ScenarioBase
from fpemu.kinds.schema import build_scenario, implementation_tables, record_fields

_KEYS = {"rule", "element", "block_size", "kinds", "rows", "seed"}
_IMPLEMENTATION_PARAMS = {"rule"}
PROBE_COLUMNS = 32  # values per probe row (the recipe pages' width), rounded to whole blocks


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlocksScenario(ScenarioBase):
    """A scale rule of :data:`fpemu.blocks.SCALE_RULES` run on probe blocks (see :func:`fpemu.specs.load_spec`).

    Attributes:
      rule, element, block_size: as :func:`fpemu.block_quantize` takes them (``scale_rule``,
        ``element_format``, ``block_size``).
      kinds: the input kinds probed, one step each (:data:`fpemu.blocks.probes.PROBE_KINDS`).
      rows, seed: ``rows`` rows of :attr:`columns` values per kind; kind ``kinds[i]`` is probed with
        ``seed + PROBE_KINDS.index(kind)``.
    """

    rule: str
    element: str
    block_size: int
    kinds: tuple
    rows: int
    seed: int

    @property
    def profile(self) -> str:
        """The rule, under the name the harness gives what a scenario's adapters must run."""
        return self.rule

    @property
    def columns(self) -> int:
        """Values per probe row: whole blocks, at least :data:`PROBE_COLUMNS` where the block divides it."""
        return self.block_size * max(1, PROBE_COLUMNS // self.block_size)

    @property
    def params(self) -> dict:
        """Everything that decides the probe blocks and the model's run, as the traces' metadata names it."""
        return {"rule": self.rule, "element": self.element, "block_size": self.block_size, "kinds": list(self.kinds),
                "rows": self.rows, "columns": self.columns, "seed": self.seed}

    def implementation(self, name: str) -> Implementation:
        return self.declared(name) or Implementation(name, {})

    def rule_of(self, impl: Implementation) -> str:
        """The rule ``impl`` runs: its own ``params.rule``, else the spec's."""
        return impl.params.get("rule", self.rule)


def _element(check, table: dict, rule: str) -> str:
    elements = SCALE_RULES[rule].elements
    return check.choice(table.get("element", elements[0]), "blocks.element", elements)


def _kinds(check, kinds) -> tuple:
    if not isinstance(kinds, list) or not kinds:
        check.fail("blocks.kinds", f"expected a non-empty list of input kinds ({', '.join(PROBE_KINDS)})")
    for index, kind in enumerate(kinds):
        check.choice(kind, f"blocks.kinds[{index}]", PROBE_KINDS)
    if len(set(kinds)) != len(kinds):
        check.fail("blocks.kinds", f"each kind once (one step each), got {kinds!r}")
    return tuple(kinds)


def _driving(check, key: str, adapter: str, rule: str, element: str, block_size: int) -> None:
    """``adapter`` can run ``rule`` on ``element`` at ``block_size``, or the failure names ``key``."""
    driven = driven_rules(adapter)
    if rule not in driven:
        check.fail(key, f"{adapter} does not drive rule {rule!r}; it drives {', '.join(driven)}")
    if element not in SCALE_RULES[rule].elements:
        check.fail(key, f"rule {rule!r} takes {', '.join(SCALE_RULES[rule].elements)}, not blocks.element {element!r}")
    if block_size != SCALE_RULES[rule].block_size:
        check.fail(key, f"{adapter} runs {rule} at its own block size {SCALE_RULES[rule].block_size}, "
                        f"not blocks.block_size {block_size}")


def _implementations(check, raw, rule: str, element: str, block_size: int) -> tuple:
    """The spec's [implementations] (each a blocks adapter driving its rule), else every adapter driving ``rule``."""
    if not raw:
        own = SCALE_RULES[rule].block_size == block_size
        return tuple(Implementation(name, {}) for name in adapters_of_kind(BLOCKS)
                     if own and rule in driven_rules(name))
    out = []
    for key, adapter, device, body, reason in implementation_tables(check, raw, BLOCKS):
        params = check.table(body.get("params", {}), f"{key}.params", _IMPLEMENTATION_PARAMS)
        own_rule = check.choice(params.get("rule", rule), f"{key}.params.rule", tuple(SCALE_RULES))
        _driving(check, f"{key}.params.rule" if "rule" in params else key, adapter, own_rule, element, block_size)
        out.append(Implementation(adapter, dict(params), device, reason))
    return tuple(out)


def parse_blocks_spec(check, raw: dict, text: str, path: str) -> BlocksScenario:
    """Validate a spec with a [blocks] table (``check``: the loader's checker, which names the file)."""
    for key in ("scaler", "overflow", "step", "amax", "recipe", "steps"):
        if key in raw:
            check.attempt(check.fail, key, "a [blocks] scenario has one step per input kind of [blocks] kinds, "
                                           "its rule and its probe blocks; remove this key")
    table = check.attempt(check.table, raw["blocks"], "blocks", _KEYS) or {}
    rule = check.attempt(check.choice, table.get("rule"), "blocks.rule", tuple(SCALE_RULES))
    element = check.attempt(_element, check, table, rule) if rule else None
    block_size = (check.attempt(check.integer, table.get("block_size", SCALE_RULES[rule].block_size),
                                "blocks.block_size", 1) if rule else None)
    kinds = check.attempt(_kinds, check, table.get("kinds", list(PROBE_KINDS)))
    rows = check.attempt(check.integer, table.get("rows", 64), "blocks.rows", 1)
    seed = check.attempt(check.integer, table.get("seed", 0), "blocks.seed", 0)
    implementations = (check.attempt(_implementations, check, raw.get("implementations", {}), rule, element,
                                     block_size) if None not in (element, block_size) else None)
    record = check.attempt(record_fields, check, raw, BLOCKS)
    check.raise_errors()
    return build_scenario(check, BlocksScenario, raw, text, path, steps=len(kinds), rule=rule, element=element,
                     block_size=block_size, kinds=kinds, rows=rows, seed=seed, implementations=implementations,
                     record=record)

