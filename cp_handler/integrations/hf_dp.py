"""The data of a Trainer under context parallelism goes over the dp ranks only: every rank of a CP group loads the
same batch, evaluation keeps one rank's results per CP group, and an RL trainer's bookkeeping sees the dp ranks as its
processes, all through one adapter per trainer (:class:`DataParallelView`)."""

from __future__ import annotations

import contextlib
import sys


def gather_dp(accelerator, cp: int, tensors):
    """``accelerator.gather`` over the dp ranks: every rank's tensors gathered, those of one rank per CP group kept
    (CP ranks are adjacent and hold the same values)."""
    from accelerate.utils import recursively_apply

    world = accelerator.num_processes
    return recursively_apply(lambda t: t.reshape(world, -1, *t.shape[1:])[::cp].flatten(0, 1),
                             accelerator.gather(tensors))


def gather_over_dp(accelerator, cp: int, tensors):
    """``gather_for_metrics`` over the dp ranks: :func:`gather_dp`, then the last batch's duplicates dropped as
    ``gather_for_metrics`` does."""
    from accelerate.utils import recursively_apply

    state = accelerator.gradient_state
    data = gather_dp(accelerator, cp, tensors)
    if state.end_of_dataloader and state.remainder > 0:
        data = recursively_apply(lambda t: t[:state.remainder], data)
    return data


def gather_object_dp(cp: int, objects: list) -> list:
    """accelerate's ``gather_object`` (every process's list, concatenated) over the dp ranks: one list per CP group."""
    from accelerate.utils import gather_object

    return [item for per_rank in gather_object([list(objects)])[::cp] for item in per_rank]


class DPAccelerator:
    """An ``Accelerator`` as the dp ranks see it: ``num_processes`` and ``process_index`` count CP groups,
    ``gather`` / ``gather_for_metrics`` / ``reduce`` keep one rank per group (:func:`gather_dp`); every other
    attribute is the accelerator's own (read and written through)."""

    def __init__(self, accelerator, cp: int):
        object.__setattr__(self, "_accelerator", accelerator)
        object.__setattr__(self, "_cp", cp)

    def __getattr__(self, name):
        return getattr(self._accelerator, name)

    def __setattr__(self, name, value):
        setattr(self._accelerator, name, value)

    @property
    def num_processes(self) -> int:
        return self._accelerator.num_processes // self._cp

    @property
    def process_index(self) -> int:
        return self._accelerator.process_index // self._cp

    def gather(self, tensor):
        return gather_dp(self._accelerator, self._cp, tensor)

    def gather_for_metrics(self, input_data, use_gather_object: bool = False):
        if use_gather_object:
            return gather_object_dp(self._cp, input_data)
        return gather_over_dp(self._accelerator, self._cp, input_data)

    def reduce(self, tensor, reduction: str = "sum", scale: float = 1.0):
        from accelerate.utils import recursively_apply

        if reduction not in ("sum", "mean", "none"):
            raise ValueError(f"reduce(reduction={reduction!r}): one of 'sum', 'mean', 'none'")

        def reduced(t):
            stacked = self.gather(t[None])
            out = stacked.sum(0) if reduction == "sum" else stacked.mean(0) if reduction == "mean" else t
            return out * scale

        return recursively_apply(reduced, tensor)


class DataParallelView:
    """The one adapter between a trainer under CP and accelerate / TRL: the dp ranks (one per CP group) as their
    processes. One per trainer (:class:`~.hf_trainer_base.ContextParallelMixin` makes it once its groups exist), with
    three parts:

    * :meth:`prepare_data_loader`: installed as the trainer's accelerator's ``prepare_data_loader`` for the trainer's
      life (an attribute of that instance, accelerate's public object): every loader split over the dp ranks;
    * :meth:`gather_for_metrics`: Trainer's ``gather_function`` inside its evaluation loop;
    * :meth:`scope`: a block inside which ``trainer.accelerator`` is a :class:`DPAccelerator` and the module-level
      ``gather`` / ``gather_object`` that TRL's trainer modules imported from ``accelerate.utils`` keep one rank per
      CP group, restored when the block ends (TRL calls them directly: no public hook exists; the names are listed
      in :mod:`.hf_upstream`). Nothing changes at ``cp = 1`` or inside another such block.
    """

    def __init__(self, trainer, cp: int, dp_size: int, dp_rank: int):
        self.trainer, self.cp, self.dp_size, self.dp_rank = trainer, cp, dp_size, dp_rank
        self.trl_modules = {sys.modules[c.__module__] for c in type(trainer).__mro__ if c.__module__.startswith("trl.")}

    def install(self) -> None:
        """The accelerator's data loaders over the dp ranks from now on."""
        self.trainer.accelerator.prepare_data_loader = self.prepare_data_loader

    def prepare_data_loader(self, data_loader, device_placement=None, slice_fn_for_dispatch=None):
        """:func:`prepare_data_loader_over_dp` with the trainer's accelerator."""
        return prepare_data_loader_over_dp(self.trainer.accelerator, self.dp_size, self.dp_rank, data_loader,
                                           device_placement, slice_fn_for_dispatch)

    def gather_for_metrics(self, tensors):
        """:func:`gather_over_dp` with the trainer's accelerator."""
        return gather_over_dp(self.trainer.accelerator, self.cp, tensors)

    @contextlib.contextmanager
    def scope(self):
        """The block of the class doc's third part."""
        trainer, cp = self.trainer, self.cp
        if cp == 1 or isinstance(trainer.accelerator, DPAccelerator):
            yield
            return
        accelerator = trainer.accelerator
        replacements = {"gather": lambda tensor: gather_dp(accelerator, cp, tensor),
                        "gather_object": lambda objects: gather_object_dp(cp, objects)}
        saved = [(m, name, getattr(m, name)) for m in self.trl_modules for name in replacements if hasattr(m, name)]
        trainer.accelerator = DPAccelerator(accelerator, cp)
        for module, name, _ in saved:
            setattr(module, name, replacements[name])
        try:
            yield
        finally:
            trainer.accelerator = accelerator
            for module, name, original in saved:
                setattr(module, name, original)


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
