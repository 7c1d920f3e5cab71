"""A batch's update: replica all-reduce (bucketed, overlapped), global norm, clipping, non-finite skip, step."""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.optim import Optimizer

from lightning_pipe.runtime.buckets import GradientBuckets
from lightning_pipe.runtime.comm.groups import PipelineGroups
from lightning_pipe.runtime.sharding import ShardedGradients
from lightning_pipe.runtime.sharding import local as local_part
from lightning_pipe.runtime.tensor_parallel import squared_norm
from lightning_pipe.runtime.ties import TiedGradients
from lightning_pipe.runtime.versions import WeightVersions
from lightning_pipe.schedules.timeline import now


class UpdatePath:
    """Runs the AR and OPT actions of one stage, batch after batch (2BW interleaves two batches).

    Args:
        versions: the stage's weight slots (which tensors hold which batch's gradient).
        width: replicas of the stage; gradients are averaged over them.
        groups: the layout's process groups (``None`` in a single process).
        device: where the norm is accumulated.
        gradient_clip_val: clip to this global norm (over all stages) before stepping.
        bucket_bytes: with replicas, average the gradients in buckets of at most this many
            bytes, each all-reduce posted during the backward as soon as its gradients are
            final (:class:`~lightning_pipe.runtime.buckets.GradientBuckets`); 0: one blocking
            all-reduce of every gradient at the AR action.
        uses: per parameter (aligned with the slots), how many of the rank's stages use it (a
            parameter shared by two virtual stages on one rank is accumulated twice per
            microbatch); default one each.
        sharded: with FSDP replicas (``data_parallel="fsdp"``), what reduce-scatters the
            gradients at AR instead of the all-reduce buckets; the parameters and their
            gradients are then shards, and the global norm sums the squares of every shard.

    With tensor-parallel stages (``groups.tp``), the replicas average each rank's part of the
    gradients in one blocking all-reduce at AR (no buckets: their flat buffers hold whole
    tensors), and the global norm counts a split gradient's parts over the tensor-parallel
    ranks and a replicated one once (:func:`~lightning_pipe.runtime.tensor_parallel.squared_norm`).
    """

    def __init__(
        self,
        versions: WeightVersions,
        width: int,
        groups: Optional[PipelineGroups],
        device: torch.device,
        gradient_clip_val: Optional[float] = None,
        bucket_bytes: int = 0,
        uses: Sequence[int] = (),
        sharded: Optional[ShardedGradients] = None,
    ) -> None:
        self.versions, self.width, self.groups, self.device = versions, width, groups, device
        self.sharded = sharded
        self.gradient_clip_val, self.bucket_bytes = gradient_clip_val, bucket_bytes
        self.uses = list(uses)
        self.skipped_steps = 0
        self._buckets: dict[int, GradientBuckets] = {}
        self._armed = 0
        self.ties: Optional[TiedGradients] = None  # parameters tied across stages: their copies' gradients summed
        self.restart()

    def restart(self) -> None:
        """Forget in-flight batches: the next AR and OPT belong to batch 0."""
        self.reduced = self.stepped = 0
        self._norms: deque[tuple[Tensor, Any]] = deque()
        for buckets in self._buckets.values():
            buckets.discard()
        if self.ties is not None:
            self.ties.discard()

    def watch(self, params: list[Tensor]) -> None:
        """Average ``params``' gradients (one weight slot) in overlapped buckets from now on, when
        there are replicas and ``bucket_bytes``; a no-op for a slot already watched."""
        if (
            self.groups is None
            or self.sharded is not None
            or self.groups.tp is not None
            or self.width == 1
            or not self.bucket_bytes
            or not params
            or id(params[0]) in self._buckets
        ):
            return
        uses = {id(p): n for p, n in zip(params, self.uses)}
        buckets = GradientBuckets(params, self.groups.dp, self.width, self.bucket_bytes, uses)
        buckets.expected = self._armed  # a slot first used inside a running program (2BW's second version)
        self._buckets[id(params[0])] = buckets

    def arm(self, microbatches: int) -> None:
        """A training program runs: a gradient is final after ``microbatches`` accumulations (0: none runs)."""
        self._armed = microbatches
        if microbatches and self.sharded is not None:
            self.sharded.accumulate()
        for buckets in self._buckets.values():
            buckets.expected = microbatches

    def gradients_accumulated(self, params: list[Tensor]) -> None:
        """Split backward's W added one microbatch's gradient to each of ``params`` (no autograd hook fires)."""
        for buckets in self._buckets.values():
            buckets.accumulated(params)

    def gradients_to_accumulate(self, params: list[Tensor]) -> None:
        """Split backward's W is about to add into ``params``' gradients: those in a bucket become views of it first."""
        for buckets in self._buckets.values():
            buckets.place(params)

    def close(self) -> None:
        """Remove the buckets' gradient hooks and destroy the tied gradients' groups (the engine is being replaced)."""
        for buckets in self._buckets.values():
            buckets.close()
        self._buckets.clear()
        if self.ties is not None:
            self.ties.destroy()
            self.ties = None

    def all_reduce(self) -> None:
        """AR: average the batch's gradients over the stage's replicas, then start the global
        (all-stage) squared-norm sum that the batch's optimizer step will read."""
        params = self.versions.grads_of(self.reduced)
        self.reduced += 1
        buckets = self._buckets.get(id(params[0])) if params else None
        if buckets is not None:
            buckets.finish()
        if self.sharded is not None:
            self.sharded.reduce()
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if buckets is None and self.sharded is None:
            self._average_over_replicas([p.grad for p in params])
        tied: set[int] = set()
        if self.ties is not None:
            self.ties.post(params)  # summed by the optimizer step, which counts them in the norm once
            tied = self.ties.tied
        grads = [p.grad for i, p in enumerate(params) if i not in tied]
        local = squared_norm(grads, self.device, self.groups.tp if self.groups is not None else None)
        if self.sharded is not None and self.groups is not None:  # each replica holds a shard: the stage's sum
            dist.all_reduce(local, group=self.groups.dp)
        norm_group = self.groups.norm if self.groups is not None else None
        work = dist.all_reduce(local, group=norm_group, async_op=True) if norm_group is not None else None
        self._norms.append((local, work))

    def _average_over_replicas(self, grads: list[Tensor]) -> None:
        if self.groups is None or self.width == 1:
            return
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for g in grads:  # a tensor-parallel part is averaged with the same part of the other replicas
            by_dtype.setdefault(g.dtype, []).append(local_part(g))
        for group in by_dtype.values():
            flat = _flatten_dense_tensors(group)
            dist.all_reduce(flat, group=self.groups.dp)
            flat /= self.width
            for g, reduced in zip(group, _unflatten_dense_tensors(flat, group)):
                g.copy_(reduced)

    def optimizer_step(self, optimizer: Optimizer, on_step: Callable[[], None]) -> float:
        """OPT: clip to the global norm, skip on a non-finite gradient (same on every rank), step.

        Returns:
            When the global norm arrived: the step's own work began then (the trace shows the
            wait before it as idle).
        """
        batch = self.stepped
        self.stepped += 1
        params = self.versions.begin_step(batch, optimizer)
        squared, work = self._norms.popleft()
        if work is not None:
            work.wait()
        if self.ties is not None:
            squared = squared + self._tied_squares(params)
        ready = now()
        norm = float(squared.sqrt())
        if math.isfinite(norm):
            self._clip(params, norm)
            optimizer.step()
        else:
            self.skipped_steps += 1
        self.versions.end_step(batch)
        on_step()
        return ready

    def _tied_squares(self, params: list[Tensor]) -> Tensor:
        """Wait for the tied gradients' sums; their squared norm, each tied parameter counted once
        (by the first stage holding it), summed over the pipeline."""
        assert self.ties is not None
        self.ties.wait()
        counted = [
            torch.linalg.vector_norm(params[i].grad.detach(), dtype=torch.float32) for i in sorted(self.ties.counted)
        ]
        squares = torch.stack(counted).pow(2).sum() if counted else torch.zeros((), device=self.device)
        dist.all_reduce(squares, group=self.ties.norm_group)
        return squares

    def _clip(self, params: list[Tensor], norm: float) -> None:
        if self.gradient_clip_val is None:
            return
        coef = self.gradient_clip_val / (norm + 1e-6)  # as torch.nn.utils.clip_grad_norm_
        if coef < 1.0:
            for p in params:
                p.grad.mul_(coef)
