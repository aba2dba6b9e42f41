"""Adapters that bring cp_handler to model code it does not own (Hugging Face transformers).

Layer 6 (model-facing, docs/architecture.md "Layers"): imports only from its own layer and the ones below.
"""
