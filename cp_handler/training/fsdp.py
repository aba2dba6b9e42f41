"""``cp-train --fsdp``: parameters, gradients and optimizer states sharded over every rank of the job (FSDP2,
``torch.distributed.fsdp.fully_shard``), as torchtitan shards over its dp x cp mesh.

Each transformer layer is one FSDP unit (its parameters all-gathered for its forward and again for its
backward, its gradients reduce-scattered), the rest of the model (embedding, final norm, output head) the root
unit. The mesh is every rank of the job: CP ranks hold different tokens of the same sequences, so their
gradients are summed exactly as the data-parallel replicas' are, and FSDP2's reduce-scatter averages over the
mesh as DDP's all-reduce does (the step scales the loss by the world size as for DDP). Per rank the
parameters, gradients and AdamW's two states take ``1 / world`` of the model's bytes (plus one layer's
parameters gathered at a time).

What needs the whole tensors (the parity reference, ``--export-hf``) gathers them here, collectively.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def shard_model(model: nn.Module, mesh=None) -> nn.Module:
    """Apply ``fully_shard`` to each of ``model``'s layers (:func:`layer_modules`) and to ``model`` over ``mesh``
    (a 1-D DeviceMesh; default: every rank, on the device the model's parameters are on; with tensor parallelism the
    ``dp_cp`` dimension of a 2-D ``(dp_cp, tp)`` mesh); returns ``model`` (now an ``FSDPModule``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if mesh is None:
        device_type = next(model.parameters()).device.type
        mesh = init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=("dp_cp",))
    for layer in layer_modules(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def layer_modules(model: nn.Module) -> list[nn.Module]:
    """The FSDP units: the reference GPT's ``layers``; a Hugging Face model's modules of the classes it names
    in ``_no_split_modules`` (its decoder layers)."""
    if hasattr(model, "layers"):
        return list(model.layers)
    names = set(getattr(model.model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a collective over its mesh); any other tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def full_gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient, on every rank (collective: every rank calls it)."""
    return {name: full_tensor(p.grad) for name, p in model.named_parameters() if p.grad is not None}


def full_state(model: nn.Module) -> dict | None:
    """The whole model state on rank 0 (``None`` elsewhere), on the CPU (collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return state if dist.get_rank() == 0 else None


def local_bytes(t: torch.Tensor) -> int:
    """Bytes of this rank's part of ``t`` (a DTensor's local shard)."""
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def state_bytes(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's training state: ``parameters``, ``gradients`` (as many as the parameters: each is held
    between the backward and the optimizer step), ``optimizer`` (every tensor of its state) bytes."""
    params = sum(local_bytes(p) for p in model.parameters())
    optimizer = sum(local_bytes(v) for state in optim.state.values() for v in state.values()
                    if isinstance(v, torch.Tensor))
    return {"parameters": params, "gradients": params, "optimizer": optimizer}
