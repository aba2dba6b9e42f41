#!/usr/bin/env bash
# Installs what a README command needs, and nothing when it is there already.
#
#   scripts/setup.sh main            torch and this package (make train)
#   scripts/setup.sh test            also the `test` extra: pytest, transformers, TRL, ruff, ... (make test, make lint)
#   scripts/setup.sh --check WHAT    installs nothing: exit 0 when WHAT is there, else 1 and what is missing
#
# Into $PYTHON (default python3: an active venv's, else the system's: as root on a CI machine), or, with VENV=DIR,
# into a venv it makes at DIR when missing (it sees $PYTHON's packages, so an installed torch is reused).
# "There" means: cp_handler is installed editable from THIS checkout and imports from it (an install left by
# another checkout would shadow this one), pyproject.toml's dependencies (and the extra's) are installed at
# versions it allows, and the installed entry points are pyproject.toml's.
# torch is pinned to the local CPU build first: an open range would pull several GB of CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
CHECK=0
if [ "${1:-}" = "--check" ]; then CHECK=1; shift; fi
WHAT=${1:-main}
case "$WHAT" in
    main) EXTRA="" ;;
    test) EXTRA="test" ;;
    *) echo "setup.sh: unknown target '$WHAT': main (torch and cp_handler, for make train) or test (also the test" \
            "extra, for make test)" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
if [ -n "${VENV:-}" ]; then
    if [ ! -x "$VENV/bin/python" ]; then
        if [ "$CHECK" = 1 ]; then echo "setup: no venv at $VENV" >&2; exit 1; fi
        echo "setup: making the venv $VENV (it sees $PY's packages: an installed torch is reused)" >&2
        "$PY" -m venv --system-site-packages "$VENV"
        echo "*" > "$VENV/.gitignore"  # git status stays clean (Python 3.13's venv writes it itself)
    fi
    PY="$VENV/bin/python"
fi

# What is missing, one line each (nothing: all there; "cannot check: ..." where this Python cannot tell).
missing() {
    "$PY" - "$ROOT" "$EXTRA" <<'PYTHON'
import importlib.metadata as md
import importlib.util
import json
import os
import sys
from urllib.parse import unquote, urlparse

if sys.path and sys.path[0] == "":  # the working directory (this checkout): an import must find the install
    del sys.path[0]
root, extra = os.path.realpath(sys.argv[1]), sys.argv[2]


def main():
    try:
        import tomllib
    except ImportError:
        try:
            import tomli as tomllib
        except ImportError:
            return ["cannot check: pyproject.toml needs Python 3.11's tomllib (or tomli) to be read"]
    try:
        from packaging.requirements import Requirement
    except ImportError:
        try:
            from pip._vendor.packaging.requirements import Requirement
        except ImportError:
            return ["cannot check: no packaging module to compare versions with"]
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    problems = []
    try:
        dist = md.distribution(project["name"])
    except md.PackageNotFoundError:
        return [f"{project['name']} is not installed"]
    url = json.loads(dist.read_text("direct_url.json") or "{}")
    where = unquote(urlparse(url.get("url", "")).path) if url.get("url", "").startswith("file:") else None
    if not (url.get("dir_info", {}).get("editable") and where and os.path.realpath(where) == root):
        problems.append(f"{project['name']} is installed from {where or url.get('url') or 'a package'}, not "
                        f"editable from this checkout {root}")
    spec = importlib.util.find_spec(project["name"])
    origin = spec.origin if spec else None
    if origin is None or os.path.realpath(origin) != os.path.join(root, project["name"], "__init__.py"):
        problems.append(f"import {project['name']} finds {origin}, not this checkout's")
    if dist.version != project["version"]:
        problems.append(f"{project['name']} {dist.version} is installed, pyproject.toml says {project['version']}")
    scripts = {e.name: e.value for e in dist.entry_points if e.group == "console_scripts"}
    if scripts != project.get("scripts", {}):
        problems.append(f"the installed commands {sorted(scripts)} are not pyproject.toml's")
    wanted, extras, seen = list(project["dependencies"]), [extra] if extra else [], set()
    while extras:  # an extra may name others of this project: "cp_handler[test]"
        name = extras.pop()
        if name not in seen:
            seen.add(name)
            for text in project.get("optional-dependencies", {})[name]:
                req = Requirement(text)
                if req.name.replace("-", "_") == project["name"].replace("-", "_"):
                    extras.extend(req.extras)
                else:
                    wanted.append(text)
    for text in wanted:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        try:
            version = md.version(req.name)
        except md.PackageNotFoundError:
            problems.append(f"{req.name} is not installed ({text})")
            continue
        if not req.specifier.contains(version, prereleases=True):
            problems.append(f"{req.name} {version} is installed, {text} is needed")
    return problems


print("\n".join(main()))
PYTHON
}

gaps=$(missing) || gaps="cannot check: $PY could not run the check (above)"
if [ -z "$gaps" ]; then
    echo "setup: $WHAT is installed in $PY (cp_handler from $ROOT): nothing to do" >&2
    exit 0
fi
if [ "$CHECK" = 1 ]; then
    echo "$gaps" | sed 's/^/setup: missing: /' >&2
    exit 1
fi
echo "$gaps" | sed 's/^/setup: /' >&2
if ! "$PY" -c 'import os, sys, sysconfig
sys.exit(sys.prefix == sys.base_prefix and os.path.isfile(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")))'
then
    echo "setup: $PY is the system's Python, managed by its package manager (PEP 668): install into a venv," \
         "e.g. make train VENV=.venv (scripts/setup.sh makes it), or activate one first" >&2
    exit 1
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
if ! "$PY" -c "import torch" 2>/dev/null; then
    echo "setup: installing torch==2.13.0 into $PY" >&2
    "$PY" -m pip install --quiet "torch==2.13.0"
fi
echo "setup: installing cp_handler${EXTRA:+[$EXTRA]} (editable, this checkout) into $PY" >&2
"$PY" -m pip install --quiet -e ".${EXTRA:+[$EXTRA]}"
gaps=$(missing) || gaps="cannot check: $PY could not run the check (above)"
left=$(grep -v -e '^cannot check: ' -e '^$' <<<"$gaps" || true)
if [ -n "$left" ]; then
    sed 's/^/setup: still missing after the install: /' <<<"$left" >&2
    exit 1
fi
