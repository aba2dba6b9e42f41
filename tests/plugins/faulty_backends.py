"""Faulty backends for cp-train's failure and parity tests, loaded into every rank through
``CP_HANDLER_PLUGINS=faulty_backends`` (tests/test_cli.py puts this folder on PYTHONPATH). Fault
injection lives here, in the tests, not in the product's training path.

* ``rope_bug``: rank 1's tokens get RoPE positions shifted by one (an off-by-one a CP implementation
  can make); at cp=1 the shift is a no-op, so a reference sharing this code would miss it;
* ``soft_bug``: attention output scaled by 1.001 on every rank and at every cp (a bug a same-code
  reference shares);
* ``fail_rank``: rank 1 raises when its first handler is built;
* ``freeze_rank``: rank 1 stops itself (SIGSTOP) when its first handler is built, as a hung process;
* ``nan_bug``: attention output NaN (a diverged run).
"""

import os
import signal

import torch

from cp_handler import LocalContextParallelHandler, register_cp_handler


class RopeBug(LocalContextParallelHandler):
    def get_emb_on_this_cp_rank(self, emb):
        return super().get_emb_on_this_cp_rank(torch.roll(emb, 1, 0) if self.cp_rank == 1 else emb)


class SoftBug(LocalContextParallelHandler):
    def core_attn(self, attn_mod, q, k, v, **kwargs):
        return super().core_attn(attn_mod, q, k, v, **kwargs) * 1.001


class FailRank(LocalContextParallelHandler):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        if self.cp_rank == 1:
            raise RuntimeError("injected failure on rank 1 (faulty_backends.fail_rank)")


class FreezeRank(LocalContextParallelHandler):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        if self.cp_rank == 1:
            os.kill(os.getpid(), signal.SIGSTOP)


for name, cls in (("rope_bug", RopeBug), ("soft_bug", SoftBug), ("fail_rank", FailRank), ("freeze_rank", FreezeRank)):
    register_cp_handler(name, cls)


class NanBug(LocalContextParallelHandler):
    """Attention output NaN: the loss of the first step is not finite."""

    def core_attn(self, attn_mod, q, k, v, **kwargs):
        return super().core_attn(attn_mod, q, k, v, **kwargs) * float("nan")


register_cp_handler("nan_bug", NanBug)
