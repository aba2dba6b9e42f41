"""The names of the communication patterns (``cp_comm_type``), as data: the config's rules read them here, and
:data:`cp_handler.ops.patterns.PATTERNS` (the algorithms) is keyed by exactly these names, checked when it loads.
A new pattern is its ops file, one entry in ``PATTERNS`` and its name here."""

CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
"""The ``cp_comm_type`` values: ``p2p``, ``all_gather``, ``a2a``, ``a2a+p2p`` (Transformer Engine's and
Megatron-LM's names), one per entry of :data:`~cp_handler.ops.patterns.PATTERNS`."""

HIERARCHICAL_COMM_TYPES = ("a2a+p2p",)
"""The patterns that run on two levels of groups (``hierarchical_context_parallel_sizes``: a2a inner, p2p outer)."""

AUTO = "auto"
"""``cp_comm_type="auto"``: the handler picks one of ``CP_COMM_TYPES`` per call from a cost profile
(:mod:`cp_handler.auto`); accepted wherever a comm type is, per layer too, by the handlers that list it (the local
one)."""

COMM_TYPE_CHOICES = (*CP_COMM_TYPES, AUTO)
"""Every value ``cp_comm_type`` may take: a pattern, or ``"auto"``."""

CANONICAL_COMM_TYPES = ("all_gather", "p2p", "a2a+p2p")
"""The patterns whose deterministic computation runs on canonical tiles alone (:mod:`cp_handler.ops.canonical`):
sequences and packed documents, sinks too; ``"a2a"`` runs packed documents and sinks with one process's blockwise
plan instead (each rank's heads over the whole sequence)."""
