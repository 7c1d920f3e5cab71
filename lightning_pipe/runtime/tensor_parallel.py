"""Tensor-parallel stages: the global gradient norm over parameters split across a stage's tensor-parallel ranks."""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard

from lightning_pipe.runtime.sharding import local


def is_split(tensor: Tensor) -> bool:
    """Whether ``tensor`` is a DTensor split over its mesh (a ``Shard`` placement): each rank holds another part."""
    return isinstance(tensor, DTensor) and any(isinstance(p, Shard) for p in tensor.placements)


def squared_norm(grads: Sequence[Tensor], device: torch.device, tp_group: Any = None) -> Tensor:
    """The squared L2 norm of a stage replica's gradients ``grads``, every element counted once.

    Without tensor parallel (``tp_group`` ``None``) it is the sum of this rank's squares. With
    it, a gradient split over the tensor-parallel ranks (a column- or row-parallel weight,
    Megatron-LM's partition: Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter
    Language Models Using Model Parallelism", section 3) holds a different part on each rank,
    so its squares are summed over ``tp_group``; a replicated one (a row-parallel bias, a layer
    left whole) is the same on every rank and counted once. Every rank of ``tp_group`` returns
    the same value (a collective over it).
    """
    zero = torch.zeros((), device=device)
    split = [g for g in grads if tp_group is not None and is_split(g)]
    whole = [g for g in grads if tp_group is None or not is_split(g)]
    parts = _sum_of_squares(split, zero)
    if tp_group is not None:
        dist.all_reduce(parts, group=tp_group)
    return parts + _sum_of_squares(whole, zero)


def _sum_of_squares(grads: Sequence[Tensor], zero: Tensor) -> Tensor:
    """The float32 sum of ``grads``' squares (this rank's parts), each norm taken in at least float32."""
    norms = [
        torch.linalg.vector_norm(local(g), dtype=torch.promote_types(g.dtype, torch.float32)).float() for g in grads
    ]
    return torch.stack(norms).pow(2).sum().to(zero.device) if norms else zero.clone()
