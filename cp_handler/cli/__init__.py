"""Command-line entry points (``cp-train``).

Layer 8 (applications, docs/architecture.md "Layers"): imports only from its own layer and the ones below.
"""
