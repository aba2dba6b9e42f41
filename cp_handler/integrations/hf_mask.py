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

The probe: every query position ``P < n`` against keys ``P - d`` for ``d`` in a fixed set (-2..64,
powers of two +-1 up to ``n``), plus whole rows at the last and a few other positions; each candidate
then has to match at every probed pair. Cost about ``80 n`` mask evaluations (``n`` = 1024 to 2048).

The model builds a new mask function every forward, so the classification is cached (:func:`classified`)
under a key of *everything the function can read* (:func:`reads_key`): its code, defaults and closure
values, recursively through the functions it composes, the globals and builtins its code names (and
those names' attributes of modules and classes it reads), and the content of every tensor it holds. A
second forward with the same layout and the same mask is not probed again (0 evaluations); a mask that
reads per-batch data (image-token blocks, documents from position ids, a left-padding tensor) gets its
batch's content in the key, so two batches with the same layout but other contents are classified
apart. A function holding anything else (an object of another type, a large tensor) has no key and is
probed every time: a wrong cache hit is impossible by construction, not by a list of known cases.
"""

from __future__ import annotations

import functools
import hashlib
import types
from collections import OrderedDict
from dataclasses import dataclass

import torch

from .hf_active import active_handler

_SMALL_DISTANCES = range(-2, 65)


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
        """The mask over global positions ``[0, n)`` (memoised per ``n``; probed through :func:`classified`)."""
        if n not in self._specs:
            self._specs[n] = self._refusal() or classified(self.mask_function, n)
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


CACHE_SIZE = 256
"""Classifications kept by :func:`classified` (least recently used dropped first)."""
_cache: OrderedDict = OrderedDict()


def classified(mask_function, n: int) -> MaskSpec:
    """:func:`classify`, cached under ``(reads_key(mask_function), n)``; a function without a key is
    classified every time."""
    key = reads_key(mask_function)
    if key is None:
        return classify(mask_function, n)
    key = (key, n)
    if key in _cache:
        _cache.move_to_end(key)
        return _cache[key]
    spec = _cache[key] = classify(mask_function, n)
    if len(_cache) > CACHE_SIZE:
        _cache.popitem(last=False)
    return spec


KEY_OBJECTS = 512
"""Most objects :func:`reads_key` visits for one mask function (more: no key)."""
KEY_TENSOR_ELEMENTS = 1 << 16
"""Largest tensor :func:`reads_key` keys by content (larger: no key)."""
_VALUES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout,
           torch.memory_format)
_DESCRIPTORS = (types.MethodDescriptorType, types.WrapperDescriptorType, types.GetSetDescriptorType,
                types.MemberDescriptorType, types.ClassMethodDescriptorType)


class _Unkeyable(Exception):
    """Something a mask function can read whose value no key captures."""


def reads_key(mask_function) -> tuple | None:
    """A hashable key equal for two mask functions only if they compute the same thing: the key of
    everything the function can read (module doc), ``None`` when it can read something no key captures.

    Keyed by value: ``None``, numbers, strings, bytes, dtypes and devices (exactly those types); tuples,
    lists, sets and dicts of keyable items; tensors of type ``torch.Tensor`` up to
    :data:`KEY_TENSOR_ELEMENTS` elements (dtype, shape, device and content, the latter by its BLAKE2b-256 digest:
    a cached key holds 32 bytes per tensor, and two contents share a key only by a hash collision). Python functions,
    ``functools.partial`` objects and bound methods through their parts: code (compared as CPython compares
    code objects: bytecode, constants, names), defaults, attributes, closure cells, and every name the code
    (and the code nested in it) loads, as a global, a builtin, or an attribute of a module or class reached
    that way. Modules, classes, unbound C functions and method descriptors by identity (a module's or class's
    attributes the code names, by value); a C method bound to an object (``tensor.sum``) by its name and that
    object. Anything else (an instance of another class, a larger tensor, a tensor that cannot be read on
    the CPU) makes the key ``None``.
    """
    try:
        return _key(mask_function, frozenset(), {})
    except Exception:  # noqa: BLE001 - _Unkeyable, or reading a value failed: no key, the function is probed
        return None


def _names(code: types.CodeType) -> frozenset:
    """Every name ``code`` and the code objects nested in it load (globals, builtins, attributes)."""
    nested = (_names(c) for c in code.co_consts if isinstance(c, types.CodeType))
    return frozenset(code.co_names).union(*nested)


def _loaded(names: frozenset, spaces: list[dict], visited: dict) -> tuple:
    """``(name, key)`` of each of ``names`` found in ``spaces`` (the first that has it)."""
    found = {n: next(space[n] for space in spaces if n in space) for n in sorted(names)
             if any(n in space for space in spaces)}
    return tuple((n, _key(v, names, visited)) for n, v in found.items())


def _key(value, names: frozenset, visited: dict):
    """The key of ``value``, read by code that loads ``names`` (module and class attributes); ``visited``: the
    objects keyed so far (a second visit gives a reference to the first: cycles, shared objects)."""
    if type(value) in _VALUES:
        return (type(value), value)
    namespace = isinstance(value, (types.ModuleType, type))
    seen = (id(value), names) if namespace else id(value)  # a namespace again, with other names: its attributes
    if seen in visited:
        return ("seen", visited[seen])
    if len(visited) >= KEY_OBJECTS:
        raise _Unkeyable
    visited[seen] = len(visited)
    if type(value) in (tuple, list, set, frozenset):
        items = [_key(v, names, visited) for v in value]
        return (type(value), tuple(sorted(items, key=repr)) if type(value) in (set, frozenset) else tuple(items))
    if type(value) is dict:
        return (dict, tuple((_key(k, names, visited), _key(v, names, visited)) for k, v in value.items()))
    if type(value) is torch.Tensor:
        if value.numel() > KEY_TENSOR_ELEMENTS:
            raise _Unkeyable
        data = value.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
        data = hashlib.blake2b(data, digest_size=32).digest()  # 32 bytes kept per tensor, not its content
        return (torch.Tensor, value.dtype, tuple(value.shape), value.device, data)
    if type(value) is types.FunctionType:
        return _function_key(value, visited)
    if type(value) is functools.partial:
        return (functools.partial, _key(value.func, names, visited), _key(value.args, names, visited),
                _key(value.keywords, names, visited))
    if type(value) is types.MethodType:
        return (types.MethodType, _key(value.__func__, names, visited), _key(value.__self__, names, visited))
    if type(value) is types.BuiltinFunctionType:  # a C function, or a C method bound to an object (tensor.sum)
        owner = value.__self__
        if owner is None or isinstance(owner, (types.ModuleType, type)):
            return (types.BuiltinFunctionType, value)
        return (types.BuiltinFunctionType, value.__name__, _key(owner, names, visited))
    if type(value) in _DESCRIPTORS:
        return (type(value), value)
    if namespace:  # by identity, with the attributes the code names (a class's: its own, its bases', its metaclass's)
        classes = (*value.__mro__, *type(value).__mro__) if isinstance(value, type) else ()
        spaces = [vars(value)] if not classes else [vars(k) for k in classes]
        return (type(value), value, _loaded(names, spaces, visited))
    raise _Unkeyable


def _function_key(function: types.FunctionType, visited: dict) -> tuple:
    """A Python function's key: its code, defaults, attributes, closure cells and the globals and builtins its
    code loads (:func:`reads_key`)."""
    code, names = function.__code__, _names(function.__code__)
    closure = function.__closure__ or ()
    cells = tuple(_key(c.cell_contents, names, visited) if _filled(c) else ("empty",) for c in closure)
    space = function.__builtins__
    spaces = [function.__globals__, vars(space) if isinstance(space, types.ModuleType) else space]
    return (types.FunctionType, code, _key(function.__defaults__, names, visited),
            _key(function.__kwdefaults__, names, visited), _key(vars(function), names, visited), cells,
            _loaded(names, spaces, visited))


def classify(mask_function, n: int) -> MaskSpec:
    """Classify ``mask_function`` over global positions ``[0, n)`` (see the module doc). A function
    that cannot be evaluated on position tensors is ``unknown``."""
    device = _device(mask_function)
    zero = torch.zeros((), dtype=torch.long, device=device)
    positions = torch.arange(n, device=device)

    def f(q, kv):
        return torch.as_tensor(mask_function(zero, zero, q, kv), device=device).expand(q.shape).cpu()

    pairs = [(positions[max(d, 0): n + min(d, 0)], d) for d in _distances(n)]
    pairs = [(q, q - d) for q, d in pairs]
    pairs += [(torch.full((n,), p, device=device), positions) for p in sorted({n - 1, n // 2, n // 3})]
    try:
        probes = [(q.cpu(), kv.cpu(), f(q, kv)) for q, kv in pairs]
    except Exception as err:  # noqa: BLE001 - any failure means the mask is not a function of positions alone
        return MaskSpec("unknown", reason=f"evaluating it on positions failed ({type(err).__name__}: {err})")
    last_row = probes[-1][2]  # the query at n - 1 against every key (the rows are probed last, in order)
    candidates = [MaskSpec("causal"), MaskSpec("bidirectional")]
    window = int(last_row.flip(0).long().cumprod(0).sum())  # keys the last query sees up to its diagonal
    if 0 < window < n:
        candidates.append(MaskSpec("sliding", window))
    step = f(positions[1:], positions[:-1])  # may each query see the position just before it?
    if not bool(step.all()):
        candidates.append(MaskSpec("chunked", int(torch.nonzero(~step)[0]) + 1))
    for spec in candidates:
        if all(torch.equal(got, expected(spec, q, kv)) for q, kv, got in probes):
            return spec
    return MaskSpec("unknown", reason=_difference(probes))


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


def _difference(probes) -> str:
    for q, kv, got in probes:
        bad = torch.nonzero(got != expected(MaskSpec("causal"), q, kv))
        if len(bad):
            i = int(bad[0])
            return (f"it {'allows' if bool(got[i]) else 'masks'} query {int(q[i])} -> key {int(kv[i])}, which fits "
                    "no causal, sliding-window, chunked or bidirectional mask")
    return "it fits none of the masks"
