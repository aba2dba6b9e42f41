"""An unmodified Hugging Face model, context-parallel: the lines a training loop adds.

    torchrun --nproc-per-node 2 examples/hf_quickstart.py
"""

import copy

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from cp_handler import destroy_process_groups, get_cp_handler_cls
from cp_handler.integrations.transformers import cp_model_inputs, register
from cp_handler.training import global_token_count, masked_token_loss_sum, next_token_batch


def main() -> None:
    cp_group = dist.new_group(list(range(dist.get_world_size())))
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    alone = copy.deepcopy(model)  # the same model without CP, for comparison
    register(model)  # 1. attention through the CP handler; the model is checked (exact or refused)
    tokens = torch.randint(0, 256, (1, 128))  # (B, S) global batch, same on every rank

    h = get_cp_handler_cls("local", "p2p")(cp_group=cp_group, cp_comm_type="p2p")  # 2. a handler per batch
    input_ids, labels, loss_mask = next_token_batch(h, tokens)  # 3. local tokens, labels rolled across ranks
    logits = model(input_ids, **cp_model_inputs(h, input_ids), cp_handler=h).logits  # 4. global positions
    loss = masked_token_loss_sum(logits, labels, loss_mask) / global_token_count(loss_mask, cp_group)  # 5.
    loss.backward()  # gradients: sum them over the CP group (DDP over dp x cp does)

    total = loss.detach().clone()
    dist.all_reduce(total, group=cp_group)
    reference = torch.nn.functional.cross_entropy(alone(tokens).logits[0, :-1], tokens[0, 1:])
    if dist.get_rank() == 0:
        print("loss CP", total.item(), "alone", reference.item(), "difference", abs(total.item() - reference.item()))


dist.init_process_group("gloo")
main()
destroy_process_groups()
