"""What every scenario has: its name, its spec, its steps, the real implementations to drive and the
divergences it declares (a validated spec, ready to run on the reference model or a real implementation).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional


@dataclasses.dataclass(frozen=True)
class ExpectedDivergence:
    """A documented difference: where the implementation first departs, and why.

    Only a first divergence at exactly this step and field is reported as known; any
    other difference is still a failure.
    """

    step: int
    field: str
    reason: str


@dataclasses.dataclass(frozen=True)
class Implementation:
    """A real implementation to drive: an adapter name, its parameters, and a declared divergence."""

    name: str
    params: dict
    device: str = "cpu"
    expect_divergence: Optional[ExpectedDivergence] = None

    @property
    def key(self) -> str:
        """How the implementation is named in traces and reports: adapter@device."""
        return f"{self.name}@{self.device}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScenarioBase:
    """What every scenario has: its name, its spec, its steps and the real implementations to drive."""

    name: str
    description: str
    steps: int
    implementations: tuple
    record: tuple
    path: str = ""
    sha256: str = ""
    text: str = ""
    # the adapter a golden trace needs (its reference runs on a real run's tensors), None for a pure model
    golden_needs: ClassVar[Optional[str]] = None

    def declared(self, name: str) -> Optional[Implementation]:
        """The spec's own [implementations.NAME] table, if it has one."""
        return next((impl for impl in self.implementations if impl.name == name), None)
