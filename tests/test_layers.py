"""The package's layers (docs/architecture.md, "Layers"): every module imports only from its own layer or
the ones below, and no modules import each other in a circle, lazy imports inside functions included; and
no library file grows past ``MAX_LINES`` (a file that long holds more than one idea: split it).

The layer table is read from docs/architecture.md, so the doc and the code cannot drift apart: a module
the table does not cover fails here, as does an import that runs up a layer.
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).parent.parent
PACKAGE = ROOT / "cp_handler"


def layer_table() -> dict[str, int]:
    """``{path under cp_handler/: layer}`` from the doc's table."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    section = doc.split("## Layers", 1)[1].split("\n## ", 1)[0]
    table = {}
    for layer, paths in re.findall(r"^\| (\d+) \|[^|]*\| (.*) \|$", section, re.M):
        for path in re.findall(r"`([^`]+)`", paths):
            table[path] = int(layer)
    assert table, "no layer table in docs/architecture.md"
    return table


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def layer_of(name: str, table: dict[str, int]) -> int:
    path = str(MODULES[name].relative_to(PACKAGE))
    matches = [p for p in table if path == p or (p.endswith("/") and path.startswith(p))]
    assert matches, f"{path} has no layer in docs/architecture.md's table"
    return table[max(matches, key=len)]


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
MAX_LINES = 300


def test_no_library_file_is_longer_than_max_lines():
    lengths = {str(path.relative_to(ROOT)): len(path.read_text().splitlines()) for path in MODULES.values()}
    assert lengths, "no library files found"
    assert not {path: n for path, n in lengths.items() if n > MAX_LINES}


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
    assert "cp_handler.handlers.base" in imports_of("cp_handler.loss")
