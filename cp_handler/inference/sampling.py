"""How :func:`~cp_handler.inference.generate` picks the next token: greedy (the argmax), or a sample from
the logits divided by a temperature, restricted to the ``top_k`` most likely tokens and to the smallest
set whose probability reaches ``top_p`` (nucleus sampling, Holtzman et al. 2020, "The Curious Case of
Neural Text Degeneration"), in the order transformers' ``TemperatureLogitsWarper``,
``TopKLogitsWarper`` and ``TopPLogitsWarper`` apply them.

Under CP every rank holds the same ``(B, V)`` logits; a sample is drawn on the group's rank 0 from a
generator seeded with ``seed`` and broadcast, so the ranks never disagree on a token (their logits may
differ in the last bit, and a draw near a boundary would then pick different tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Sampling:
    """The token choice of a generation run.

    Args:
        temperature: 0 picks the argmax (greedy); > 0 samples from ``softmax(logits / temperature)``.
        top_k: keep the ``top_k`` largest logits (0: all).
        top_p: keep the most likely tokens whose probabilities first reach ``top_p`` (1: all), at least one.
        seed: the seed of the sampling generator (the same run gives the same tokens).

    Raises:
        ValueError: naming the field: ``temperature`` not finite or < 0, ``top_k`` < 0, ``top_p`` outside
            ``(0, 1]``, or ``top_k`` / ``top_p`` with ``temperature=0`` (greedy has nothing to restrict).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature={self.temperature} must be a finite number >= 0 (0: greedy)")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0: every token)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must lie in (0, 1]")
        restrictions = [f"top_k={self.top_k}"] * bool(self.top_k) + [f"top_p={self.top_p}"] * (self.top_p < 1)
        if self.greedy and restrictions:
            raise ValueError(f"{' and '.join(restrictions)} restrict sampling: they need temperature > 0 "
                             "(temperature=0 is greedy)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self, device: torch.device) -> torch.Generator | None:
        """A fresh generator for one run (``None`` when greedy)."""
        return None if self.greedy else torch.Generator(device=device).manual_seed(self.seed)

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """``(B, V)`` float32 logits -> the sampling distribution ``(B, V)`` (zeros outside top-k / top-p)."""
        scores = logits.float()
        # softmax((l - max) / T) = softmax(l / T): the shift keeps a tiny T finite (l / 1e-40 overflows to inf and
        # the softmax to NaN; shifted, the most likely token gets probability 1: greedy, the limit of T -> 0)
        scores = (scores - scores.amax(-1, keepdim=True)) / self.temperature
        if self.top_k and self.top_k < scores.shape[-1]:
            kth = scores.topk(self.top_k, dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, -math.inf)
        if self.top_p < 1:
            ordered, order = scores.sort(dim=-1, descending=True)
            probs = ordered.softmax(-1)
            beyond = probs.cumsum(-1) - probs >= self.top_p  # the mass before it already reaches top_p
            scores = scores.scatter(-1, order, ordered.masked_fill(beyond, -math.inf))
        return scores.softmax(-1)

    def choose(self, logits: torch.Tensor, generator: torch.Generator | None, group=None) -> torch.Tensor:
        """The next token of each row of ``logits (B, V)``: ``(B,)`` int64, the same on every rank of
        ``group`` (a sample is drawn on its rank 0 and broadcast).

        Raises:
            ValueError: a row holds NaN or +inf (on every rank alike, before the broadcast: the logits are
                the same everywhere); -inf is a token the model rules out.
        """
        broken = (logits.isnan() | logits.isposinf()).any(-1).nonzero()
        if broken.numel():
            raise ValueError(f"the logits of sequence {int(broken[0])} hold NaN or +inf: no token can be chosen "
                             "(the model's output is not finite)")
        if self.greedy:
            return logits.argmax(-1)
        tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
        if group is None or dist.get_rank(group) == 0:
            tokens = torch.multinomial(self.probabilities(logits), 1, generator=generator).squeeze(-1)
        if group is not None:
            dist.broadcast(tokens, group=group, group_src=0)
        return tokens
