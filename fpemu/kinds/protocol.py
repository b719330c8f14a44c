"""The one protocol a scenario kind implements: a descriptor the registry (fpemu.kinds.KINDS) lists.

A scenario kind is one package under fpemu/kinds/ whose ``KIND`` is a :class:`ScenarioKind`.  The spec
loader (fpemu.specs), the harness, the comparison's explanations and the report's sections reach a kind only
through its descriptor, so adding a kind is its package and one line of the registry.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional


@dataclasses.dataclass(frozen=True)
class ScenarioKind:
    """What the harness, the loader and the comparison call a scenario kind through.

    Attributes:
      name: the kind's name: the traces' fields it records are the rows of
        :data:`fpemu.traces.fields.FIELDS` whose ``recorded_by`` names it, and the adapters that run
        it (fpemu.adapters) are of this kind.
      table: the top-level spec table that marks a spec of this kind (``blocks``); None for the kind
        of a spec with none of the others' tables (scaler specs).
      other_tables: the other top-level tables its specs may have (a recipe spec's ``amax``).
      scenario: the scenario class its parser builds (a :class:`fpemu.kinds.scenario.ScenarioBase`).
      parse: ``(checker, raw TOML, text, path) -> scenario``; ``checker`` is a
        :class:`fpemu.kinds.schema.Checker` naming the file, and every failure names the key.
      reference: ``scenario -> Trace``, the golden trace: fpemu's model of the scenario.  None for a
        kind whose cases run on several processes at once (fpemu.harness.ranks runs those).
      record: ``(scenario, Implementation) -> Trace``, a real implementation driven through it.
      explain: ``(field, step, golden, observed) -> str | None``: why two of its traces first differ
        at ``field`` of ``step``, or None to leave the reading to the generic one
        (fpemu.compare.diff.likely_cause).
      runs_by_default: the adapters of this kind a spec without [implementations] drives: ``profile``
        (those whose profile is the scenario's), ``declared`` (only the spec's own) or ``own`` (the
        kind's parser chose them).
      scale_label: what the report (reports/harness.md) calls the ``scale`` its steps record, the y axis
        of the scenario's plot (``loss scale``, an fp8 recipe's ``fp8 scale``); None for a kind whose
        steps record no scale, so its section has no scale plot.
      records: the ``recorded_by`` names of :data:`fpemu.traces.fields.FIELDS` its traces' fields are of, where
        not its own name alone (a scaler spec's model overflow source records the ``model`` fields; a ranks
        spec's traces hold a scaler's).
      profiles: every ``metadata.profile`` its traces may hold (its models' and its adapters'); a trace
        naming another is refused (:func:`fpemu.kinds.trace_kind_problem`).
    """

    name: str
    table: Optional[str]
    scenario: type
    parse: Callable
    other_tables: tuple = ()
    reference: Optional[Callable] = None
    record: Optional[Callable] = None
    explain: Optional[Callable] = None
    runs_by_default: str = "profile"
    scale_label: Optional[str] = "loss scale"
    records: tuple = ()
    profiles: frozenset = frozenset()

    @property
    def recorded_fields(self) -> tuple:
        """The ``recorded_by`` names its traces' step fields are of."""
        return self.records or (self.name,)
