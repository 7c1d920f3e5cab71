"""Training data under a pipeline: a resumable loader (exact mid-epoch resume) and the per-replica batch size."""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterator, Optional

from lightning.pytorch.utilities.data import _get_dataloader_init_args_and_kwargs, _reinstantiate_wrapped_cls
from torch.utils.data import BatchSampler, DataLoader, Sampler


class EpochSampler(Sampler):
    """Yields ``sampler``'s order for the epoch ``epoch()`` names, after its first ``skip``
    indices (set for one pass, then back to 0). The epoch is read when a pass starts."""

    def __init__(self, sampler: Sampler, epoch: Callable[[], int]) -> None:
        self.sampler, self.epoch, self.skip = sampler, epoch, 0

    def __iter__(self) -> Iterator[Any]:
        if callable(getattr(self.sampler, "set_epoch", None)):
            self.sampler.set_epoch(self.epoch())
        skip, self.skip = self.skip, 0
        return itertools.islice(iter(self.sampler), skip, None)

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]

    def set_epoch(self, epoch: int) -> None:
        """Ignored: the epoch is ``epoch()`` (see :class:`ResumableLoader` for why not Lightning's count)."""


class ResumableLoader:
    """The training DataLoader, made resumable: a checkpoint records how many batches of the
    epoch were trained, and a resumed run starts the same epoch after exactly those batches.

    Lightning saves ``state_dict()`` in every checkpoint (its ``_Stateful`` protocol) and
    gives it back through ``load_state_dict`` before the resumed epoch starts. The count comes
    from Lightning's own loop progress (batches whose training step finished), not from how far
    the loader has read ahead. With a plain ``BatchSampler`` the skipped batches are never
    loaded (their indices are dropped); otherwise they are loaded and discarded. Every other
    attribute is the wrapped DataLoader's.

    Each epoch's order is the sampler's for ``epoch()`` (the trainer's ``current_epoch``).
    Lightning gives the sampler its count of *processed* epochs instead, which runs one ahead
    after a fit stopped at ``max_steps`` in the middle of an epoch: resumed from that
    checkpoint, the rest of the epoch came from the next epoch's shuffle (samples of the
    unfinished epoch never trained, others trained twice).

    Args:
        loader: the training DataLoader (with Lightning's distributed sampler already injected).
        trained_batches: batches of the current epoch whose training step has finished.
        epoch: the epoch being trained.
    """

    def __init__(self, loader: DataLoader, trained_batches: Callable[[], int], epoch: Callable[[], int]) -> None:
        self._sampler: Optional[EpochSampler] = None
        if type(loader.batch_sampler) is BatchSampler and loader.batch_size is not None:
            self._sampler = EpochSampler(loader.sampler, epoch)
            loader = _rebuild(loader, self._sampler)
        self.loader, self._trained, self._epoch = loader, trained_batches, epoch
        self._skip = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["loader"], name)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        skip, self._skip = self._skip, 0
        if self._sampler is not None:
            self._sampler.skip = skip * self.loader.batch_size
            return iter(self.loader)
        for sampler in (self.loader.sampler, getattr(self.loader.batch_sampler, "sampler", None)):
            if callable(getattr(sampler, "set_epoch", None)):  # its own batch sampler: set the epoch now
                sampler.set_epoch(self._epoch())
        return itertools.islice(iter(self.loader), skip, None)

    def state_dict(self) -> dict[str, int]:
        """Batches of the current epoch already trained (Lightning stores this in checkpoints)."""
        return {"trained_batches": int(self._trained())}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Start the next iteration after the trained batches (none if the epoch had ended)."""
        trained = int(state.get("trained_batches", 0))
        self._skip = trained if trained < len(self.loader) else 0


def _rebuild(loader: DataLoader, sampler: Sampler, batch_size: Optional[int] = None) -> DataLoader:
    """The same DataLoader (class and arguments) with another sampler and optionally batch size."""
    args, kwargs = _get_dataloader_init_args_and_kwargs(loader, sampler)
    if batch_size is not None:
        kwargs["batch_size"] = batch_size
    return _reinstantiate_wrapped_cls(loader, *args, **kwargs)


def per_replica_loader(loader: DataLoader, global_batch_size: int, width: int) -> DataLoader:
    """``loader`` with batches of ``global_batch_size / width`` samples, so that the union of the
    ``w`` replicas' batches is the same global batch for every ``w``.

    Raises:
        ValueError: if ``global_batch_size`` is not a multiple of ``width``, or the loader has
            its own batch sampler.
    """
    if global_batch_size % width:
        raise ValueError(
            f"global_batch_size={global_batch_size} is not divisible by the {width} data-parallel replicas"
        )
    per_replica = global_batch_size // width
    if loader.batch_size == per_replica:
        return loader
    if loader.batch_size is None or type(loader.batch_sampler) is not BatchSampler:
        raise ValueError("global_batch_size needs a DataLoader built with batch_size (not its own batch_sampler)")
    return _rebuild(loader, loader.sampler, per_replica)


def starting_global_batch(loader: DataLoader, width: int) -> tuple[int, str]:
    """The global batch of a fit that did not set one: the training DataLoader's batch size (each
    replica's) times the starting ``width``, and a line saying so.

    Raises:
        ValueError: if the loader has no ``batch_size`` (its own batch sampler).
    """
    if loader.batch_size is None or type(loader.batch_sampler) is not BatchSampler:
        raise ValueError(
            "changing the layout during fit keeps the global batch fixed, and without "
            "PipelineStrategy(global_batch_size=...) it is taken from the training DataLoader's batch_size, "
            "which this one (with its own batch_sampler) does not have: pass global_batch_size"
        )
    size = loader.batch_size * width
    return size, f"global batch {size} taken from the starting layout: batch size {loader.batch_size} x width {width}"
