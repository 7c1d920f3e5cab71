"""Training data under a pipeline: a resumable loader (exact mid-epoch resume) and the per-replica batch size."""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterator, Optional

from lightning.pytorch.utilities.data import _get_dataloader_init_args_and_kwargs, _reinstantiate_wrapped_cls
from torch.utils.data import BatchSampler, DataLoader, Sampler


class SkipSampler(Sampler):
    """Yields ``sampler``'s indices after the first ``skip`` (the epoch order is ``sampler``'s own)."""

    def __init__(self, sampler: Sampler, skip: int) -> None:
        self.sampler, self.skip = sampler, skip

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.sampler), self.skip, None)

    def __len__(self) -> int:
        return max(len(self.sampler) - self.skip, 0)  # type: ignore[arg-type]

    def set_epoch(self, epoch: int) -> None:
        """Forward the epoch to the wrapped sampler (it decides the shuffle)."""
        if callable(getattr(self.sampler, "set_epoch", None)):
            self.sampler.set_epoch(epoch)


class ResumableLoader:
    """The training DataLoader, made resumable: a checkpoint records how many batches of the
    epoch were trained, and a resumed run starts the same epoch after exactly those batches.

    Lightning saves ``state_dict()`` in every checkpoint (its ``_Stateful`` protocol) and
    gives it back through ``load_state_dict`` before the resumed epoch starts. The count comes
    from Lightning's own loop progress (batches whose training step finished), not from how far
    the loader has read ahead. With a plain ``BatchSampler`` the skipped batches are never
    loaded (their indices are dropped); otherwise they are loaded and discarded. Every other
    attribute is the wrapped DataLoader's.

    Args:
        loader: the training DataLoader (with Lightning's distributed sampler already injected).
        trained_batches: batches of the current epoch whose training step has finished.
    """

    def __init__(self, loader: DataLoader, trained_batches: Callable[[], int]) -> None:
        self.loader, self._trained = loader, trained_batches
        self._skip = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["loader"], name)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        skip, self._skip = self._skip, 0
        if not skip:
            return iter(self.loader)
        batch_sampler = self.loader.batch_sampler
        if type(batch_sampler) is BatchSampler and self.loader.batch_size is not None:
            sampler = SkipSampler(self.loader.sampler, skip * self.loader.batch_size)
            return iter(_rebuild(self.loader, sampler))
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
        raise ValueError(f"global_batch_size={global_batch_size} is not divisible by the {width} data-parallel replicas")
    per_replica = global_batch_size // width
    if loader.batch_size == per_replica:
        return loader
    if loader.batch_size is None or type(loader.batch_sampler) is not BatchSampler:
        raise ValueError("global_batch_size needs a DataLoader built with batch_size (not its own batch_sampler)")
    return _rebuild(loader, loader.sampler, per_replica)
