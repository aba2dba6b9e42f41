"""Contract fake of the flash-attn-4 distribution (tests/fakes/README.md): only ``flash_attn.cute`` exists."""
