"""The data of a Trainer under context parallelism goes over the dp ranks only: every rank of a CP group loads the
same batch, and evaluation keeps one rank's results per CP group (:class:`~.hf_trainer.ContextParallelMixin`)."""

from __future__ import annotations


def gather_over_dp(accelerator, cp: int, tensors):
    """``gather_for_metrics`` over the dp ranks: every rank's tensors gathered, those of one rank per CP group
    kept (CP ranks are adjacent), then the last batch's duplicates dropped as ``gather_for_metrics`` does."""
    from accelerate.utils import recursively_apply

    state, world = accelerator.gradient_state, accelerator.num_processes

    def one_per_group(t):
        return t.reshape(world, -1, *t.shape[1:])[::cp].flatten(0, 1)

    data = recursively_apply(one_per_group, accelerator.gather(tensors))
    if state.end_of_dataloader and state.remainder > 0:
        data = recursively_apply(lambda t: t[:state.remainder], data)
    return data


def prepare_data_loader_over_dp(accelerator, dp_size: int, dp_rank: int, data_loader, device_placement=None,
                                slice_fn_for_dispatch=None):
    """The accelerator's ``prepare_data_loader`` with the dp ranks as its processes (one per CP group)."""
    from accelerate.data_loader import prepare_data_loader

    acc = accelerator
    if getattr(data_loader, "_is_accelerate_prepared", False):
        return data_loader
    prepared = prepare_data_loader(
        data_loader, acc.device, num_processes=dp_size, process_index=dp_rank,
        split_batches=acc.split_batches, put_on_device=acc.device_placement if device_placement is None
        else device_placement, rng_types=acc.rng_types.copy(), dispatch_batches=False,
        even_batches=acc.even_batches, slice_fn_for_dispatch=slice_fn_for_dispatch,
        use_seedable_sampler=acc.use_seedable_sampler, data_seed=acc.dataloader_config.data_seed,
        non_blocking=acc.non_blocking, use_stateful_dataloader=acc.use_stateful_dataloader)
    acc._dataloaders.append(prepared)  # as the accelerator's own (checkpointing of the loader state)
    return prepared
