"""One rank's share of the pipeline: partitions the user's chain, runs steps, gathers state."""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.optim import Optimizer

from lightning_pipe.partition import PartitionSpec, block_cost, partition_sizes, stage_ranges
from lightning_pipe.runtime.executor import Executor, Hooks, Position, StepState
from lightning_pipe.runtime.microbatch import split_batch
from lightning_pipe.runtime.stage import Stage
from lightning_pipe.runtime.versions import WeightVersions
from lightning_pipe.schedules import (
    Action,
    build_inference,
    build_schedule,
    check_name,
    two_bw,
    two_bw_drain,
    two_bw_run,
    two_bw_window,
    verify,
)
from lightning_pipe.timeline import Trace, now
from lightning_pipe.topology import Topology

Recompute = Union[bool, Sequence[bool]]


class RemoteBlock(nn.Module):
    """Stands in for a block that lives on another stage; it holds no parameters."""

    def __init__(self, stage: int) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, *args: Any) -> Any:
        """Refuse to run: this block's weights live on another process."""
        raise RuntimeError(f"this block lives on pipeline stage {self.stage}; run the model with pipeline_forward()")


def pipeline_blocks_of(module: nn.Module) -> list[nn.Module]:
    """The user's chain of blocks, validated."""
    if not callable(getattr(module, "pipeline_blocks", None)):
        raise TypeError(
            f"{type(module).__name__} has no pipeline_blocks(); subclass lightning_pipe.PipelineMixin "
            "and return the model's chain of blocks from pipeline_blocks()"
        )
    blocks = list(module.pipeline_blocks())
    bad = [i for i, b in enumerate(blocks) if not isinstance(b, nn.Module)]
    if not blocks or bad:
        raise TypeError(f"pipeline_blocks() must return a non-empty list of nn.Module (entries {bad} are not)")
    return blocks


def _parents(module: nn.Module, blocks: list[nn.Module]) -> list[tuple[nn.Module, str]]:
    index = {id(m): (parent, name) for parent in module.modules() for name, m in parent.named_children()}
    missing = [i for i, b in enumerate(blocks) if id(b) not in index]
    if missing:
        raise ValueError(f"pipeline blocks {missing} are not submodules of {type(module).__name__}; register them as attributes")
    return [index[id(b)] for b in blocks]


def _check_parameters(module: nn.Module, blocks: list[nn.Module], ranges: list[range]) -> None:
    owner: dict[int, int] = {}
    for stage, rng in enumerate(ranges):
        for i in rng:
            for p in blocks[i].parameters():
                if owner.setdefault(id(p), stage) != stage:
                    raise ValueError(
                        f"a parameter of pipeline block {i} is shared with stage {owner[id(p)]} (tied weights across "
                        "stages are not supported); keep tied blocks on one stage with an explicit partition"
                    )
    stray = [n for n, p in module.named_parameters() if id(p) not in owner]
    if stray:
        raise ValueError(f"parameters outside every pipeline block would never train: {stray[:5]}; move them into a block")


class PipelineEngine:
    """Runs training and inference steps of one rank of a ``w x d`` pipeline.

    Args:
        module: the user's model; it must define ``pipeline_blocks`` and ``pipeline_loss``.
        topology: the ``(w, d)`` layout.
        rank: this process's global rank.
        schedule: "gpipe", "1f1b" or "2bw".
        microbatches: microbatches ``m`` per batch (2BW needs ``m >= d``).
        partition: "balanced", "uniform" or an explicit list of blocks per stage.
        recompute: activation recomputation, for all stages or per stage.
        device: device of this rank's stage.
        mesh: DeviceMesh with "dp" and "pp" dimensions; ``None`` only when running one process.
        gradient_clip_val: clip the gradient to this global norm (over all stages) before a step.
        split_backward: split each backward into input (I) and weight (W) gradients and delay
            W into idle time (2BP, seed 001; see schedules/split.py and runtime/split.py).
        split_max_pending: with ``split_backward``, the most microbatches that may wait for
            their W (bounds the stash, seed 001's Figure 5); ``None``: no bound.
    """

    def __init__(
        self,
        module: nn.Module,
        topology: Topology,
        rank: int,
        schedule: str = "1f1b",
        microbatches: int = 1,
        partition: PartitionSpec = "balanced",
        recompute: Recompute = False,
        device: Optional[torch.device] = None,
        mesh: Any = None,
        gradient_clip_val: Optional[float] = None,
        split_backward: bool = False,
        split_max_pending: Optional[int] = None,
    ) -> None:
        check_name(schedule)
        if split_backward and recompute is not False:
            raise ValueError("split_backward with recompute would recompute each forward twice (in I and W); use one")
        if microbatches < 1:
            raise ValueError(f"microbatches must be >= 1, got {microbatches}")
        if schedule == "2bw":
            two_bw.check_microbatches(topology.depth, microbatches)
        self.module, self.topology, self.rank = module, topology, rank
        self.schedule, self.microbatches = schedule, microbatches
        self.gradient_clip_val, self.split_backward = gradient_clip_val, split_backward
        self.split_max_pending = split_max_pending
        self.device = device or torch.device("cpu")
        self.stage_index = topology.stage_of(rank)
        self.stage = self._build_stage(partition, recompute)
        self.position = self._position()
        self.dp_group = mesh.get_group("dp") if mesh is not None else None
        self.pp_group = mesh.get_group("pp") if mesh is not None else None
        self.norm_group = self._pipeline_group() if mesh is not None and topology.depth > 1 else None
        self.streaming = schedule == "2bw"  # the stream of microbatches runs on across steps
        self.versions = WeightVersions(self.stage.parameters(), double=self.streaming)
        self.last_peak_stash = 0
        self.last_peak_stash_bytes = 0
        self.skipped_steps = 0
        self.trace = Trace(rank)
        self._loss_work: Any = None
        self._programs: dict[tuple[bool, int], list[Action]] = {}
        self._restart()
        if self.streaming:
            verify(two_bw_run(topology.depth, microbatches, 3, split_backward), 3 * microbatches)

    def _restart(self) -> None:
        """Forget the stream: the next batch is batch 0 of a fresh warm-up."""
        self._batches = self._reduced = self._stepped = 0
        self._state = StepState({}, {})
        self._norms: deque[tuple[Tensor, Any]] = deque()
        self._optimizer: Optional[Optimizer] = None
        self._on_step: Callable[[], None] = lambda: None

    # -- setup -----------------------------------------------------------------------------
    def _build_stage(self, partition: PartitionSpec, recompute: Recompute) -> Stage:
        blocks = pipeline_blocks_of(self.module)
        costs_fn = getattr(self.module, "pipeline_block_costs", None)
        costs = list(costs_fn()) if callable(costs_fn) else [block_cost(b) for b in blocks]
        ranges = stage_ranges(partition_sizes(partition, costs, self.topology.depth))
        _check_parameters(self.module, blocks, ranges)
        parents = _parents(self.module, blocks)
        mine = ranges[self.stage_index]
        for stage, rng in enumerate(ranges):
            for i in rng if stage != self.stage_index else ():
                parent, name = parents[i]
                parent._modules[name] = RemoteBlock(stage)
        for i in mine:
            blocks[i].to(self.device)
        self.block_ranges = ranges
        flags = [recompute] * self.topology.depth if isinstance(recompute, bool) else list(recompute)
        if len(flags) != self.topology.depth:
            raise ValueError(f"recompute needs one flag per stage ({self.topology.depth}), got {len(flags)}")
        return Stage([blocks[i] for i in mine], mine.start, flags[self.stage_index])

    def _position(self) -> Position:
        d, s = self.topology.depth, self.stage_index
        replica = self.topology.replica_of(self.rank)
        prev = self.topology.rank_of(replica, s - 1) if s > 0 else None
        nxt = self.topology.rank_of(replica, s + 1) if s < d - 1 else None
        return Position(s, d, prev, nxt)

    def _pipeline_group(self) -> Any:
        """A second group over this pipeline's stages for the gradient-norm sums.

        They run asynchronously, posted at each AR and awaited at the matching OPT, which 2BW
        places at different points of different stages; on their own group their order can
        never interleave with the loss broadcasts on the "pp" group.
        """
        groups = [
            dist.new_group([self.topology.rank_of(r, s) for s in range(self.topology.depth)])
            for r in range(self.topology.width)
        ]
        return groups[self.topology.replica_of(self.rank)]

    @property
    def last_rank(self) -> int:
        """Global rank of the last stage of this rank's pipeline."""
        return self.topology.rank_of(self.topology.replica_of(self.rank), self.topology.depth - 1)

    # -- programs --------------------------------------------------------------------------
    def train_program(self, microbatches: int) -> list[Action]:
        """This rank's verified actions for one flushed training step."""
        return self._program(True, microbatches)

    def inference_program(self, microbatches: int) -> list[Action]:
        """This rank's verified forward-only actions."""
        return self._program(False, microbatches)

    def _program(self, train: bool, microbatches: int) -> list[Action]:
        key = (train, microbatches)
        if key not in self._programs:
            d = self.topology.depth
            program = (
                build_schedule(self.schedule, d, microbatches, self.split_backward, self.split_max_pending)
                if train
                else build_inference(d, microbatches)
            )
            verify(program, microbatches, train=train)
            self._programs[key] = program[self.stage_index]
        return self._programs[key]

    def _window(self) -> list[Action]:
        if self.streaming:
            return two_bw_window(self.topology.depth, self.microbatches, self._batches, self.split_backward)[
                self.stage_index
            ]
        return self.train_program(self.microbatches)

    def _hooks(self) -> Hooks:
        return Hooks(
            self.module.pipeline_inputs, self.module.pipeline_loss, self._all_reduce, self._optimizer_step,
            lambda first: self.versions.weights(first // self.microbatches),
            lambda loss_sum: self._share_loss(torch.tensor(loss_sum, device=self.device)),
        )  # fmt: skip

    def _run(self, actions: list[Action], state: StepState, wait: bool = True, trace: Optional[Trace] = None) -> StepState:
        return Executor(self.stage, self.position, self.device, self._hooks(), trace=trace).run(actions, state, wait)

    # -- steps -----------------------------------------------------------------------------
    def train_step(self, batch: Any, optimizer: Optimizer, on_step: Optional[Callable[[], None]] = None) -> Tensor:
        """Run one training step on ``batch`` and return its mean loss on every stage.

        GPipe and 1F1B flush: the batch's gradient is applied before this returns. Under 2BW
        the returned loss is still this batch's, but its gradient is applied at the end of the
        next step (or by :meth:`drain`); see ``schedules/two_bw.py``.

        Args:
            batch: this pipeline's batch (every stage passes the same one).
            optimizer: the torch optimizer over this stage's parameters.
            on_step: called after every optimizer step (e.g. to step LR schedulers).
        """
        microbatches, shares = split_batch(batch, self.microbatches)
        self._optimizer, self._on_step = optimizer, on_step or (lambda: None)
        if not self.streaming:
            self.versions.clear_grads()
        self._state.add_batch(self._batches * self.microbatches, microbatches, shares)
        self.trace.clear()
        loss, self._loss_work = torch.zeros((), device=self.device), None
        if not self.position.is_last:
            self._share_loss(loss)  # posted now, filled when the last stage has the loss
        self._run(self._window(), self._state, wait=not self.streaming, trace=self.trace)
        self._batches += 1
        if self.position.is_last:
            loss.fill_(self._state.loss_sum)
        if self._loss_work is not None:
            self._loss_work.wait()
        self.last_peak_stash = self._state.peak_stash
        self.last_peak_stash_bytes = self._state.peak_stash_bytes
        if not self.streaming:
            self._restart()  # a flushed step leaves nothing in flight
        return loss

    def _share_loss(self, loss: Tensor) -> None:
        """Post this step's loss broadcast from the last stage without waiting for it.

        The last stage posts it as soon as its last microbatch loss is in (the ``loss_done``
        hook), mid-window; the others post at the start and wait only at the end. Waiting in
        the middle of a 2BW window would stall stage 0 until the last stage's window ended.
        """
        self._loss_work = None
        if self.pp_group is not None and self.topology.depth > 1:
            self._loss_work = dist.broadcast(loss, src=self.last_rank, group=self.pp_group, async_op=True)

    @property
    def in_flight(self) -> int:
        """Microbatches forwarded but not yet backwarded on this stage (2BW keeps them across steps)."""
        return self._state.live

    def drain(self) -> None:
        """Finish every in-flight microbatch and apply the outstanding update (2BW); no-op otherwise.

        Lightning calls this before validation, checkpoints and the end of fit, so weights are
        consistent there. The next training step starts a fresh warm-up from the newest weights.
        """
        if not self.streaming or self._batches == 0:
            return
        last = self._batches - 1
        program = two_bw_drain(self.topology.depth, self.microbatches, last, self.split_backward)[self.stage_index]
        with torch.inference_mode(False), torch.enable_grad():  # Lightning may call this from evaluation
            self._run(program, self._state)
        self.versions.collapse(self._optimizer, self._batches - 1)
        self._restart()

    def forward(self, batch: Any, with_loss: bool = False) -> Any:
        """Forward-only pass; returns the model output (or mean loss) on every stage of the pipeline."""
        self.drain()
        microbatches, shares = split_batch(batch, self.microbatches)
        state = StepState({}, {}, train=False)
        state.add_batch(0, microbatches, shares)
        state = self._run(self.inference_program(len(microbatches)), state)
        if not self.position.is_last:
            return self._from_last_stage(torch.zeros((), device=self.device) if with_loss else None)
        outputs = [state.results[k] for k in range(len(microbatches))]
        if with_loss:
            losses = [self.module.pipeline_loss(o, mb) * s for o, mb, s in zip(outputs, microbatches, shares)]
            return self._from_last_stage(torch.stack(losses).sum().float())
        return self._from_last_stage(_concat(outputs))

    # -- whole-batch actions ---------------------------------------------------------------
    def _all_reduce(self) -> None:
        """AR: average the batch's gradients over the stage's replicas, then start the global
        (all-stage) squared-norm sum that the batch's optimizer step will read."""
        params = self.versions.grads_of(self._reduced)
        self._reduced += 1
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self._average_over_replicas([p.grad for p in params])
        local = torch.stack([g.detach().float().pow(2).sum() for g in (p.grad for p in params)]).sum() if params else torch.zeros((), device=self.device)
        work = None
        if self.norm_group is not None:
            work = dist.all_reduce(local, group=self.norm_group, async_op=True)
        self._norms.append((local, work))

    def _average_over_replicas(self, grads: list[Tensor]) -> None:
        if self.dp_group is None or self.topology.width == 1:
            return
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for group in by_dtype.values():
            flat = _flatten_dense_tensors(group)
            dist.all_reduce(flat, group=self.dp_group)
            flat /= self.topology.width
            for g, reduced in zip(group, _unflatten_dense_tensors(flat, group)):
                g.copy_(reduced)

    def _optimizer_step(self) -> float:
        """OPT: clip to the global norm, skip on a non-finite gradient (same on every rank), step.

        Returns:
            When the global norm arrived: the step's own work began then (the trace shows the
            wait before it as idle).
        """
        batch = self._stepped
        self._stepped += 1
        params = self.versions.begin_step(batch, self._optimizer)
        squared, work = self._norms.popleft()
        if work is not None:
            work.wait()
        ready = now()
        norm = float(squared.sqrt())
        if math.isfinite(norm):
            self._clip(params, norm)
            self._optimizer.step()
        else:
            self.skipped_steps += 1
        self.versions.end_step(batch)
        self._on_step()
        return ready

    def _clip(self, params: list[Tensor], norm: float) -> None:
        if self.gradient_clip_val is None:
            return
        coef = self.gradient_clip_val / (norm + 1e-6)  # as torch.nn.utils.clip_grad_norm_
        if coef < 1.0:
            for p in params:
                p.grad.mul_(coef)

    def current_weights(self) -> dict[str, Tensor]:
        """The newest version of this stage's parameters, by their names in the module."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        slot = self.versions.slot_of(self._stepped - 1) if self._stepped else 0
        newest = self.versions.slots[slot] or self.versions.slots[0]
        return {names[id(p0)]: p.detach() for p0, p in zip(self.versions.slots[0], newest)}

    # -- collectives -----------------------------------------------------------------------
    def _from_last_stage(self, value: Any) -> Any:
        if self.pp_group is None or self.topology.depth == 1:
            return value
        if isinstance(value, Tensor) and value.dim() == 0:
            dist.broadcast(value, src=self.last_rank, group=self.pp_group)
            return value
        box = [value]
        dist.broadcast_object_list(box, src=self.last_rank, group=self.pp_group, device=self.device)
        return box[0]

    def full_state_dict(self) -> dict[str, Tensor]:
        """The whole model's state dict, keyed by the original names, on every rank of the pipeline."""
        self.drain()
        local = {k: v.detach().cpu() for k, v in self.module.state_dict().items()}
        return {k: v for part in self.gather_stages(local) for k, v in part.items()}

    def gather_stages(self, obj: Any) -> list[Any]:
        """One object from each stage of this rank's pipeline, in stage order."""
        if self.pp_group is None or self.topology.depth == 1:
            return [obj]
        parts: list[Any] = [None] * self.topology.depth
        dist.all_gather_object(parts, obj, group=self.pp_group)
        return parts


def _concat(outputs: list[Any]) -> Any:
    if isinstance(outputs[0], Tensor):
        return torch.cat(outputs)
    return tuple(torch.cat(parts) for parts in zip(*outputs))
