"""Adapters that bring cp_handler to model code it does not own (Hugging Face transformers)."""
