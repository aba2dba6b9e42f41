"""The foundations: where tokens live (zigzag, thd documents), what a query sees (masks), progress
lines and install hints.

Layer 1 (foundations, docs/architecture.md "Layers"): imports only from its own layer and the ones below.
"""
