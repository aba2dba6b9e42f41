"""Contract fake of ``flash_attn.cute`` (flash-attn-4 4.0.0b36): the private interface module only."""
