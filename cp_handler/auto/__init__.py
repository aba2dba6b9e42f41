"""``cp_comm_type="auto"``: every pattern's cost counted from its plans and transfers, priced by a measured or named
profile, and the fastest picked (docs/auto_plan.md).

Layer 3 (cost models, docs/architecture.md "Layers"): imports only from its own layer and the ones below.
"""

from .catalog import NAMED_PROFILES, load_profile
from .choice import AutoChoice, Prediction, candidates, choose_comm_type, predict
from .hold import PatternHold
from .pattern_work import AttnCase, PatternWork, PlanWork, Transfer, pattern_work, rank_plan
from .profile import ComputeFit, CostProfile, GroupProfile, LinkFit

__all__ = ["NAMED_PROFILES", "AttnCase", "AutoChoice", "ComputeFit", "CostProfile", "GroupProfile", "LinkFit",
           "PatternHold", "PatternWork", "PlanWork", "Prediction", "Transfer", "candidates", "choose_comm_type",
           "load_profile", "pattern_work", "predict", "rank_plan"]
