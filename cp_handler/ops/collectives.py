"""Single-tensor collectives under their current names (torch 2.13 renamed them), one place to choose.

``all_gather_single(out, inp, group)`` / ``reduce_scatter_single(out, inp, op, group)`` where they
exist, else the older ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` (same semantics).
"""

from __future__ import annotations

import torch.distributed as dist

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
