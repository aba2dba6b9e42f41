"""Contract fake of transformer_engine (see tests/fakes/README.md)."""
