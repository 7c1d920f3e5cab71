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
    """The float32 sum of ``grads``' squares (this rank's parts), each norm taken in at least float32
    and the norms summed in ``grads``' order (:func:`_norms`)."""
    if not grads:
        return zero.clone()
    with torch.no_grad():  # a gradient that records a graph (create_graph) adds nothing to it here
        return torch.stack(_norms([local(g) for g in grads])).pow(2).sum().to(zero.device)


def _norms(parts: list[Tensor]) -> list[Tensor]:
    """Each tensor's float32 L2 norm, in order: one ``torch._foreach_norm`` per dtype, in at least
    float32. On the CPU it runs each tensor's ``linalg.vector_norm`` (the same values as calling
    it per tensor); on a GPU one multi-tensor kernel for all, ``clip_grad_norm_``'s, whose norms
    may differ from ``vector_norm``'s in the last bit."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(parts):
        by_dtype.setdefault(t.dtype, []).append(i)
    norms: list[Tensor] = list(parts)
    for dtype, at in by_dtype.items():
        found = torch._foreach_norm([parts[i] for i in at], 2, dtype=torch.promote_types(dtype, torch.float32))
        for i, n in zip(at, found):
            norms[i] = n if n.dtype == torch.float32 else n.float()
    return norms
