"""Configuration and runtime: the CP config and its rules, RoPE tables, the process groups and
the rank layout, starting ranks, the expert-parallel exchange.

Layer 4 (configuration and runtime, docs/architecture.md "Layers"): imports only from its own layer and the ones below.
"""
