"""Benchmarks (commands that print a table and write JSON).

Layer 8 (applications, docs/architecture.md "Layers"): imports only from its own layer and the ones below.
"""
