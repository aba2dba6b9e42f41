"""Contract fake of magi_attention (see tests/fakes/README.md)."""
