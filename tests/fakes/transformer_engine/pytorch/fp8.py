"""Fake ``transformer_engine.pytorch.fp8.FP8GlobalStateManager`` (the two queries the handler makes) and the
recipe classes by name (``transformer_engine/common/recipe/__init__.py``, main d0067d0, L173-630: the handler
and TE tell recipes apart by class). FP8 off unless a test turns it on with ``ENABLED`` / ``RECIPE``."""


class Recipe:
    def __init__(self, fp8_dpa=False):
        self.fp8_dpa = fp8_dpa


class DelayedScaling(Recipe):
    pass


class Float8CurrentScaling(Recipe):
    pass


class MXFP8BlockScaling(Recipe):
    pass


class Float8BlockScaling(Recipe):
    pass


class FP8GlobalStateManager:
    ENABLED = False
    RECIPE = DelayedScaling()

    @classmethod
    def is_fp8_enabled(cls) -> bool:
        return cls.ENABLED

    @classmethod
    def get_fp8_recipe(cls):
        return cls.RECIPE
