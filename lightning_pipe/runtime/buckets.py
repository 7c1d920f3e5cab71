"""Replica gradient averaging in buckets, each all-reduce started once its gradients are final (during backward)."""

from __future__ import annotations

import weakref
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

#: Bytes of one replica all-reduce bucket (DDP's default bucket_cap_mb, 25).
DEFAULT_BUCKET_BYTES = 25 * 2**20


class GradientBuckets:
    """Averages one weight slot's gradients over the stage's replicas while the backward runs, as DDP does.

    Parameters are grouped, last first (the order a backward finishes them), into buckets of at
    most ``cap_bytes`` of one dtype. A parameter's gradient lives in a view of its bucket's flat
    buffer from its first accumulation on, so the all-reduce runs in place on the gradients
    themselves: no copy, and no memory beyond the gradients (but a bucket's not yet computed
    part once its first gradient exists). Once every parameter of a bucket has received its
    ``expected``-th accumulation (one per microbatch of the batch), the bucket's all-reduce is
    posted, in bucket order on every replica (a bucket whose turn has not come waits for the
    ones before it); each is divided by the width before its sum. :meth:`finish` posts what is
    left (a parameter that got no gradient) and waits.

    Args:
        params: the slot's trainable parameters, in the stage's order.
        group: the process group of the stage's replicas.
        width: replicas of the stage.
        cap_bytes: most bytes of one bucket.
        uses: accumulations per microbatch of a parameter, by ``id``, where not one (a parameter
            that several virtual stages of the rank share).
    """

    def __init__(
        self, params: Sequence[Tensor], group: Any, width: int, cap_bytes: int, uses: Optional[Mapping[int, int]] = None
    ) -> None:
        self.group, self.width = group, width
        self._uses = dict(uses or {})  # accumulations per microbatch, by id: a parameter two stages share gets two
        self.buckets = _group_by_size([p for p in reversed(list(params)) if p.requires_grad], cap_bytes)
        self._place = {id(p): (i, offset) for i, bucket in enumerate(self.buckets) for p, offset in _offsets(bucket)}
        self.expected = 0  # accumulations that make a gradient final; 0: not armed (no training step running)
        self._handles = [p.register_post_accumulate_grad_hook(_hook(self)) for bucket in self.buckets for p in bucket]
        self._reset()

    def _reset(self) -> None:
        self._counts: dict[int, int] = {}
        self._ready = [0] * len(self.buckets)
        self._flats: list[Optional[Tensor]] = [None] * len(self.buckets)
        self._works: list[Any] = [None] * len(self.buckets)
        self._next = 0

    def accumulated(self, params: Sequence[Tensor]) -> None:
        """Record one more accumulation into each of ``params``' gradients; post the buckets that became final."""
        if not self.expected:
            return
        for p in params:
            if id(p) not in self._place:
                continue
            i = self._place[id(p)][0]
            count, final = self._counts.get(id(p), 0) + 1, self.expected * self._uses.get(id(p), 1)
            if count > final:
                raise RuntimeError(
                    f"a parameter of shape {tuple(p.shape)} received {count} gradient accumulations in "
                    f"one batch of {self.expected} microbatches: its bucket was already all-reduced"
                )
            self._counts[id(p)] = count
            self._adopt(i, p)
            if count == final:
                self._ready[i] += 1
        while self._next < len(self.buckets) and self._ready[self._next] == len(self.buckets[self._next]):
            self._post(self._next)

    def place(self, params: Sequence[Tensor]) -> None:
        """Make each of ``params`` without a gradient a view of its bucket now, before an accumulation
        writes it (split backward's W adds its products into it in place: no product beside the
        bucket); counts no accumulation."""
        if not self.expected:
            return
        for p in params:
            if p.grad is None and id(p) in self._place:
                self._adopt(self._place[id(p)][0], p)

    def _adopt(self, i: int, p: Tensor) -> None:
        """Make ``p.grad`` a view of bucket ``i``'s flat buffer (allocated, zeroed, at its first gradient)."""
        flat = self._flats[i]
        if flat is None:
            bucket = self.buckets[i]
            flat = self._flats[i] = torch.zeros(
                sum(q.numel() for q in bucket), dtype=bucket[0].dtype, device=bucket[0].device
            )
        offset = self._place[id(p)][1]
        view = flat[offset : offset + p.numel()].view_as(p)
        if p.grad is None:
            p.grad = view
        elif p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
            p.grad = view

    def _post(self, i: int) -> None:
        for p in self.buckets[i]:
            self._adopt(i, p)  # a parameter without a gradient gets zeros
        flat = self._flats[i]
        flat /= self.width  # averaged before the sum (as DDP's default hook), so finish only waits
        self._works[i] = dist.all_reduce(flat, group=self.group, async_op=True)
        self._next = i + 1

    def finish(self) -> None:
        """Post the buckets not posted yet, wait for all, and average; the next batch starts afresh."""
        while self._next < len(self.buckets):
            self._post(self._next)
        for work, flat in zip(self._works, self._flats):
            work.wait()
            # The process group's thread can hold its finished work, and with it the tensor it
            # reduced, a while after wait() returns (on a loaded CPU host past the next step's first
            # gradient). Emptying that tensor leaves the buffer to the gradients' views alone, so it
            # is freed when they are, as the memory model counts it.
            flat.set_()  # type: ignore[union-attr]
        self._reset()

    def discard(self) -> None:
        """Forget a batch in progress (a failed step, a restarted stream); what was posted is not awaited."""
        self._reset()

    def close(self) -> None:
        """Remove the gradient hooks (the layout is being replaced)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _hook(buckets: GradientBuckets) -> Any:
    ref = weakref.ref(buckets)

    def hook(p: Tensor) -> None:
        target = ref()
        if target is not None:
            target.accumulated([p])

    return hook


def _group_by_size(params: list[Tensor], cap_bytes: int) -> list[list[Tensor]]:
    """Consecutive parameters of one dtype and device, at most ``cap_bytes`` a bucket (one at least)."""
    buckets: list[list[Tensor]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        last = buckets[-1] if buckets else None
        if last is not None and (last[0].dtype, last[0].device) == (p.dtype, p.device) and size + nbytes <= cap_bytes:
            last.append(p)
            size += nbytes
        else:
            buckets.append([p])
            size = nbytes
    return buckets


def _offsets(bucket: list[Tensor]) -> list[tuple[Tensor, int]]:
    """Each parameter of a bucket with the offset of its gradient in the bucket's flat buffer."""
    starts = [0]
    for p in bucket[:-1]:
        starts.append(starts[-1] + p.numel())
    return list(zip(bucket, starts))
