"""The ranks kind: a data-parallel layout's loss scaling run on several ranks at once ([ranks] specs).

Its cases run on several processes, so the harness's launcher (fpemu.harness.ranks) runs them; this
package holds what the loader calls.
"""

from fpemu.kinds.protocol import ScenarioKind
from fpemu.kinds.ranks.spec import RanksDivergence, RanksScenario, parse_ranks_spec
from fpemu.scalers.profiles import PROFILES

KIND = ScenarioKind("ranks", "ranks", RanksScenario, parse_ranks_spec, runs_by_default="own", records=("scaler",),
                    profiles=frozenset(PROFILES))

__all__ = ["KIND", "RanksDivergence", "RanksScenario"]
