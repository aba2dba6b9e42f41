"""The package's layers (docs/architecture.md, "Layers"): the folders are the layers. Every top-level folder of
``cp_handler/`` says its layer in its ``__init__.py`` docstring (``Layer N (...)``); no module stands loose at the
top (the public face ``cp_handler/__init__.py`` apart); every module imports only from its own layer or the ones
below, and no modules import each other in a circle, lazy imports inside functions included; and one concept per
file: a library file over ``LONG_LINES`` lines is a prompt to ask whether it still holds one concept, so each is
listed, with the reason, in docs/architecture.md's "Files over 400 lines" table.

The layers are read from the folders themselves, so a new folder must declare its layer and a new module must live
in a folder: a module without one fails here, as does an import that runs up a layer.
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).parent.parent
PACKAGE = ROOT / "cp_handler"
FACE = "cp_handler"
"""The public face: re-exports only; above every layer, imported by no module of the library."""


def layer_table() -> dict[str, int]:
    """``{top-level folder: layer}`` from each folder's ``__init__.py`` docstring (``Layer N (...)``)."""
    table = {}
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        found = re.findall(r"^Layer (\d+) \(", doc, re.M)
        assert len(found) == 1, f"{init.relative_to(ROOT)}: its docstring must say its layer once ('Layer N (...)')"
        table[init.parent.name] = int(found[0])
    assert table, "no folders under cp_handler/"
    return table


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def layer_of(name: str, table: dict[str, int]) -> int:
    """The layer of module ``name``: its top-level folder's (the public face is above them all)."""
    if name == FACE:
        return max(table.values()) + 1
    parts = MODULES[name].relative_to(PACKAGE).parts
    assert len(parts) > 1, f"cp_handler/{parts[0]} stands loose at the top: move it into the folder of its layer"
    assert parts[0] in table, f"cp_handler/{parts[0]}/ has no __init__.py saying its layer"
    return table[parts[0]]


def imports_of(name: str) -> set[str]:
    """The package's modules ``name`` imports anywhere in its file (``from x import y`` counts y when it is a
    module, else x)."""
    path, found = MODULES[name], set()
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join([*base, *([node.module] if node.module else [])])
            targets = [f"{target}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            continue
        for target in targets:
            while target not in MODULES and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in MODULES and target != name:
                found.add(target)
    return found


GRAPH = {name: imports_of(name) for name in MODULES}
LONG_LINES = 400


def long_files_table() -> dict[str, str]:
    """``{path under cp_handler/: reason}`` from the doc's "Files over 400 lines" table."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    assert "### Files over 400 lines" in doc, "no 'Files over 400 lines' table in docs/architecture.md"
    section = doc.split("### Files over 400 lines", 1)[1].split("\n#", 1)[0]
    return dict(re.findall(r"^\| `([^`]+)` \| (.+?) \|$", section, re.M))


def unlisted_and_stale(lengths: dict[str, int], listed: dict[str, str]) -> tuple[dict[str, int], dict[str, int | None]]:
    """Files over ``LONG_LINES`` not listed, and listed files that are missing (``None``) or not over it."""
    unlisted = {path: n for path, n in lengths.items() if n > LONG_LINES and path not in listed}
    stale = {path: lengths.get(path) for path in listed if lengths.get(path, 0) <= LONG_LINES}
    return unlisted, stale


def test_every_file_over_400_lines_is_listed_with_its_reason():
    """One concept per file: a long file is allowed, but named in docs/architecture.md with why it is still one
    concept; and the list holds only files that exist and are over the threshold (so it stays true)."""
    lengths = {str(path.relative_to(PACKAGE)): len(path.read_text().splitlines()) for path in MODULES.values()}
    assert lengths, "no library files found"
    listed = long_files_table()
    assert all(reason.strip() for reason in listed.values()), listed
    unlisted, stale = unlisted_and_stale(lengths, listed)
    assert not unlisted, f"over {LONG_LINES} lines, not in docs/architecture.md's 'Files over 400 lines': {unlisted}"
    assert not stale, f"listed in docs/architecture.md's 'Files over 400 lines' but missing or not over: {stale}"


def test_the_line_check_sees_an_unlisted_long_file_and_a_stale_entry():
    """Negative control: a 401-line file not in the table fails, and so does an entry of 400 lines or a
    missing file; a listed 401-line file passes."""
    assert unlisted_and_stale({"a.py": 401}, {}) == ({"a.py": 401}, {})
    assert unlisted_and_stale({"a.py": 401}, {"a.py": "one idea"}) == ({}, {})
    assert unlisted_and_stale({"a.py": 400}, {"a.py": "one idea", "gone.py": "x"}) == ({}, {"a.py": 400,
                                                                                           "gone.py": None})
    assert long_files_table(), "the table parses to nothing"


def test_no_import_runs_up_a_layer():
    table = layer_table()
    upward = [f"{a} (layer {layer_of(a, table)}) imports {b} (layer {layer_of(b, table)})"
              for a, targets in GRAPH.items() for b in targets if layer_of(b, table) > layer_of(a, table)]
    assert not upward, upward


def test_no_modules_import_each_other_in_a_circle():
    state: dict[str, int] = {}
    circles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == 1:
                circles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [name])
    # a package's __init__ re-exporting its own submodules is not a circle of the code
    real = [c for c in circles if not all(m == c[0] or m.startswith(c[0] + ".") for m in c)]
    assert not real, real


def test_no_library_module_imports_the_public_face():
    """``cp_handler/__init__.py`` re-exports; inside the library every import names the module it needs."""
    assert not [name for name, targets in GRAPH.items() if "cp_handler" in targets and name != "cp_handler"]


def test_the_check_sees_an_upward_import():
    """Negative control: the helper resolves a relative import that runs up (ops importing a handler)."""
    table = layer_table()
    assert layer_of("cp_handler.handlers.local", table) > layer_of("cp_handler.ops.ring", table)
    assert "cp_handler.ops.blocks" in imports_of("cp_handler.ops.ring")
    assert "cp_handler.handlers.base" in imports_of("cp_handler.models.loss")


def test_every_folder_declares_its_layer_and_no_module_stands_loose():
    """The folders are the layers: the bottom (``core``) and the top (the applications) are where the doc puts
    them, and every module but the public face is inside a folder."""
    table = layer_table()
    assert table["core"] == min(table.values()) and table["cli"] == max(table.values()), table
    loose = [name for name, path in MODULES.items() if name != FACE and path.parent == PACKAGE]
    assert not loose, f"modules loose at the top of cp_handler/: {loose}"
    assert all(layer_of(name, table) for name in MODULES)
