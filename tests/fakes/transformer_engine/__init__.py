"""Contract fake of transformer_engine (see tests/fakes/README.md).

``__version__`` is what the real package reports (``metadata.version("transformer_engine")``,
transformer_engine/__init__.py); tests set it to run the fake as another release.
"""

__version__ = "2.20.2"
