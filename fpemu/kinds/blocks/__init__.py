"""The blocks kind: one block scale rule (MX, NVFP4) run on seeded probe blocks, one step per input kind.

The worked example of a scenario kind (docs/kinds.md): its spec schema and parser (``spec``), its
reference model and recorder (``trace``), and its divergence explanation, behind one descriptor.
"""

from fpemu.blocks.rules import SCALE_RULES
from fpemu.kinds.blocks.spec import BlocksScenario, parse_blocks_spec
from fpemu.kinds.blocks.trace import block_cause, recorded_blocks_trace, reference_blocks_trace
from fpemu.kinds.protocol import ScenarioKind

KIND = ScenarioKind("blocks", "blocks", BlocksScenario, parse_blocks_spec, reference=reference_blocks_trace,
                    record=recorded_blocks_trace, explain=block_cause, runs_by_default="own",
                    scale_label=None,
                    profiles=frozenset(SCALE_RULES))

__all__ = ["KIND", "BlocksScenario"]
