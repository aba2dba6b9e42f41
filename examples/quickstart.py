"""30-second example: the same GPT, one process or context-parallel, by handler alone.

    torchrun --nproc-per-node 2 examples/quickstart.py
"""

import torch
import torch.distributed as dist

from cp_handler import destroy_process_groups, get_cp_handler_cls
from cp_handler.models import GPTConfig, GPTModel


def main() -> None:
    cp_group = dist.new_group(list(range(dist.get_world_size())))  # every rank in one CP group
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(vocab_size=256, hidden_size=64, num_layers=2))
    tokens = torch.randint(0, 256, (1, 128))  # (B, S) global batch, same on every rank

    handler_cls = get_cp_handler_cls("local", "p2p")  # the backend's class (by config: backend, cp_comm_type)
    h = handler_cls(cp_group=cp_group, cp_comm_type="p2p", qkv_format="bshd")  # per batch; the comm type is data
    local = h.dispatch(tokens, seq_dim=1)  # (B, S / cp): zigzag shard of this rank
    logits = model(local, cp_handler=h)  # (B, S / cp, V): ring attention inside
    full = h.combine(logits, seq_dim=1)  # (B, S, V) in original token order

    alone = model(tokens)  # no handler: cp=1
    if dist.get_rank() == 0:
        print("max |CP - single process| =", (full - alone).abs().max().item())


dist.init_process_group("gloo")
main()
destroy_process_groups()  # frees the groups (and joins gloo's threads) before Python shuts down
