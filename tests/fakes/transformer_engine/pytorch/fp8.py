"""Fake ``transformer_engine.pytorch.fp8.FP8GlobalStateManager`` (the two queries the handler makes):
FP8 off unless a test turns it on with ``ENABLED`` / ``RECIPE``."""

from types import SimpleNamespace


class FP8GlobalStateManager:
    ENABLED = False
    RECIPE = SimpleNamespace(fp8_dpa=False)

    @classmethod
    def is_fp8_enabled(cls) -> bool:
        return cls.ENABLED

    @classmethod
    def get_fp8_recipe(cls):
        return cls.RECIPE
