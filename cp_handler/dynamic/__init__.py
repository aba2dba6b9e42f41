"""Dynamic context parallelism: each micro-batch gives every sequence the smallest CP group that fits it."""

from .groups import GroupPool
from .scheduler import Group, MicroBatch, Schedule, schedule_sequences
from .workload import Workload

__all__ = ["Group", "GroupPool", "MicroBatch", "Schedule", "Workload", "schedule_sequences"]
