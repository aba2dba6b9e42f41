"""How to install one of cp_handler's extras from where the user stands: the line every ``ImportError`` hint uses.

cp_handler is not on a public index, so ``pip install 'cp_handler[bench]'`` fails anywhere but beside a local
wheel. :func:`extra_hint` names what works everywhere, the extra's own requirements (``pip install
'matplotlib>=3.7'``): from the checkout's ``pyproject.toml`` when the package is imported from a checkout (an
editable install's metadata can be older than the file), else from the installed distribution's metadata; and,
when cp_handler comes from a checkout or a local wheel, the install of the extra from it (``pip install -e
'/path/to/checkout[bench]'``).
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import shlex
from urllib.parse import unquote, urlparse

DISTRIBUTION = "cp_handler"
_EXTRA_MARKER = re.compile(r"""extra\s*==\s*["']([^"']+)["']""")


def _checkout() -> str | None:
    """The checkout this package is imported from (a folder holding ``pyproject.toml`` above the package)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # above cp_handler/core/
    return root if os.path.isfile(os.path.join(root, "pyproject.toml")) else None


def extra_requirements(extra: str) -> list[str]:
    """The requirements the extra ``extra`` adds (``["matplotlib>=3.7"]`` for ``"bench"``), other extras of
    cp_handler it names expanded; ``[]`` for an extra that is not declared."""
    declared = _pyproject_extras() if _checkout() else _metadata_extras()
    wanted, seen, todo = [], set(), [extra]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for requirement in declared.get(name, []):
            inner = re.match(rf"{DISTRIBUTION}\s*\[([^\]]+)\]", requirement.replace("-", "_"))
            if inner:
                todo.extend(part.strip() for part in inner.group(1).split(","))
            elif requirement not in wanted:
                wanted.append(requirement)
    return wanted


def _metadata_extras() -> dict[str, list[str]]:
    """The installed distribution's extras (``Requires-Dist: ...; extra == "name"``)."""
    try:
        lines = md.distribution(DISTRIBUTION).requires or []
    except md.PackageNotFoundError:
        return {}
    declared: dict[str, list[str]] = {}
    for line in lines:
        requirement, _, marker = line.partition(";")
        found = _EXTRA_MARKER.search(marker)
        if found:
            declared.setdefault(found.group(1), []).append(requirement.strip())
    return declared


def _pyproject_extras() -> dict[str, list[str]]:
    root = _checkout()
    if root is None:
        return {}
    try:
        import tomllib
    except ImportError:  # Python 3.10
        return {}
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        return tomllib.load(f).get("project", {}).get("optional-dependencies", {})


def _source() -> tuple[str, bool] | None:
    """``(path, editable)``: the checkout this package is imported from (editable install or ``PYTHONPATH``), or the
    local wheel it was installed from; else ``None``."""
    root = _checkout()
    if root is not None:
        return root, True
    try:
        text = md.distribution(DISTRIBUTION).read_text("direct_url.json") or "{}"
    except md.PackageNotFoundError:
        return None
    url = json.loads(text).get("url", "")
    path = unquote(urlparse(url).path) if url.startswith("file:") else None
    return (path, False) if path and os.path.isfile(path) else None


def extra_hint(extra: str) -> str:
    """``pip install ...`` lines that bring the extra ``extra`` here (module doc), e.g. ``pip install
    'matplotlib>=3.7' (cp_handler's bench extra; from its checkout: pip install -e '/src/cp_handler[bench]')``."""
    requirements = extra_requirements(extra)
    packages = " ".join(shlex.quote(r) for r in requirements)
    source = _source()
    from_source = ""
    if source is not None:
        path, editable = source
        target = shlex.quote(f"{path}[{extra}]")
        from_source = f"; from its {'checkout' if editable else 'wheel'}: pip install {'-e ' * editable}{target}"
    if not packages:
        return f"install cp_handler's {extra} extra{from_source}"
    return f"pip install {packages} (cp_handler's {extra} extra{from_source})"
