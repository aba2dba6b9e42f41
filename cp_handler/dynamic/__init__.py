"""Dynamic context parallelism: each global batch scheduled onto CP groups of the sizes its sequences need,
balanced by a cost model (:class:`Workload`: ``L^2 / cp``; :class:`CostModel`: fitted to a measured GPU).

Layer 3 (cost models, docs/architecture.md "Layers"): imports only from its own layer and the ones below.
"""

from .bound import group_sizes, makespan_bound
from .cost_model import CostModel
from .groups import GroupPool
from .scheduler import Group, MicroBatch, Schedule, schedule_sequences
from .workload import Workload

__all__ = ["CostModel", "Group", "GroupPool", "MicroBatch", "Schedule", "Workload", "group_sizes", "makespan_bound",
           "schedule_sequences"]
