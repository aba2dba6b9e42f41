"""Differentiable communication and attention algorithms: kernels, block plans, comm patterns, collectives.

Layer 2 (algorithms, docs/architecture.md "Layers"): imports only from its own layer and the ones below.
"""
