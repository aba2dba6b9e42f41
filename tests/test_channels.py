"""The measures of issue 70 that a later change could quietly undo, held by reading the source (no ranks, no
imports of the library): at most one context variable in the library; outside ``cp_handler/handlers/`` a token
layout is read only through its public API (docs/api.md "The token layout": no ``getattr`` into it, no other
attribute), a backend's module that defines its own layout apart (cp-generate's decode step); and nothing outside
``cp_handler/handlers/`` writes a private attribute on a handler. Each check is also run on a planted source that
breaks it (negative controls)."""

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).parent.parent
PACKAGE = ROOT / "cp_handler"
HANDLERS = PACKAGE / "handlers"

LAYOUT_API = frozenset({
    # the contract's six layout methods, which the handler's public methods run
    "dispatch", "combine", "roll_tensor", "get_rotary_seq_len", "get_emb_on_this_cp_rank", "apply_rotary_pos_emb",
    # what code outside a handler may ask (docs/api.md "The token layout")
    "positions", "real_token_mask", "max_seqlen", "document_lengths", "padded_document_lengths", "token_index",
    "max_position", "set_max_position",
})
"""The attributes of ``handler.token_layout`` code outside ``cp_handler/handlers/`` may read."""


def _text(node: ast.AST) -> str:
    return ast.unparse(node)


@functools.cache
def _parse(source: str) -> ast.Module:
    return ast.parse(source)


def context_variables(source: str) -> int:
    """Calls of ``ContextVar(...)`` (``contextvars.ContextVar`` or the bare name)."""
    return sum(isinstance(n, ast.Call) and _text(n.func).split(".")[-1] == "ContextVar"
               for n in ast.walk(_parse(source)))


def layout_reads(source: str) -> list[str]:
    """Reads of a token layout outside its public API: ``<x>.token_layout.<name>`` and ``<v>.<name>`` for a name
    ``v`` bound to ``<x>.token_layout`` in the module, with ``name`` not in :data:`LAYOUT_API`; every
    ``getattr`` / ``setattr`` / ``hasattr`` on one."""
    tree = _parse(source)
    is_layout = lambda node: isinstance(node, ast.Attribute) and node.attr == "token_layout"  # noqa: E731
    bound = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) and is_layout(n.value)
             for t in n.targets if isinstance(t, ast.Name)}
    layout = lambda node: is_layout(node) or isinstance(node, ast.Name) and node.id in bound  # noqa: E731
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and layout(node.value) and node.attr not in LAYOUT_API:
            found.append(f"line {node.lineno}: {_text(node)}")
        if isinstance(node, ast.Call) and _text(node.func) in ("getattr", "setattr", "hasattr") and node.args \
                and layout(node.args[0]):
            found.append(f"line {node.lineno}: {_text(node)}")
    return found


def private_handler_writes(source: str) -> list[str]:
    """Private attributes written on a handler: ``<...handler...>._name = ...`` (assignment, augmented or
    annotated) and ``setattr(<...handler...>, "_name", ...)``, a handler being any expression whose text names one
    (``handler``, ``self.handler``, ``cp_handler``, ``sharded.handler``)."""
    found = []
    for node in ast.walk(_parse(source)):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            if isinstance(target, ast.Attribute) and target.attr.startswith("_") \
                    and "handler" in _text(target.value).lower():
                found.append(f"line {node.lineno}: {_text(target)}")
        if isinstance(node, ast.Call) and _text(node.func) == "setattr" and len(node.args) >= 2 \
                and "handler" in _text(node.args[0]).lower() and isinstance(node.args[1], ast.Constant) \
                and str(node.args[1].value).startswith("_"):
            found.append(f"line {node.lineno}: {_text(node)}")
    return found


@functools.cache
def _library(outside_handlers: bool) -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))
            if not (outside_handlers and HANDLERS in p.parents)}


def test_at_most_one_context_variable():
    counts = {path: n for path, source in _library(False).items() if (n := context_variables(source))}
    assert sum(counts.values()) <= 1, f"context variables in the library (issue 70: at most one): {counts}"


def defines_a_layout(source: str) -> bool:
    """Whether the module defines a subclass of ``TokenLayout`` (a backend with its own placement of tokens)."""
    return any(isinstance(n, ast.ClassDef) and any(_text(b).endswith("TokenLayout") for b in n.bases)
               for n in ast.walk(_parse(source)))


def test_layouts_are_read_through_their_public_api():
    found = {path: reads for path, source in _library(True).items()
             if not defines_a_layout(source) and (reads := layout_reads(source))}
    assert any(defines_a_layout(source) for source in _library(True).values()), "the decode step's layout not found"
    assert not found, f"token layouts read outside their public API (docs/api.md 'The token layout'): {found}"


def test_no_private_attribute_is_written_on_a_handler():
    found = {path: writes for path, source in _library(True).items() if (writes := private_handler_writes(source))}
    assert not found, f"private attributes written on a handler: {found}"


def test_the_checks_see_what_they_forbid():
    """Negative controls: each pattern the checks forbid is found in a planted source, and the allowed forms are
    not."""
    planted = ("import contextvars\nfrom contextvars import ContextVar\n"
               "a = contextvars.ContextVar('a')\nb = ContextVar('b')\n")
    assert context_variables(planted) == 2
    reads = layout_reads("x = h.token_layout.thd_layout\nlayout = handler.token_layout\ny = layout.cu_seqlens_padded\n"
                         "z = getattr(handler.token_layout, 'max_seqlen', None)\n"
                         "ok = layout.positions(4), handler.token_layout.document_lengths\n")
    assert [r.split(":")[0] for r in reads] == ["line 1", "line 3", "line 4"], reads
    writes = private_handler_writes("handler._cp_max_position = 3\nself.handler._x += 1\n"
                                    "setattr(cp_handler, '_y', 2)\nhandler.public = 1\nself._z = 2\n")
    assert [w.split(":")[0] for w in writes] == ["line 1", "line 2", "line 3"], writes
