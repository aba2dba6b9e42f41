"""Fake transformer_engine.pytorch.constants: the CP load-balancing enum of newer TE versions."""

import enum


class CPLoadBalancingStrategy(enum.Enum):
    DUAL_CHUNK_SWAP = "dual_chunk_swap"
