"""Loss scaling across ranks: the reference model of found-inf reductions (numpy only).

``predict(RanksCase(...))`` says per rank the scale, skips and whether ranks agree;
``cross_rank_verdict`` compares ranks; the real runs are driven by ``fpemu.adapters.torch_ranks``.
"""

from fpemu.ranks.model import (FOUND_INF_REDUCTIONS, GROUPS, INJECTIONS, LAYOUTS, SCALERS, CrossRankVerdict,
                               FoundInfReduction, Injection, Layout, RanksCase, RanksPrediction, Scaler,
                               chained_scales, cross_rank_verdict, found_inf_reduction, group_members, predict,
                               reduce_found_inf, visible_overflow)

__all__ = [
    # the tables
    "LAYOUTS", "INJECTIONS", "SCALERS", "FOUND_INF_REDUCTIONS", "Layout", "Injection", "Scaler",
    "FoundInfReduction", "found_inf_reduction", "GROUPS", "group_members",
    # the model
    "RanksCase", "RanksPrediction", "predict", "visible_overflow", "reduce_found_inf", "chained_scales",
    # comparing ranks
    "CrossRankVerdict", "cross_rank_verdict",
]
