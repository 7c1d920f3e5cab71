"""One rank's share of the pipeline: runs training and inference steps over a placed stage."""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_pipe.core.pipeline_plan import PipelinePlan
from lightning_pipe.runtime.buckets import DEFAULT_BUCKET_BYTES
from lightning_pipe.runtime.comm import p2p
from lightning_pipe.runtime.comm.groups import PipelineGroups
from lightning_pipe.runtime.executor import Executor, Hooks, Position, StepState
from lightning_pipe.runtime.microbatch import batch_size, split_batch
from lightning_pipe.runtime.replica_buffers import BufferBroadcast
from lightning_pipe.runtime.sharding import ShardedGradients
from lightning_pipe.runtime.stage import Stage
from lightning_pipe.runtime.ties import TieChecksums, TiedGradients
from lightning_pipe.runtime.update import UpdatePath
from lightning_pipe.runtime.versions import WeightVersions
from lightning_pipe.schedules import (
    Action,
    build_inference,
    build_schedule,
    receive_order,
    two_bw_arrivals,
    two_bw_run,
    two_bw_stage_drain,
    two_bw_stage_window,
    verify,
)
from lightning_pipe.schedules.timeline import Trace


class PipelineEngine:
    """Runs training and inference steps of one rank of a ``w x d`` pipeline.

    It neither places blocks nor builds process groups: :class:`~lightning_pipe.runtime.placement.Placement`
    gives it the stage and :class:`~lightning_pipe.runtime.groups.PipelineGroups` the groups
    (see :func:`~lightning_pipe.runtime.placement.place` for both in one call).

    Args:
        module: the user's model (its ``pipeline_inputs`` and ``pipeline_loss`` are called).
        stage: the blocks this rank runs: one stage, or (``plan.virtual_stages > 1``) its
            stages in chain order, as :meth:`~lightning_pipe.runtime.placement.Placement.apply` returns them.
        plan: the layout (schedule, microbatches, split backward, depth and width).
        rank: this process's global rank.
        groups: the layout's process groups; ``None`` only when running one process.
        device: device of this rank's stage.
        gradient_clip_val: clip the gradient to this global norm (over all stages) before a step.
        loss: what :meth:`train_step` returns: ``"current"``, the step's own loss (every stage
            waits until the last stage has it); ``"previous"``, the loss of the step before,
            whose broadcast has long arrived, so no stage waits (2BW: no synchronisation at
            window ends). An engine's first step has no previous one and returns its own.
        bucket_bytes: with replicas, gradients are averaged in buckets of at most this many
            bytes, each posted during the backward once final (0: one blocking all-reduce at
            the AR action); see :class:`~lightning_pipe.runtime.update.UpdatePath`.
        broadcast_buffers: with replicas, replica 0's buffers (BatchNorm's running statistics)
            overwrite the other replicas' before each training step and at a drain that follows
            one, in one coalesced broadcast (``DistributedDataParallel(broadcast_buffers=True)``'s
            rule; :class:`~lightning_pipe.runtime.replica_buffers.BufferBroadcast`). ``False``:
            each replica keeps the statistics of its own shard, and the replicas drift apart.

    With parameters tied across stages, a drain that follows a training step (and
    :meth:`check_ties`) compares the copies by checksum and raises
    :class:`~lightning_pipe.runtime.ties.TiedCopiesDivergedError` on every rank if they differ.
    """

    LOSS_MODES = ("current", "previous")

    def __init__(
        self,
        module: nn.Module,
        stage: Union[Stage, Sequence[Stage]],
        plan: PipelinePlan,
        rank: int,
        groups: Optional[PipelineGroups] = None,
        device: Optional[torch.device] = None,
        gradient_clip_val: Optional[float] = None,
        loss: str = "current",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        broadcast_buffers: bool = True,
    ) -> None:
        if loss not in self.LOSS_MODES:
            raise ValueError(f"loss must be one of {self.LOSS_MODES}, got {loss!r}")
        if groups is None and plan.world_size > 1:
            raise ValueError(f"a {plan.width} x {plan.depth} plan needs its process groups (PipelineGroups.build)")
        self.module, self.plan, self.rank, self.groups = module, plan, rank, groups
        self.stages = [stage] if isinstance(stage, Stage) else list(stage)
        self.topology = plan.topology
        self.device = device or torch.device("cpu")
        self.stage_index = self.topology.position_of(rank)  # this rank's position in its pipeline
        self.lane = self.topology.tp_index_of(rank)  # its tensor-parallel index: its neighbours share it
        self.position = self._position()
        self.positions = (
            [self._stage_position(st.index) for st in self.stages] if plan.virtual_stages > 1 else [self.position]
        )
        self.streaming = plan.spec.streams  # the stream of microbatches runs on across steps
        params = {id(p): p for st in self.stages for p in st.parameters()}  # a tie between two of them: once
        self._parameters = list(params.values())
        self.versions = WeightVersions(self._parameters, double=self.streaming)
        users = Counter(id(p) for st in self.stages for p in st.parameters())  # stages of this rank using each
        uses = [users[id(p)] for p in self._parameters]
        sharded = (
            ShardedGradients([b for st in self.stages for b in st.blocks], plan.reshard_after_forward)
            if plan.data_parallel == "fsdp" and plan.width > 1
            else None
        )
        self.update = UpdatePath(
            self.versions, plan.width, groups, self.device, gradient_clip_val, bucket_bytes, uses, sharded
        )
        self.update.watch(self.versions.slots[0])
        ties = self.stages[0].ties
        self.early_step = not ties  # 2BW: stage 0 steps right after its all-reduce (schedules/two_bw.py)
        self.tie_checksums: Optional[TieChecksums] = None
        if ties and groups is not None:  # every rank builds every tie's groups
            names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
            local = [names[id(p)] for p in params.values()]
            self.update.ties = TiedGradients(ties, local, self.topology, rank)
            self.tie_checksums = TieChecksums(ties, local, self.topology, rank)
        self.buffer_broadcast = self._buffer_broadcast() if broadcast_buffers else None
        self._buffers_stale = True  # replicas may hold other buffers (each ran a step, or the engine is new)
        self._ties_unchecked = False  # a step ran since the tied copies were last compared
        self.last_peak_stash = 0
        self.last_peak_stash_bytes = 0
        self.trace = Trace(rank)
        # Record each step's trace (the AutoPlanner's calibration), and count the bytes held for
        # backward (the monitor): the counting's saved-tensor hooks make a GPT step 3-6% longer.
        self.record_trace, self.count_stash = False, False
        self.links = p2p.Links(plan.microbatches)  # what each message last carried: receives are posted for it
        self.loss_mode = loss
        self._loss_work: Any = None
        self._previous: Optional[tuple[Tensor, Any]] = None  # the last step's loss and its broadcast
        self._programs: dict[tuple[bool, int], tuple[list[Action], dict[int, list[Action]]]] = {}
        self._restart()
        if self.streaming:
            v = plan.virtual_stages
            verify(
                two_bw_run(
                    plan.depth, plan.microbatches, 3, plan.split_backward, self.early_step, v, plan.stage_placement
                ),
                3 * plan.microbatches,
                virtual=v,
                placement=plan.stage_placement,
            )

    @property
    def stage(self) -> Stage:
        """The blocks this rank runs (one stage per rank; see :attr:`stages` otherwise)."""
        if len(self.stages) != 1:
            raise RuntimeError(f"this rank runs {len(self.stages)} virtual stages; read engine.stages")
        return self.stages[0]

    def parameters(self) -> list[nn.Parameter]:
        """Trainable parameters of every stage this rank runs, without duplicates (what its optimizer steps)."""
        return list(self._parameters)

    @property
    def schedule(self) -> str:
        """The schedule's name."""
        return self.plan.schedule

    @property
    def microbatches(self) -> int:
        """Microbatches per batch."""
        return self.plan.microbatches

    @property
    def split_backward(self) -> bool:
        """Whether backwards are split into I and W."""
        return self.plan.split_backward

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for a non-finite gradient."""
        return self.update.skipped_steps

    def _restart(self) -> None:
        """Forget the stream: the next batch is batch 0 of a fresh warm-up."""
        self._batches = 0
        self._state = StepState({}, {})
        self.update.restart()
        self._optimizer: Optional[Optimizer] = None
        self._on_step: Callable[[], None] = lambda: None

    # -- setup -----------------------------------------------------------------------------
    def _buffer_broadcast(self) -> Optional[BufferBroadcast]:
        """Replica 0's buffers for the other replicas of this rank's stages; ``None`` without replicas or buffers."""
        if self.groups is None or self.topology.width == 1:
            return None
        modules = [m for st in self.stages for m in st.modules()]
        source = self.topology.rank_of(0, self.stage_index, self.lane)
        return BufferBroadcast(modules, self.groups.dp, source, self.rank) or None

    def _peer(self, position: int) -> int:
        """Global rank of pipeline position ``position`` in this rank's pipeline (its replica and lane)."""
        return self.topology.rank_of(self.topology.replica_of(self.rank), position, self.lane)

    def _position(self) -> Position:
        d, s = self.topology.depth, self.stage_index
        return Position(s, d, self._peer(s - 1) if s > 0 else None, self._peer(s + 1) if s < d - 1 else None)

    def _stage_position(self, stage: int) -> Position:
        """Where virtual stage ``stage`` sits: its neighbours' ranks under the plan's stage
        placement (this rank itself for the V's turn, whose handoff needs no message)."""
        stages, plan = self.plan.stages, self.plan
        prev = self._peer(plan.rank_of_stage(stage - 1)) if stage > 0 else None
        nxt = self._peer(plan.rank_of_stage(stage + 1)) if stage < stages - 1 else None
        return Position(stage, stages, prev, nxt)

    @property
    def last_rank(self) -> int:
        """Global rank of the last stage of this rank's pipeline (rank 0's under the V placement)."""
        last = self.plan.rank_of_stage(self.plan.stages - 1)
        return self._peer(last)

    @property
    def holds_last(self) -> bool:
        """Whether this rank runs the last stage (computes the loss)."""
        return self.rank == self.last_rank

    # -- programs --------------------------------------------------------------------------
    def train_program(self, microbatches: int) -> list[Action]:
        """This rank's verified actions for one flushed training step."""
        return self._program(True, microbatches)[0]

    def _program(self, train: bool, microbatches: int) -> tuple[list[Action], dict[int, list[Action]]]:
        """This rank's actions and, per source rank, its receives in the order they arrive."""
        key = (train, microbatches)
        if key not in self._programs:
            d, v = self.topology.depth, self.plan.virtual_stages
            program = (
                build_schedule(
                    self.schedule,
                    d,
                    microbatches,
                    self.split_backward,
                    self.plan.split_max_pending,
                    v,
                    self.plan.split_placement,
                    self.plan.stage_placement,
                )
                if train
                else build_inference(d, microbatches, v, self.plan.stage_placement)
            )
            verify(program, microbatches, train=train, virtual=v, placement=self.plan.stage_placement)
            arrivals = {self._peer(q): keys for q, keys in receive_order(program, self.stage_index).items()}
            self._programs[key] = (program[self.stage_index], arrivals)
        return self._programs[key]

    def _window(self) -> tuple[list[Action], Optional[dict[int, list[Action]]]]:
        if self.streaming:
            d, m, split, v = self.topology.depth, self.microbatches, self.split_backward, self.plan.virtual_stages
            window = two_bw_stage_window(
                self.stage_index, d, m, self._batches, split, self.early_step, v, self.plan.stage_placement
            )
            return window, self._stream_arrivals(self._batches, drain=False)
        return self._program(True, self.microbatches)

    def _stream_arrivals(self, step: int, drain: bool) -> Optional[dict[int, list[Action]]]:
        """Interleaved 2BW: per source rank, the window's (or drain's) receives in the order that
        rank sends them. One stage per rank: ``None``, as each neighbour sends one kind of
        message, read in the order it is sent."""
        v = self.plan.virtual_stages
        if v == 1:
            return None
        d, m = self.topology.depth, self.microbatches
        order = two_bw_arrivals(self.stage_index, d, m, step, drain, self.early_step, v, self.plan.stage_placement)
        return {self._peer(q): keys for q, keys in order.items()}

    def _hooks(self) -> Hooks:
        return Hooks(
            self.module.pipeline_inputs,
            self.module.pipeline_loss,
            self.update.all_reduce,
            lambda: self.update.optimizer_step(self._optimizer, self._on_step),
            self._weights_of,
            lambda loss_sum: self._share_loss(loss_sum.to(self.device, torch.float32)),
            self.update.gradients_accumulated,
            self.update.gradients_to_accumulate,
        )

    def _weights_of(self, first_microbatch: int, stage: int) -> Optional[list[Tensor]]:
        """The weight version stage ``stage`` runs the batch starting at ``first_microbatch`` on
        (2BW's V action), aligned with that stage's parameters; ``None``: its own parameters."""
        batch = first_microbatch // self.microbatches
        weights = self.versions.weights(batch)
        self.update.watch(self.versions.grads_of(batch))
        if weights is None or len(self.stages) == 1:
            return weights
        slot = {id(p): w for p, w in zip(self._parameters, weights)}
        return [slot[id(p)] for p in next(st for st in self.stages if st.index == stage).parameters()]

    def _train(
        self,
        actions: list[Action],
        wait: bool,
        trace: Optional[Trace] = None,
        arrivals: Optional[dict[int, list[Action]]] = None,
    ) -> None:
        """Run a training program: gradient buckets count accumulations only meanwhile."""
        self.update.arm(self.microbatches)
        try:
            self._run(actions, self._state, wait=wait, trace=trace, arrivals=arrivals)
        finally:
            self.update.arm(0)

    def close(self) -> None:
        """Release what outlives a step (gradient hooks, the tied gradients' groups) before another layout is placed."""
        self.update.close()

    @property
    def instrument(self) -> bool:
        """Whether steps record their trace and count the bytes held for backward (the monitor's)."""
        return self.record_trace and self.count_stash

    @instrument.setter
    def instrument(self, on: bool) -> None:
        self.record_trace = self.count_stash = on

    def _run(
        self,
        actions: list[Action],
        state: StepState,
        wait: bool = True,
        trace: Optional[Trace] = None,
        arrivals: Optional[dict[int, list[Action]]] = None,
    ) -> StepState:
        return Executor(
            self.stages,
            self.positions,
            self.device,
            self._hooks(),
            trace=trace if self.record_trace else None,
            links=self.links,
            account=self.count_stash,
            channel=self.groups.channel if self.groups is not None else p2p.DIRECT,
        ).run(actions, state, wait, arrivals)

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
        self._sync_buffers(always=True)  # before the step's first forward, as DDP's; 2BW: the window's
        if not self.streaming:
            self.versions.clear_grads()
        self._state.add_batch(self._batches * self.microbatches, microbatches, shares)
        self.trace.clear()
        loss, self._loss_work = (
            torch.zeros((), dtype=torch.float32, device=self.device),
            None,
        )  # the last stage's loss is float32
        if not self.holds_last:
            self._share_loss(loss)  # posted now, filled when the last stage has the loss
        actions, arrivals = self._window()
        self._train(actions, wait=not self.streaming, trace=self.trace, arrivals=arrivals)
        self._batches += 1
        self._buffers_stale = self._ties_unchecked = True
        if self.holds_last:
            loss = self._shared_loss
        loss = self._returned_loss(loss)
        self.last_peak_stash = self._state.peak_stash
        self.last_peak_stash_bytes = self._state.peak_stash_bytes
        if not self.streaming:
            self._restart()  # a flushed step leaves nothing in flight
        return loss

    def _returned_loss(self, loss: Tensor) -> Tensor:
        """This step's loss once its broadcast is in, or (``loss="previous"``) the last step's."""
        previous, self._previous = self._previous, (loss, self._loss_work)
        if self.loss_mode == "previous" and previous is not None:
            loss, work = previous
        else:
            work = self._loss_work
        if work is not None:
            work.wait()
        return loss

    def _share_loss(self, loss: Tensor) -> None:
        """Post this step's loss broadcast from the last stage without waiting for it.

        The last stage posts it as soon as its last microbatch loss is in (the ``loss_done``
        hook), mid-window; the others post at the start and wait only at the end. Waiting in
        the middle of a 2BW window would stall stage 0 until the last stage's window ended.
        """
        self._loss_work, self._shared_loss = None, loss
        if self.groups is not None and self.topology.depth > 1:
            self._loss_work = dist.broadcast(loss, src=self.last_rank, group=self.groups.pp, async_op=True)

    @property
    def in_flight(self) -> int:
        """Microbatches forwarded but not yet backwarded on this stage (2BW keeps them across steps)."""
        return self._state.live

    def drain(self, check_ties: bool = False) -> None:
        """Finish every in-flight microbatch and apply the outstanding update (2BW), then settle the
        replicas: after a training step, replica 0's buffers are broadcast to the other replicas
        and tied copies are compared (a collective: every rank drains at the same point).

        Lightning calls this before validation, checkpoints and the end of fit, so weights and
        buffers are consistent there. The next training step starts a fresh warm-up from the newest weights.

        Args:
            check_ties: compare tied copies even if no training step ran since the last comparison
                (before a checkpoint save).

        Raises:
            TiedCopiesDivergedError: on every rank, when the copies of a tied parameter differ.
        """
        if self._previous is not None and self._previous[1] is not None:  # loss="previous": settle the last broadcast
            self._previous[1].wait()
            self._previous = (self._previous[0], None)
        if self.streaming and self._batches:
            self._drain_stream()
        self._sync_buffers()
        if self._ties_unchecked or check_ties:
            self.check_ties()

    def check_ties(self) -> None:
        """Compare the copies of every parameter tied across stages by checksum (a collective over
        the job; a no-op without ties). Under 2BW, drain first: the newest weights are then in place.

        Raises:
            TiedCopiesDivergedError: on every rank, naming each tied parameter whose copies differ.
        """
        self._ties_unchecked = False
        if self.tie_checksums is not None:
            self.tie_checksums.check(self._parameters, self.device)

    def _sync_buffers(self, always: bool = False) -> None:
        """Broadcast replica 0's buffers: ``always`` (a training step starts), or if a step (or the
        engine's creation) may have made the replicas' differ since the last broadcast (a drain)."""
        if self.buffer_broadcast is not None and (always or self._buffers_stale):
            self.buffer_broadcast.broadcast()
        self._buffers_stale = False

    def _drain_stream(self) -> None:
        """2BW: run the remaining backwards, the last all-reduce and step; collapse the weight versions."""
        last = self._batches - 1
        d, m, split = self.topology.depth, self.microbatches, self.split_backward
        v, placement = self.plan.virtual_stages, self.plan.stage_placement
        program = two_bw_stage_drain(self.stage_index, d, m, last, split, self.early_step, v, placement)
        with torch.inference_mode(False), torch.enable_grad():  # Lightning may call this from evaluation
            self._train(program, wait=True, arrivals=self._stream_arrivals(last, drain=True))
        self.versions.collapse(self._optimizer, self._batches - 1)
        self._restart()

    def forward(self, batch: Any, with_loss: bool = False, first: Optional[int] = None) -> Any:
        """Forward-only pass; returns the model output (or mean loss) on every stage of the pipeline.
        ``first``: run only the batch's first ``first`` microbatches (their output, their share of the loss).

        A batch smaller than ``microbatches`` (a short last validation batch, or a validation loader
        smaller than the plan's microbatches) runs as one microbatch per sample: without gradients no
        step depends on the count.
        """
        self.drain()
        microbatches, shares = split_batch(batch, min(self.microbatches, max(batch_size(batch), 1)))
        microbatches, shares = microbatches[:first], shares[:first]
        state = StepState({}, {}, train=False)
        state.add_batch(0, microbatches, shares)
        actions, arrivals = self._program(False, len(microbatches))
        state = self._run(actions, state, arrivals=arrivals)
        if not self.holds_last:
            return self._from_last_stage(
                torch.zeros((), dtype=torch.float32, device=self.device) if with_loss else None
            )
        outputs = [state.results[k] for k in range(len(microbatches))]
        if with_loss:
            losses = [self.module.pipeline_loss(o, mb) * s for o, mb, s in zip(outputs, microbatches, shares)]
            return self._from_last_stage(torch.stack(losses).sum().float())
        return self._from_last_stage(_concat(outputs))

    # -- state -------------------------------------------------------------------------------
    def current_weights(self) -> dict[str, Tensor]:
        """The newest version of this stage's parameters, by their names in the module."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        stepped = self.update.stepped
        slot = self.versions.slot_of(stepped - 1) if stepped else 0
        newest = self.versions.slots[slot] or self.versions.slots[0]
        return {names[id(p0)]: p.detach() for p0, p in zip(self.versions.slots[0], newest)}

    # -- collectives -----------------------------------------------------------------------
    def _from_last_stage(self, value: Any) -> Any:
        if self.groups is None or self.topology.depth == 1:
            return value
        if isinstance(value, Tensor) and value.dim() == 0:
            dist.broadcast(value, src=self.last_rank, group=self.groups.pp)
            return value
        box = [value]
        dist.broadcast_object_list(box, src=self.last_rank, group=self.groups.pp, device=self.device)
        return box[0]


def _concat(outputs: list[Any]) -> Any:
    if isinstance(outputs[0], Tensor):
        return torch.cat(outputs)
    return tuple(torch.cat(parts) for parts in zip(*outputs))
