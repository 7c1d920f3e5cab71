"""Pipeline checkpoints keyed by parameter name: sharded (torch.distributed.checkpoint) or one file, written atomically.

The sharded format is Lightning's (``ModelParallelStrategy``): a directory that
``torch.distributed.checkpoint`` writes, with the model under ``"model"`` and each optimizer
under ``"optimizer_<i>"``, plus ``meta.pt`` holding Lightning's loop and callback state, so
``python -m lightning.pytorch.utilities.consolidate_checkpoint DIR`` turns it into one file.
Optimizer state is flattened per parameter name, so any layout can load any checkpoint.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.fabric.utilities.load import _METADATA_FILENAME as META
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from lightning_pipe.runtime.placement import Placement, check_shapes

MODEL, DCP_METADATA = "model", ".metadata"


@dataclass(frozen=True)
class _TensorSpec:
    """A tensor that travels on its own after the pickled layout (shape and dtype to receive it)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def whole(value: Any) -> Any:
    """A DTensor (an FSDP replica's shard) gathered whole, a collective over its mesh; any other value as it is."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def gather_on_first(shard: dict[str, Any], ranks: list[int], group: Any, device: torch.device) -> dict[str, Any]:
    """The union of ``ranks``' shards on ``ranks[0]`` only (``{}`` elsewhere), in CPU memory, for one-file checkpoints.

    Names, shapes and plain values travel pickled; each tensor is then sent by its owner as it
    is and received on ``ranks[0]`` into a fresh CPU tensor, so no sender holds a pickled copy
    of its stage, and the first rank holds only the whole model.
    """
    rank = dist.get_rank() if len(ranks) > 1 else ranks[0]
    layout = {k: _TensorSpec(tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v for k, v in shard.items()}
    layouts: Any = [None] * len(ranks) if rank == ranks[0] else None
    if len(ranks) > 1:
        dist.gather_object(layout, layouts, dst=ranks[0], group=group)
    if rank != ranks[0]:
        for v in shard.values():
            if isinstance(v, torch.Tensor):
                dist.send(v.detach().contiguous(), dst=ranks[0], group=group)
        return {}
    merged = {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in shard.items()}
    for src, part in zip(ranks[1:], layouts[1:]):
        merged.update({k: _receive(spec, src, group, device) for k, spec in part.items()})
    return merged


def _receive(spec: Any, src: int, group: Any, device: torch.device) -> Any:
    """A plain value as it came, or the tensor ``spec`` describes, received from ``src`` into CPU memory."""
    if not isinstance(spec, _TensorSpec):
        return spec
    buffer = torch.empty(spec.shape, dtype=spec.dtype, device=device)
    dist.recv(buffer, src=src, group=group)
    return buffer.cpu()


class IncompleteCheckpointError(RuntimeError):
    """A checkpoint whose save never finished, or whose files were cut short or damaged since."""


#: What a checkpoint file fails to load with when it was cut short or damaged.
_UNREADABLE = (EOFError, RuntimeError, OSError, ValueError, pickle.UnpicklingError, CheckpointException)
_RESUME = "resume from another checkpoint (an earlier one, or a complete copy of this one)"


def _corrupt(path: Path, what: str) -> IncompleteCheckpointError:
    """The error for checkpoint ``path`` that ``what`` (a file, a reason) shows to be incomplete or corrupt."""
    return IncompleteCheckpointError(f"checkpoint {path} is incomplete or corrupt: {what}; {_RESUME}")


def _reason(err: BaseException) -> str:
    """``err`` in one line; a DCP failure by the rank that hit it and its own error."""
    if isinstance(err, CheckpointException):
        rank, (first, _) = next(iter(err.failures.items()))
        return f"reading it failed on rank {rank} with {_reason(first)}"
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__


def _staging(path: Path, kind: str) -> Path:
    # Same name on every rank, and free of the checkpoint's own name: Lightning finds
    # ckpt_path="last" by looking for "last" in names, and must never pick a half-written one.
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:16]
    return path.parent / f".pipeline-{kind}-{digest}"


def _publish(staged: Path, path: Path) -> None:
    """Make ``staged`` visible as ``path``, replacing an older checkpoint there."""
    old = _staging(path, "old")
    if old.exists():
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    if path.exists() or path.is_symlink():
        os.rename(path, old)
    os.rename(staged, path)
    if old.exists():
        shutil.rmtree(old) if old.is_dir() else old.unlink()


def save_sharded(
    path: Path, shards: dict[str, Any], meta: dict[str, Any], rank: int, barrier: Callable[[], None]
) -> None:
    """Write every rank's ``shards`` and rank 0's ``meta`` under ``path``, visible only once complete.

    All ranks write into a staging directory; rank 0 adds ``meta.pt`` after every shard and
    the DCP metadata are on disk, then renames the directory into place. A crash or kill at
    any point before the rename leaves the previous checkpoint at ``path`` untouched.
    """
    staged = _staging(path, "partial")
    if rank == 0:
        shutil.rmtree(staged, ignore_errors=True)  # a save that died earlier
        staged.mkdir(parents=True)
    barrier()
    dcp.save(shards, checkpoint_id=staged)  # returns on rank 0 once every rank's shard is written
    if rank == 0:
        with open(staged / META, "wb") as f:
            torch.save(meta, f)
            f.flush()
            os.fsync(f.fileno())
        _publish(staged, path)
    barrier()


def save_file(checkpoint: dict[str, Any], path: Path) -> None:
    """Write one consolidated file atomically (a temporary file renamed into place)."""
    staged = _staging(path, "partial")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(staged, "wb") as f:
        torch.save(checkpoint, f)
        f.flush()
        os.fsync(f.fileno())
    _publish(staged, path)


def check_complete(path: Path) -> None:
    """Refuse a checkpoint directory whose save never finished.

    Raises:
        IncompleteCheckpointError: if the DCP metadata or Lightning's ``meta.pt`` is missing.
    """
    missing = [name for name in (DCP_METADATA, META) if not (path / name).is_file()]
    if missing:
        raise IncompleteCheckpointError(
            f"{path} is an incomplete checkpoint: it has no {' or '.join(missing)}, so its save never finished; "
            "resume from an earlier checkpoint"
        )
    _check_shard_sizes(path)


def _check_shard_sizes(path: Path) -> None:
    """Refuse a checkpoint directory whose shard files are missing or shorter than its DCP metadata says.

    Raises:
        IncompleteCheckpointError: naming the checkpoint and the first short or missing shard.
    """
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except _UNREADABLE as err:
        raise _corrupt(path, f"its DCP metadata ({DCP_METADATA}) cannot be read ({_reason(err)})") from err
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        shard = path / name
        if not shard.is_file():
            raise _corrupt(path, f"shard {name} is missing")
        if shard.stat().st_size < size:
            raise _corrupt(
                path,
                f"shard {shard} holds {shard.stat().st_size} bytes where its metadata needs {size} "
                "(cut short: a full disk, or a copy that did not finish)",
            )


def saved_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Name and shape of every model tensor in a sharded checkpoint (from its DCP metadata only)."""
    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    prefix = MODEL + "."
    return {k[len(prefix) :]: tuple(m.size) for k, m in metadata.items() if k.startswith(prefix) and hasattr(m, "size")}


def check_names(placement: Placement, saved: Mapping[str, tuple[int, ...]], what: str) -> None:
    """Check this rank's names and shapes against ``saved``, and that every saved name is used by some rank.

    A collective when processes are connected: every rank gathers every rank's names and
    problem, so all of them raise the same error (none is left waiting for the others).

    Raises:
        KeyError / ValueError: naming the first offending parameters.
    """
    mine = placement.shapes()
    try:
        check_shapes(mine, saved, what)
        problem: Any = None
    except (KeyError, ValueError) as err:
        problem = err
    everyone = [(set(mine), problem)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()  # type: ignore[list-item]
        dist.all_gather_object(everyone, (set(mine), problem))
    first = next((p for _, p in everyone if p is not None), None)
    if first is not None:
        raise first
    extra = sorted(set(saved) - set().union(*(names for names, _ in everyone)))
    if extra:
        raise KeyError(f"{what} holds {len(extra)} weights this model does not have, first: {extra[:5]}")


def load_sharded(path: Path, placement: Placement, optimizers: list[Any], strict: bool = True) -> dict[str, Any]:
    """Load this rank's parameters, buffers and optimizer state by name from a sharded checkpoint.

    Each rank reads only its own names (any layout can load any checkpoint of the same model).

    Returns:
        Lightning's loop, callback and scheduler state (``meta.pt``).
    """
    check_complete(path)
    if strict:
        check_names(placement, saved_shapes(path), f"checkpoint {path}")
    state: dict[str, Any] = {MODEL: placement.export_state()[MODEL]}
    state.update({f"optimizer_{i}": placement.optimizer_template(opt) for i, opt in enumerate(optimizers)})
    try:
        dcp.load(state, checkpoint_id=path, planner=dcp.DefaultLoadPlanner(allow_partial_load=not strict))
    except _UNREADABLE as err:  # every rank raises: DCP gathers the ranks' failures
        raise _corrupt(path, _reason(err)) from err
    placement.import_state({MODEL: state[MODEL]})
    for i, opt in enumerate(optimizers):
        placement.import_state({MODEL: state[MODEL], "optimizer": state[f"optimizer_{i}"]}, opt)
    try:
        return torch.load(path / META, map_location="cpu", weights_only=False)
    except _UNREADABLE as err:
        raise _corrupt(path, f"{path / META} cannot be read ({_reason(err)})") from err


def load_file(path: Path, placement: Placement, optimizers: list[Any], strict: bool = True) -> dict[str, Any]:
    """Load this rank's share of a consolidated single-file checkpoint by name (memory-mapped).

    Returns:
        The rest of the checkpoint (loops, callbacks, schedulers).
    """
    try:
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except FileNotFoundError:
        raise
    except _UNREADABLE as err:
        raise _corrupt(path, f"torch.load cannot read the file ({_reason(err)}), as when it was cut short") from err
    model = checkpoint.pop("state_dict")
    if strict:
        check_names(placement, {k: tuple(v.shape) for k, v in model.items()}, f"checkpoint {path}")
    states = checkpoint.pop("optimizer_states", [])
    if optimizers and any("pipeline_stages" in s for s in states):
        raise ValueError(
            f"{path} was saved by an older lightning_pipe (optimizer state by stage index); "
            "load its weights with load_from_checkpoint and train on"
        )
    placement.import_state({MODEL: model})
    for opt, flat in zip(optimizers, states):
        placement.import_state({MODEL: model, "optimizer": flat}, opt)
    return checkpoint
