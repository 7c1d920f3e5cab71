"""Replicas of a stage keep replica 0's buffers: one coalesced broadcast before each training step.

This is ``torch.nn.parallel.DistributedDataParallel(broadcast_buffers=True)``'s rule: before each
forward, rank 0's buffers (BatchNorm's running statistics, ``num_batches_tracked``, any registered
buffer) overwrite every other replica's, so the replicas' statistics follow replica 0's shard
and every replica holds the same model for evaluation and checkpoints. Without it each replica
updates its running statistics from its own shard and the replicas drift apart.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

#: Each dtype's bytes start at a multiple of this in the flat message, so they can be viewed as that dtype again.
_ALIGN = 16


class BufferBroadcast:
    """Broadcasts the buffers of one rank's stages from replica 0 to the stage's other replicas.

    All buffers travel in one message: each dtype's buffers flattened, viewed as bytes and
    concatenated (one collective, no host synchronisation). Receivers put the values in as fresh
    tensors rather than copying into the old ones: under 2BW the previous batch's backwards
    are still to run, and their graphs saved the old running statistics (an in-place write
    would fail autograd's version check). A buffer that two modules share stays shared.
    Deferred batch norm's per-batch sums are buffers too; a step's start is a batch boundary
    (under 2BW a window holds one batch's forwards), where they are zero.

    Args:
        modules: every module of the rank's stages (their own buffers, not their children's, are sent).
        group: the stage's replica group (``PipelineGroups.dp``).
        source: the global rank of replica 0 of this stage.
        rank: this process's global rank.
    """

    def __init__(self, modules: Sequence[nn.Module], group: object, source: int, rank: int) -> None:
        self._slots = [(m, name) for m in modules for name, b in m._buffers.items() if b is not None]
        self.group, self.source, self.receives = group, source, rank != source

    def __bool__(self) -> bool:
        """Whether the stages hold any buffer (the same answer on every replica of the stage)."""
        return bool(self._slots)

    @torch.no_grad()
    @torch.inference_mode(False)  # an evaluation's drain: the fresh buffers must serve training (autograd) later
    def broadcast(self) -> None:
        """Give every replica replica 0's buffers (a collective over the stage's replicas)."""
        tensors = list({id(b): b for b in (m._buffers[name] for m, name in self._slots) if b is not None}.values())
        flat, layout = _pack(tensors)
        dist.broadcast(flat, src=self.source, group=self.group)
        if not self.receives:
            return
        fresh = {id(t): new for t, new in zip(layout, _unpack(flat, layout))}
        for module, name in self._slots:
            old = module._buffers[name]
            if old is not None and id(old) in fresh:
                module._buffers[name] = fresh[id(old)]


def _by_dtype(tensors: list[Tensor]) -> dict[torch.dtype, list[Tensor]]:
    groups: dict[torch.dtype, list[Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return groups


def _pack(tensors: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
    """One byte tensor holding every tensor's values, each dtype's part aligned; and the tensors in its order."""
    parts, order = [], []
    for group in _by_dtype(tensors).values():
        raw = torch.cat([t.detach().reshape(-1) for t in group]).view(torch.uint8)
        pad = -raw.numel() % _ALIGN
        parts += [raw, raw.new_zeros(pad)] if pad else [raw]
        order += group
    return torch.cat(parts), order


def _unpack(flat: Tensor, layout: list[Tensor]) -> list[Tensor]:
    """Views of ``flat`` shaped as ``layout``'s tensors (packed by :func:`_pack`, in that order)."""
    out, offset = [], 0
    for dtype, group in _by_dtype(layout).items():
        numels = [t.numel() for t in group]
        size = sum(numels) * group[0].element_size()
        values = flat[offset : offset + size].view(dtype)
        out += [v.view(t.shape) for v, t in zip(values.split(numels), group)]
        offset += size + (-size % _ALIGN)
    return out
