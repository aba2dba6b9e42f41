"""Contract fake of magi_attention (see tests/fakes/README.md and api.py).

``__version__`` is what the real package reports (magi_attention/__init__.py, from ``_version``);
``api.install_version`` sets it with the API of that release.
"""

__version__ = "1.1.1"
