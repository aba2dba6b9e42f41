"""The one factory: ``get_cp_handler_cls(backend, cp_comm_type)``, and ``register_cp_handler``.

A new backend is a subclass of :class:`ContextParallelHandler` plus one ``register_cp_handler``
call, from any package; no edit to models or to this file.
"""

from __future__ import annotations

import importlib
import os

from ..runtime.config import COMM_TYPE_CHOICES, as_comm_type_list
from .base import ContextParallelHandler

_REGISTRY: dict[tuple[str, str], type[ContextParallelHandler]] = {}

PLUGINS_ENV = "CP_HANDLER_PLUGINS"
"""Comma-separated modules that ``cp-train`` imports (in the launcher and in every rank) before it
checks flags or builds handlers: a module registering its own backend makes ``--backend NAME`` work."""


def load_plugins() -> list[str]:
    """Import the modules named in ``CP_HANDLER_PLUGINS`` (idempotent); returns their names.

    Raises:
        ImportError: naming the module and the variable.
    """
    names = [n.strip() for n in os.environ.get(PLUGINS_ENV, "").split(",") if n.strip()]
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as err:
            raise ImportError(f"{PLUGINS_ENV}: cannot import plugin module {name!r} ({err})") from err
    return names


def register_cp_handler(
    backend: str, cls: type[ContextParallelHandler], comm_types: tuple[str, ...] | list[str] | None = None
) -> type[ContextParallelHandler]:
    """Register ``cls`` as the handler of ``backend`` for each of ``comm_types`` (default: every comm type the
    class runs, ``cls.cp_comm_types``); returns ``cls``.

    Raises:
        TypeError: ``cls`` is not a ContextParallelHandler subclass.
        ValueError: an unknown comm type, or one the class does not run.
    """
    if not (isinstance(cls, type) and issubclass(cls, ContextParallelHandler)):
        raise TypeError(f"register_cp_handler needs a ContextParallelHandler subclass, got {cls!r}")
    for comm_type in cls.cp_comm_types if comm_types is None else comm_types:
        if comm_type not in COMM_TYPE_CHOICES:
            raise ValueError(f"cp_comm_type={comm_type!r} is not one of {COMM_TYPE_CHOICES}")
        if comm_type not in cls.cp_comm_types:
            raise ValueError(f"register_cp_handler({backend!r}, {cls.__name__}): comm_types names {comm_type!r}, but "
                             f"the class runs {list(cls.cp_comm_types)} (its cp_comm_types)")
        _REGISTRY[(backend, comm_type)] = cls
    return cls


def registered_backends() -> list[str]:
    """Names of every registered backend."""
    return sorted({backend for backend, _ in _REGISTRY})


def get_cp_handler_cls(backend: str, cp_comm_type: str | list[str]) -> type[ContextParallelHandler]:
    """The handler class registered for ``backend`` and ``cp_comm_type`` (one value, or one entry per layer).
    The comm type is data on the handler, not on the class: build it with the same value
    (``get_cp_handler_cls("local", "a2a")(cp_group=g, cp_comm_type="a2a")``, or :func:`build_cp_handler`,
    which passes the config's); at cp > 1 a handler built without one raises ValueError naming
    ``cp_comm_type`` (it would run another algorithm than the one named here).

    For a per-layer list, the class registered for every entry must be one class, or one class
    that derives from all the others (it then serves every layer).

    Raises:
        ValueError: unknown backend (lists the registered ones), or a comm type it does not support.
    """
    if backend not in registered_backends():
        raise ValueError(f"backend={backend!r} is not registered; registered backends: {registered_backends()}")
    types = as_comm_type_list(cp_comm_type)
    classes = []
    for comm_type in types:
        if (backend, comm_type) not in _REGISTRY:
            supported = sorted(c for b, c in _REGISTRY if b == backend)
            raise ValueError(
                f"backend={backend!r} has no handler for cp_comm_type={comm_type!r}; it supports {supported}"
            )
        classes.append(_REGISTRY[(backend, comm_type)])
    for candidate in classes:
        if all(issubclass(candidate, other) for other in classes):
            return candidate
    raise ValueError(
        f"cp_comm_type={types} needs handlers {sorted({c.__name__ for c in classes})} of backend={backend!r}, "
        "and none of them serves every layer"
    )


def build_cp_handler(config, cp_group=None, hierarchical_cp_groups=None, attn_shape=None, **batch):
    """The one way the library builds a handler: the class of ``config.backend`` and
    ``config.cp_comm_type`` (:func:`get_cp_handler_cls`), built by its ``from_config`` with the run's
    groups and this batch's metadata (used by cp-train, dynamic CP, evaluation at another CP degree,
    cp-bench and the Hugging Face integration).

    Args:
        config: a :class:`~cp_handler.runtime.config.ContextParallelConfig` (backend, comm type, qkv_format).
        cp_group: this rank's CP group (``None``: cp=1).
        hierarchical_cp_groups: this rank's groups per hierarchical level, inner first.
        attn_shape: the model's :class:`~cp_handler.runtime.config.AttentionShape` (MagiAttention plans with it).
        **batch: ``cu_seqlens`` for thd, ``qkv_format`` to override the config's, backend arguments.

    Raises:
        ValueError / TypeError: the factory's or the handler's checks.
    """
    cls = get_cp_handler_cls(config.backend, config.cp_comm_type)
    return cls.from_config(config, cp_group=cp_group, hierarchical_cp_groups=hierarchical_cp_groups,
                           attn_shape=attn_shape, **batch)
