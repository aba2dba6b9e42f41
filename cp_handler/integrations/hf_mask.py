"""What mask a Hugging Face model asks for, read off its mask function: the guard of the mask half of
attention under CP.

transformers builds every attention mask (causal, sliding window, chunked, bidirectional, image-token
blocks, packed documents, padding) through one interface, keyed by ``attn_implementation``:
``create_causal_mask`` / ``create_sliding_window_causal_mask`` / ``create_chunked_causal_mask`` /
... compose a *mask function* ``f(batch_idx, head_idx, q_idx, kv_idx) -> bool`` and hand it to the
implementation's mask function (``transformers.masking_utils``). For ``"cp_handler"`` that is
:func:`cp_mask`: it materialises nothing and returns a :class:`CPMask` holding ``f``, which the
model passes on to the attention function like any mask. There, with the handler known,
:meth:`CPMask.spec` evaluates ``f`` at *global* positions (the whole sequence, or the longest
document for thd) and classifies it as one of the masks the handler computes:

* ``causal``: ``kv <= q``;
* ``sliding``: ``q - W < kv <= q`` (window ``W``: transformers' convention, ``W`` keys including the
  query's own);
* ``chunked``: causal within chunks of ``C`` positions;
* ``bidirectional``: every pair.

Anything else (a mask that reads per-token tensors, e.g. image-token blocks or packed-document ids
derived from position ids; padding; an offset from a KV cache; a pattern none of the four fits) is
``unknown`` with the reason, and the attention refuses it. So a mask feature added by a future
transformers release is refused, not dropped: the check reads what the mask *is*, not which config
field made it.

The probe: the last query's whole row gives the window (the keys it sees up to its diagonal) and each query's step
back the first chunk boundary; then one evaluation of the pairs every candidate must match: up to
:data:`DENSE_QUERIES` queries (all of them below that length; past it the first and last 1,024 and 2,048 evenly
spaced) at distances -2..64, powers of two +-1 up to ``n``, and each candidate's size -1, +0, +1, and whole rows at
three positions. A mask function that holds a tensor (data it may index per token) has every query probed at the
band distances (-2..2 and the candidates' sizes +-1): a block of per-token data shows as a key masked at distance 0
or a boundary at distance 1 wherever it is. About ``80 n`` mask evaluations up to 4,096 positions; past it about
``3 n + 400k`` (a function of positions alone) or ``14 n + 400k`` (one holding a tensor); the time per
forward is in docs/huggingface.md.

Each mask is classified once per forward (memoised on its :class:`CPMask`), and never from another forward's
answer: nothing is cached across forwards, so no key has to prove two mask functions equal (a mask reading per-batch
data, a global changed between forwards, an object's state are all read as they are now).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .hf_active import active_handler

_SMALL_DISTANCES = range(-2, 65)
_BAND = range(-2, 3)
"""Distances probed at every query, whatever the length (with each candidate's size - 1, size and size + 1)."""


@dataclass(frozen=True)
class MaskSpec:
    """A mask the handler computes: ``kind`` in causal / sliding / chunked / bidirectional / unknown;
    ``size`` the window or chunk; ``reason`` why an unknown mask is not one of them."""

    kind: str
    size: int | None = None
    reason: str = ""

    def describe(self) -> str:
        if self.kind == "sliding":
            return f"a sliding window of {self.size} positions"
        if self.kind == "chunked":
            return f"chunked attention (chunks of {self.size} positions)"
        if self.kind == "unknown":
            return f"a mask cp_handler cannot express ({self.reason})"
        return f"a {self.kind} mask"


class MaskUsedAsTensor(ValueError, AttributeError):
    """A model used the attention mask as a tensor (it builds or edits masks itself)."""


class CPMask:
    """The mask a model asked for, as transformers' mask function: what ``cp_mask`` returns and the
    attention function receives as ``attention_mask``. Not a tensor: nothing ``S x S`` is built, and a
    model that reads it as one (slices it, adds to it, asks its dtype) gets :class:`MaskUsedAsTensor`
    (a ValueError) naming what it tried: such a model edits masks itself and is not supported."""

    def __init__(self, mask_function, q_offset: int, kv_offset: int, padding_mask: torch.Tensor | None,
                 handler=None):
        self.mask_function, self.q_offset, self.kv_offset = mask_function, q_offset, kv_offset
        self.forward_handler = handler
        """The handler active in the forward that built this mask (``None``: none was), for a layer
        recomputed in the backward (gradient checkpointing), when no forward is running."""
        self.padding = padding_mask is not None and not bool(padding_mask.all())
        self._specs: dict[int, MaskSpec] = {}
        self.longest: int | None = None
        """The global length the mask was classified over where it was built (:func:`classify_at_creation`)."""
        self.created: MaskSpec | None = None
        """Its spec over ``longest`` positions, classified where it was built (``None``: no handler then)."""

    def _refuse(self, what: str):
        raise MaskUsedAsTensor(f"the model used its attention mask as a tensor ({what}): it builds or edits masks "
                               "itself, which cp_handler cannot carry across ranks; the model is not supported under "
                               "context parallelism")

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        self._refuse(f"attribute {name!r}")

    def __getitem__(self, index):
        self._refuse("indexing")

    def __add__(self, other):
        self._refuse("+")

    __radd__ = __mul__ = __rmul__ = __and__ = __rand__ = __or__ = __ror__ = __sub__ = __rsub__ = __add__

    def spec(self, n: int) -> MaskSpec:
        """The mask over global positions ``[0, n)`` (memoised per ``n``: once per mask and forward)."""
        if n not in self._specs:
            self._specs[n] = self._refusal() or classify(self.mask_function, n)
        return self._specs[n]

    def _refusal(self) -> MaskSpec | None:
        """The ``unknown`` spec of a mask refused without probing (padding, a KV-cache offset, per-token data)."""
        if self.padding:
            return MaskSpec("unknown", reason="the attention_mask marks padding tokens; pack documents with "
                                              "qkv_format='thd' instead of padding them")
        if self.q_offset or self.kv_offset:
            return MaskSpec("unknown", reason=f"query/key offsets {self.q_offset}/{self.kv_offset} (a KV cache)")
        per_token = _per_token_tensors(self.mask_function)
        if per_token:
            return MaskSpec("unknown", reason=f"it reads per-token tensors of shapes {per_token} (image-token "
                                              "blocks, or documents re-derived from position ids: pass "
                                              "cp_model_inputs(handler, input_ids) to the model)")
        return None


def cp_mask(batch_size=None, q_length=None, kv_length=None, q_offset=0, kv_offset=0, mask_function=None,
            attention_mask=None, **kwargs) -> CPMask:
    """transformers mask function of ``attn_implementation="cp_handler"`` (``AttentionMaskInterface``):
    returns a :class:`CPMask` (the other keyword arguments are transformers' sizing hints for
    materialised masks, which are not built)."""

    mask = CPMask(mask_function, int(q_offset), int(kv_offset), attention_mask, active_handler())
    if mask.forward_handler is not None and q_length is not None:
        classify_at_creation(mask, int(q_length))
    return mask


# torch.compiler.disable, applied at the first call: the public decorator imports torch._dynamo where it decorates
# (1.4 s of every process's `import cp_handler`, launchers and ranks that never compile included); torch's own
# lazy form is the same disable (torch/_compile.py), and a compiled caller still runs this outside its graphs
# (tests/test_compile.py).
@torch._disable_dynamo
def classify_at_creation(mask: CPMask, q_length: int) -> None:
    """Classify ``mask`` where it is built, for its forward's handler and ``q_length`` local queries: the
    attention function finds the spec memoised (eager), or reads it from ``mask.created`` (under torch.compile,
    where probing cannot be traced; a whole-model compile runs this outside its graphs)."""
    handler = mask.forward_handler
    mask.longest = handler.token_layout.max_seqlen or handler.get_rotary_seq_len(q_length)
    mask.created = mask.spec(mask.longest)


def _closure_tensors(mask_function):
    """Every tensor ``mask_function`` (and the functions and sequences it closes over) holds, once each."""
    seen, stack = set(), [mask_function]
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            yield item
        elif callable(item) and getattr(item, "__closure__", None):
            stack += [cell.cell_contents for cell in item.__closure__ if _filled(cell)]
        elif isinstance(item, (list, tuple)):
            stack += list(item)


def _per_token_tensors(mask_function) -> list[tuple[int, ...]]:
    """Shapes of the tensors with two or more dims that ``mask_function`` (and the functions it
    composes) close over: a mask that indexes per-token data by position."""
    return [tuple(t.shape) for t in _closure_tensors(mask_function) if t.dim() >= 2]


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - raises for an empty cell
    except ValueError:
        return False
    return True


def _device(mask_function) -> torch.device:
    """Where the mask function's tensors live (positions are probed there), else CPU."""
    return next((t.device for t in _closure_tensors(mask_function)), torch.device("cpu"))


def _distances(n: int) -> list[int]:
    powers = {p + e for k in range(1, max(2, n.bit_length() + 1)) for p in (1 << k,) for e in (-1, 0, 1)}
    return sorted(d for d in {*_SMALL_DISTANCES, *powers, n - 1} if -n < d < n)


DENSE_QUERIES = 4096
"""Up to this many positions every query is probed at every distance; past it, every query at the band distances
and :data:`DENSE_QUERIES` of them (the first and last quarter of that many, the rest evenly spaced) at every
distance (module doc)."""


def _sampled_queries(n: int, device) -> torch.Tensor:
    if n <= DENSE_QUERIES:
        return torch.arange(n, device=device)
    edge = DENSE_QUERIES // 4
    spaced = torch.linspace(edge, n - edge - 1, DENSE_QUERIES - 2 * edge, device=device).long()
    return torch.cat([torch.arange(edge, device=device), spaced, torch.arange(n - edge, n, device=device)]).unique()


def _grid(queries: torch.Tensor, distances: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, kv)``: each of ``queries`` against the key ``distances`` before it (distance-major), keys inside
    ``[0, n)``."""
    d = torch.tensor(distances, dtype=torch.long, device=queries.device).repeat_interleave(len(queries))
    q = queries.repeat(len(distances))
    kv = q - d
    keep = (kv >= 0) & (kv < n)
    return q[keep], kv[keep]


def classify(mask_function, n: int) -> MaskSpec:
    """Classify ``mask_function`` over global positions ``[0, n)`` (see the module doc: the candidates from the
    last query's row and each query's step back, then one evaluation of every probed pair). A function that cannot
    be evaluated on position tensors is ``unknown``."""
    device = _device(mask_function)
    zero = torch.zeros((), dtype=torch.long, device=device)
    positions = torch.arange(n, device=device)

    def f(q, kv):
        return torch.as_tensor(mask_function(zero, zero, q, kv), device=device).expand(q.shape).cpu()

    try:
        last_row = f(torch.full((n,), n - 1, device=device), positions)  # the last query against every key
        step = f(positions[1:], positions[:-1])  # may each query see the position just before it?
    except Exception as err:  # noqa: BLE001 - any failure means the mask is not a function of positions alone
        return _unevaluable(err)
    candidates = [MaskSpec("causal"), MaskSpec("bidirectional")]  # the narrowest first: the first match returns
    window = int(last_row.flip(0).long().cumprod(0).sum())  # keys the last query sees up to its diagonal
    if 0 < window < n:
        candidates.insert(0, MaskSpec("sliding", window))
    if not bool(step.all()):
        candidates.insert(0, MaskSpec("chunked", int(torch.nonzero(~step)[0]) + 1))
    band = sorted(d for d in {*_BAND, *(s.size + e for s in candidates if s.size for e in (-1, 0, 1))} if -n < d < n)
    far = [d for d in _distances(n) if d not in band]
    sampled = _sampled_queries(n, device)
    holds_data = next(_closure_tensors(mask_function), None) is not None  # per-token data: the band at every query
    grids = [_grid(sampled, sorted(band + far), n)] if len(sampled) == n or not holds_data else \
        [_grid(positions, band, n), _grid(sampled, far, n)]
    rows = torch.tensor([n // 2, n // 3], device=device).repeat_interleave(n)  # whole rows (the last one above)
    q, kv = torch.cat([*(g[0] for g in grids), rows]), torch.cat([*(g[1] for g in grids), positions.repeat(2)])
    try:
        got = f(q, kv)
    except Exception as err:  # noqa: BLE001
        return _unevaluable(err)
    q, kv = torch.cat([q.cpu(), torch.full((n,), n - 1)]), torch.cat([kv.cpu(), torch.arange(n)])
    got = torch.cat([got, last_row])
    for spec in candidates:
        if torch.equal(got, expected(spec, q, kv)):
            return spec
    return MaskSpec("unknown", reason=_difference(q, kv, got))


def expected(spec: MaskSpec, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """``spec`` at query positions ``q`` and key positions ``kv`` (bool)."""
    if spec.kind == "bidirectional":
        return torch.ones_like(q, dtype=torch.bool)
    causal = kv <= q
    if spec.kind == "sliding":
        return causal & (kv > q - spec.size)
    if spec.kind == "chunked":
        return causal & (kv // spec.size == q // spec.size)
    return causal


def _unevaluable(err: Exception) -> MaskSpec:
    return MaskSpec("unknown", reason=f"evaluating it on positions failed ({type(err).__name__}: {err})")


def _difference(q: torch.Tensor, kv: torch.Tensor, got: torch.Tensor) -> str:
    bad = torch.nonzero(got != expected(MaskSpec("causal"), q, kv))
    if not len(bad):
        return "it fits none of the masks"
    i = int(bad[0])
    return (f"it {'allows' if bool(got[i]) else 'masks'} query {int(q[i])} -> key {int(kv[i])}, which fits no "
            "causal, sliding-window, chunked or bidirectional mask")
