"""AutoPlanner: profile the first steps on every rank, plan, and move the running job to the best plan that fits."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import statistics
import time
from collections import defaultdict
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.utils._pytree import tree_leaves, tree_map

from lightning_pipe.core.pipeline_plan import PipelinePlan
from lightning_pipe.core.sizes import parse_size, storages
from lightning_pipe.lightning.monitor import held_tensors, logged_value_bytes
from lightning_pipe.planning import predict, search
from lightning_pipe.planning.calibration import Trial, calibrate, median_actions, traced_stalls, trial_step
from lightning_pipe.planning.links import _link_worker
from lightning_pipe.planning.profile import BlockProfile, BlockSample, Profile, effective_cores
from lightning_pipe.planning.profiler import _loss_of, host_slowdown, profile_stage
from lightning_pipe.runtime.microbatch import batch_size
from lightning_pipe.schedules import Action


class AutoPlanner(Callback):
    """Profile the first ``profile_steps`` real training steps, run the planner on the gathered
    profile, and move the job in place (``PipelineStrategy.reconfigure``) to the fastest plan that
    fits ``memory``, when it beats the current plan by ``min_gain`` or the current plan does not fit.

    Every rank profiles its own blocks on the inputs it received in a training step, and each
    stage's profiled times are scaled so that they reproduce the F and B times the trace of those
    steps measured (contention, the executor's own costs). The plan space covers every
    ``(w, d)`` with ``w * d`` = the job's processes, every microbatch size with the global batch
    fixed, every schedule (2BW only with ``allow_stale``), interleaving (``virtual_stages``), split
    backward, recompute per stage, the partition (time-balanced, and MadPipe's under a memory
    budget) and, under a memory budget, FSDP replicas (``data_parallel="fsdp"``) beside DDP ones.
    Every rank loads the global batch and trains on its replica's rows, so a width change keeps
    the samples of every global batch and the batches of every epoch: the global batch is
    ``PipelineStrategy(global_batch_size=...)``, or else the starting layout's (the training
    DataLoader's batch size times the starting width; the decision report says so).

    The profiled steps run under the strategy's layout or, when the user gave none, under a safe
    start: recompute on every stage and one sample per microbatch.

    Args:
        memory: bytes each device may hold (stage peak), as a number or a string with a unit
            (``"40GiB"``, ``"512MB"``; :mod:`lightning_pipe.core.sizes`); ``None``: a CUDA
            device's total memory, unlimited on CPU.
        profile_steps: training steps to measure before deciding (the first is a warm-up);
            they train as usual.
        allow_stale: let the planner choose PipeDream-2BW (its update is 1-stale).
        min_gain: least predicted throughput gain (0.05: 5%) worth a switch.
        recheck_every_n_steps: profile and plan again every N steps after a decision (``None``: once).
        virtual_stages: stages per rank the planner may choose (above 1: interleaved 1F1B, ``v``
            times the messages for a ``v`` times smaller bubble, or looped BFS, ZB-V and
            DualPipeV); ``(1,)`` never interleaves.
        headroom: fraction of ``memory`` kept free when planning: plans must fit
            ``memory * (1 - headroom)``. The default, 0.15, covers the memory model's misses,
            which are largest on chains whose activations dominate.
        revert_factor: after a switch, go back to the replaced plan when the new one's measured
            step (median of three, slowest rank) exceeds this many times the replaced plan's
            measured step (``None``: never).
        fsdp: whether FSDP replicas are candidates: ``None`` under a ``memory`` budget only (as
            the plan command), ``True`` always, ``False`` never (DDP replicas only).

    Attributes:
        decisions: one record per decision (step, table of candidates, chosen plan, reason,
            the profile it was planned on, switch seconds, predicted and measured step time after
            it, whether it was reverted, and where the global batch came from when the user did
            not set it).
    """

    def __init__(
        self,
        memory: Union[int, float, str, None] = None,
        profile_steps: int = 5,
        allow_stale: bool = False,
        min_gain: float = 0.05,
        recheck_every_n_steps: Optional[int] = None,
        headroom: float = 0.15,
        virtual_stages: Sequence[int] = (1, 2),
        revert_factor: Optional[float] = 2.0,
        fsdp: Optional[bool] = None,
    ) -> None:
        if profile_steps < 2:
            raise ValueError(f"profile_steps must be >= 2 (the first step is a warm-up), got {profile_steps}")
        if min_gain < 0:
            raise ValueError(f"min_gain must be >= 0, got {min_gain}")
        if not 0 <= headroom < 1:
            raise ValueError(f"headroom must be in [0, 1), got {headroom}")
        if revert_factor is not None and revert_factor < 1:
            raise ValueError(f"revert_factor must be >= 1 or None, got {revert_factor}")
        self.revert_factor, self.fsdp = revert_factor, fsdp
        if not virtual_stages or min(virtual_stages) < 1:
            raise ValueError(f"virtual_stages must list stage counts >= 1, got {virtual_stages}")
        self.headroom, self.virtual_stages = headroom, tuple(virtual_stages)
        self.memory = None if memory is None else parse_size(memory, "AutoPlanner(memory=...)")
        self.profile_steps, self.allow_stale = profile_steps, allow_stale
        self.min_gain, self.recheck_every_n_steps = min_gain, recheck_every_n_steps
        self.decisions: list[dict[str, Any]] = []
        self._start_step, self._steps_seen = 0, 0
        self._actions: dict[str, list[float]] = defaultdict(list)  # every traced action of this rank, by text
        self._ends: list[float] = []  # the profiled steps' end times (the warm-up's included)
        self._captured: dict[int, list[tuple[Tensor, ...]]] = {}  # each of this rank's stages: its inputs
        self._rows_seen: dict[int, int] = {}  # each of this rank's stages: samples forwarded since capturing began
        self._state_bytes: list[
            tuple[int, int, int, int]
        ] = []  # each block's, once profiled (profile_stage(state_bytes=))
        self._hooks: list[Any] = []
        self._batch: Any = None
        self._after: Optional[list[float]] = None
        self._step_start = 0.0
        self._prechecked = False
        self._configured_loss: Optional[str] = None  # the strategy's loss mode before any move into 2BW
        self._resumed_plan: Optional[PipelinePlan] = None
        self._safe_start_pending = False  # the safe start's microbatches, once the data gives the global batch
        self._trainer: Optional[Trainer] = None
        self._running_step: Optional[float] = None  # the running plan's measured step, slowest rank

    # -- Lightning hooks -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the plan in use (a resumed fit starts on it) and the decisions made."""
        plan = self._plan_in_use
        return {"plan": dataclasses.asdict(plan) if plan is not None else None, "decisions": len(self.decisions)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume: the fit starts on the checkpoint's plan, already decided (no new profiling unless re-checking)."""
        if state_dict.get("plan") is not None:
            self._resumed_plan = PipelinePlan(**state_dict["plan"])

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """After a resume, move to the plan the checkpoint was saved under (its weights already loaded by name)."""
        if self._resumed_plan is None and trainer.global_step == 0:
            _check_steps(self.profile_steps, trainer.estimated_stepping_batches, "the fit has")
        if self._safe_start_pending and self._resumed_plan is None:
            safe = _safe_start(trainer.strategy.plan, trainer.strategy.global_batch_size)
            if safe != trainer.strategy.plan:
                trainer.strategy.reconfigure(safe)  # before the first step: nothing trained yet moves
        self._safe_start_pending = False
        if self._resumed_plan is not None:
            if self._resumed_plan != trainer.strategy.plan:
                trainer.strategy.reconfigure(self._resumed_plan)
            rank_zero_info(f"AutoPlanner: resumed on the checkpoint's plan {trainer.strategy.plan.describe()}")
            self._steps_seen, self._prechecked = self.profile_steps, True
            self._start_step, self._resumed_plan = trainer.global_step, None

    @property
    def _plan_in_use(self) -> Optional[PipelinePlan]:
        return self._trainer.strategy.plan if self._trainer is not None else None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Let the strategy change the layout during fit (global batches on every rank)."""
        self._trainer = trainer
        if stage == "fit":
            if not callable(getattr(trainer.strategy, "reconfigure", None)):
                raise TypeError(
                    f"AutoPlanner needs Trainer(strategy=PipelineStrategy(...)), got {type(trainer.strategy).__name__}"
                )
            _check_steps(self.profile_steps, trainer.max_steps)
            trainer.strategy.enable_reconfiguration()
            if not trainer.strategy.layout_given:
                self._start_safely(trainer.strategy)

    def _start_safely(self, strategy: Any) -> None:
        """Place the safe start; its microbatch count waits for the global batch if the data sets it."""
        if strategy.global_batch_size is None:  # known once the data is set up: see on_train_start
            strategy.start_with(strategy.plan.replace(recompute=True))
            self._safe_start_pending = True
        else:
            strategy.start_with(_safe_start(strategy.plan, strategy.global_batch_size))

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        """Capture this stage's inputs in the last profiled step; start the step clock."""
        if not self._prechecked:
            self._precheck(trainer, pl_module, batch)
        self._step_start = time.perf_counter()
        if not self._profiling(trainer):
            return
        trainer.strategy.engine.record_trace = (
            True  # the executor's trace calibrates the profile (no stash counting: it slows the step)
        )
        if self._steps_seen == self.profile_steps - 1:
            self._batch = trainer.strategy.replica_batch(batch)
            self._hooks = self._capture_inputs(trainer.strategy.engine)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Collect the step's trace; decide after the profiled steps; time the steps after a switch."""
        elapsed = time.perf_counter() - self._step_start
        if self._after is not None:
            self._record_after(trainer, elapsed)
        if not self._profiling(trainer):
            if self.recheck_every_n_steps and trainer.global_step - self._start_step >= self.recheck_every_n_steps:
                self._start_step, self._steps_seen = trainer.global_step, 0  # profile (and decide) again
            return
        self._steps_seen += 1
        self._ends.append(time.perf_counter())
        if self._steps_seen > 1:  # the first is a warm-up
            self._collect(trainer.strategy.engine)
        trainer.strategy.engine.record_trace = False  # a PipelineMonitor turns it on again for its steps
        if self._steps_seen == self.profile_steps:
            self._remove_hooks()
            self._decide(trainer, pl_module)

    # -- profiling -------------------------------------------------------------------------
    def _profiling(self, trainer: Trainer) -> bool:
        return self._steps_seen < self.profile_steps

    def _capture_inputs(self, engine: Any) -> list[Any]:
        """Start keeping every stage's inputs of this rank (one stage, or interleaved several)."""
        self._captured = {st.index: [] for st in engine.stages}
        self._rows_seen = {st.index: 0 for st in engine.stages}
        return [st.register_input_hook(functools.partial(self._capture, st.index)) for st in engine.stages]

    def _remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _capture(self, stage: int, args: tuple) -> None:
        """Keep ``stage``'s inputs of the latest microbatch, of the latest two where a microbatch is
        one sample (:func:`_profile_inputs`; recomputations are not forwards). Not copied: the stage
        holds them until their backward anyway, and received tensors are never reused. Each
        forward lets the one before go, so that only the step's last inputs outlive their
        backward (the first microbatch's, kept instead, would hold one input more through the
        whole step, above a recomputed stage's step peak)."""
        kept = self._captured[stage]
        kept.append(tuple(a.detach() for a in args if isinstance(a, Tensor)))
        del kept[: -(2 if batch_size(kept[-1]) == 1 else 1)]
        self._rows_seen[stage] += batch_size(kept[-1])

    def _first_captured_row(self, stage: int) -> int:
        """The row of the step's batch where ``stage``'s kept inputs begin (microbatches are
        contiguous rows; their sizes may differ by one)."""
        return self._rows_seen[stage] - sum(map(batch_size, self._captured[stage]))

    def _all_captured(self) -> list[tuple[Tensor, ...]]:
        return [inputs for stage in sorted(self._captured) for inputs in self._captured[stage]]

    def _collect(self, engine: Any) -> None:
        """Seconds of every action of this rank in the step just run, by its text form (``"0F1"``)."""
        for interval in engine.trace.intervals:
            self._actions[str(interval.action)].append(interval.end - interval.start)

    def _measured(self, stage: int) -> tuple[float, float, float]:
        """Mean F, B (or I + W) and optimizer-step seconds of ``stage`` over the profiled steps (the
        rank's step is charged to its first stage)."""
        times: dict[str, list[float]] = defaultdict(list)  # this stage's, by action kind
        for text, seconds in self._actions.items():
            action = Action.parse(text)
            if action.stage == stage:
                times[action.kind.value] += seconds
        mean = lambda k: statistics.fmean(times[k]) if times[k] else 0.0  # noqa: E731
        backward = mean("B") if times["B"] else mean("I") + mean("W")
        return mean("F"), backward, mean("OPT")

    def _stage_profile(self, trainer: Trainer, module: Any) -> list[tuple[int, list[BlockProfile], float]]:
        """Each of this rank's stages' calibrated block profiles and optimizer-step seconds (first replicas only).

        Blocks are profiled whole, as the planner models them: under FSDP replicas the job moves
        to the same plan with DDP replicas for the profile and back (exact moves, see
        :func:`~lightning_pipe.lightning.reconfigure.reconfigure`), since one replica cannot run a
        sharded block alone (its all-gathers need every replica). Where the ranks share fewer
        CPU cores than there are ranks, they profile one at a time (:func:`_in_turn`): the
        profile holds each block's times alone (:attr:`Profile.cores`), and the ratio of its
        times at two microbatch sizes, which prices every other size, is not the ratio of how
        many ranks happened to compute beside it at each."""
        strategy = trainer.strategy
        running = strategy.plan
        sharded = _sharded(running)
        if sharded:
            strategy.reconfigure(running.replace(data_parallel="ddp", reshard_after_forward=True))
        try:
            engine = strategy.engine
            first = running.topology.replica_of(strategy.global_rank) == 0

            def profile() -> list[tuple[int, list[BlockProfile], float]]:  # a stage's first replica profiles it
                if not first:
                    return []
                return [
                    self._profile_one(trainer, module, st, position.is_last, running)
                    for st, position in zip(engine.stages, engine.positions)
                ]

            return _in_turn(profile, _host_shared(trainer))
        finally:
            if sharded:
                strategy.reconfigure(running)

    def _profile_one(
        self, trainer: Trainer, module: Any, st: Any, is_last: bool, running: PipelinePlan
    ) -> tuple[int, list[BlockProfile], float]:
        """``st``'s blocks profiled on its captured inputs, scaled to the F and B seconds the
        profiled steps measured, and its measured optimizer-step seconds, under ``running``.

        Under FSDP replicas the measured F and B hold the all-gathers the planner charges on its
        own, so the blocks keep their profiled times (the trial of the running plan fits the
        model, :meth:`_fitted`), and the step, over a ``1/w`` shard, counts ``w`` times."""
        captured = self._captured[st.index]
        inputs = _profile_inputs(captured)
        rows = self._batch
        start = self._first_captured_row(st.index)
        loss = (lambda size, out: _loss_of(module, _rows(rows, start, size), out)) if is_last else None
        factory = _same_kind(trainer.optimizers[0])
        known = [self._state_bytes[st.first_index + i] for i in range(len(st.blocks))] if self._state_bytes else None
        with torch.random.fork_rng():
            profiles = profile_stage(
                st.blocks, st.first_index, inputs, loss, 2, factory, trainer.strategy.root_device, known
            )
        forward, backward, step = self._measured(st.index)
        if _sharded(running):
            forward, backward, step = 0.0, 0.0, step * running.width
        return (
            st.index,
            _calibrated(profiles, batch_size(captured[0]), running.recompute[st.index], forward, backward),
            step,
        )

    def _gather_profile(self, trainer: Trainer, module: Any) -> Profile:
        """Every stage's calibrated blocks, gathered on every rank, with the job's measured links."""
        strategy = trainer.strategy
        strategy.drain()
        batch_tensors = [t for t in tree_leaves(self._batch) if isinstance(t, Tensor)]
        device_bytes = _device_bytes(trainer, [t for inputs in self._all_captured() for t in inputs] + batch_tensors)
        mine = self._stage_profile(trainer, module)
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
        stages = sorted(stage for part in parts for stage in part)
        blocks = [b for _, profiles, _ in stages for b in profiles]
        self._state_bytes = [
            (b.parameter_bytes, b.gradient_bytes, b.optimizer_bytes, b.optimizer_step_bytes) for b in blocks
        ]
        large = _link_bytes(self._captured, strategy.root_device)
        self._captured = {}  # the link measurement reuses their memory
        measured = [_link_worker(strategy.global_rank, dist.get_world_size(), 1024, large, 5, strategy.root_device)]
        dist.broadcast_object_list(measured, src=0)  # rank 0's: every rank must plan on the same numbers
        links = measured[0]
        rows = self._batch
        data = tree_leaves(module.pipeline_inputs(rows))
        own = {t.untyped_storage().data_ptr() for t in tree_leaves(rows) if isinstance(t, Tensor)}
        n = batch_size(rows)
        return Profile(
            blocks,
            optimizer_step=sum(step for _, _, step in stages),
            input_bytes_per_sample=sum(
                t.numel() * t.element_size()
                for t in data
                if isinstance(t, Tensor) and t.untyped_storage().data_ptr() not in own
            )
            / n,
            batch_bytes_per_sample=sum(t.numel() * t.element_size() for t in tree_leaves(rows) if isinstance(t, Tensor))
            / n,
            loads_global_batch=True,
            cores=_shared_cores(trainer),
            device=str(strategy.root_device),
            device_bytes=device_bytes,
            shared_blocks=strategy.placement.shared_blocks,
            **links,
        )

    def _fitted(self, trainer: Trainer, profile: Profile) -> Profile:
        """``profile`` fitted to the profiled steps as a trial of the running plan
        (:func:`~lightning_pipe.planning.calibration.calibrate`): its all-reduce, optimizer step and
        the time a step takes outside its program, from every rank's traced actions and step ends."""
        strategy, self._running_step = trainer.strategy, None
        stalls = traced_stalls(self._actions, strategy.plan.microbatches)
        mine = (median_actions(self._actions), self._ends, logged_value_bytes(trainer), stalls)
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
        ends = [part[1] for part in parts]
        if min(len(e) for e in ends) < 3:
            return profile
        plan = strategy.plan
        trial = Trial(
            plan,
            max(strategy.global_batch_size // (plan.width * plan.microbatches), 1),
            trial_step([e[:-1] for e in ends], len(ends[0]) - 2),  # after the warm-up, before the capturing step
            tuple(part[0] for part in parts),
            logged_bytes=max(part[2] for part in parts),
            stalls=tuple(part[3] for part in parts),
        )
        self._running_step = trial.step
        return calibrate(profile, [trial])

    # -- deciding --------------------------------------------------------------------------
    def _budget(self, trainer: Trainer) -> Optional[float]:
        """Bytes a stage may be predicted to use: the memory budget less the headroom (``None``: unlimited)."""
        device = trainer.strategy.root_device
        if self.memory is not None:
            memory = float(self.memory)
        elif device.type == "cuda":
            memory = float(torch.cuda.get_device_properties(device).total_memory)
        else:
            return None
        return memory * (1 - self.headroom)

    def _precheck(self, trainer: Trainer, module: Any, batch: Any) -> None:
        """Under a memory budget, before the first step: profile every stage on the inputs of one
        forward-only pass of the first batch, and leave a starting plan predicted not to fit."""
        self._prechecked = True
        if self._budget(trainer) is None:
            return
        engine = trainer.strategy.engine
        self._batch = trainer.strategy.replica_batch(batch)
        self._hooks = self._capture_inputs(engine)
        try:
            with torch.no_grad():
                engine.forward(self._batch, first=2)  # what the profile needs (_capture), not the whole batch
        finally:
            self._remove_hooks()
        profile = self._gather_profile(trainer, module)
        current, ranked = self._search(trainer, profile)
        self._batch, self._captured = None, {}
        if not current.feasible:
            reason = f"before the first step: the starting plan does not fit ({current.why_infeasible()})"
            self._switch(trainer, current, ranked[0], reason, ranked, profile)

    def _search(self, trainer: Trainer, profile: Profile) -> tuple[predict.Prediction, list[predict.Prediction]]:
        """The current plan's prediction and every candidate ranked; raise if none fits the budget."""
        strategy = trainer.strategy
        plan, budget, global_batch = strategy.plan, self._budget(trainer), strategy.global_batch_size
        current = predict.predict(profile, plan, max(global_batch // (plan.width * plan.microbatches), 1), budget)
        # The running partition is a candidate too: keeping it (less what costs time) is always an option.
        # Rank 0 searches and every rank takes its ranking: one answer, and no ranks sharing a host's
        # cores to compute the same search each.
        found: list[Any] = [None]
        if dist.get_rank() == 0:
            found[0] = search.search(
                profile,
                plan.world_size,
                global_batch,
                budget,
                self.allow_stale,
                partitions=[plan.partition],
                virtual_stages=self.virtual_stages,
                fsdp=self.fsdp,  # None: FSDP replicas offered under a memory budget, as by the plan command
            )
        dist.broadcast_object_list(found, src=0)
        ranked = found[0]
        if not ranked or not ranked[0].feasible:
            smallest = min((max(p.stage_memory) for p in ranked), default=float("nan"))
            raise RuntimeError(
                f"no plan fits the memory budget of {predict._size(budget or 0)} per device (after "
                f"{self.headroom:.0%} headroom); the smallest "
                f"predicted peak is {predict._size(smallest)} (raise AutoPlanner(memory=...) or shrink the batch)"
            )
        return current, ranked

    def _decide(self, trainer: Trainer, module: Any) -> None:
        profile = self._fitted(trainer, self._gather_profile(trainer, module))
        current, ranked = self._search(trainer, profile)
        measured = _measured_peak(trainer)
        budget = self._budget(trainer)
        if measured is not None and budget is not None and measured > budget:
            current = dataclasses.replace(current, stage_memory=tuple(max(m, measured) for m in current.stage_memory))
        best, reason = _choose(current, ranked[0], self.min_gain)
        self._switch(trainer, current, best, reason, ranked, profile)
        self._start_step, self._actions, self._ends = trainer.global_step, defaultdict(list), []
        self._captured, self._batch = {}, None

    def _switch(
        self,
        trainer: Trainer,
        current: predict.Prediction,
        best: predict.Prediction,
        reason: str,
        ranked: list[predict.Prediction],
        profile: Profile,
    ) -> None:
        """Move to ``best`` unless it is ``current``; record and report the decision."""
        record = {
            "step": trainer.global_step,
            "current": current,
            "chosen": best,
            "reason": reason,
            "profile": profile,
            "table": _table(current, ranked),
            "switch_seconds": 0.0,
            "measured_step_s": None,
            "current_measured_step_s": self._running_step,
            "calibrated_step_s": _calibrated_step(best, current, [self._running_step] if self._running_step else []),
            "reverted": False,
            "global_batch_origin": getattr(trainer.strategy, "global_batch_origin", None),
        }
        if best is not current:
            start = time.perf_counter()
            self._set_loss_mode(trainer.strategy, best.plan)
            trainer.strategy.reconfigure(best.plan)
            record["switch_seconds"] = time.perf_counter() - start
        self.decisions.append(record)
        self._report(trainer, record)
        self._after = []

    def _record_after(self, trainer: Trainer, elapsed: float) -> None:
        """Time the steps after a decision (the first is a warm-up); report the median of three (the
        slowest rank's), and go back to the replaced plan if the new one measures ``revert_factor``
        times slower than it did."""
        assert self._after is not None
        self._after.append(elapsed)
        if len(self._after) < 4:
            return
        medians: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(medians, statistics.median(self._after[1:]))
        measured = max(medians)
        record = self.decisions[-1]
        record["measured_step_s"] = measured
        calibrated = record["calibrated_step_s"]
        rank_zero_info(
            f"AutoPlanner: after the decision, measured step {measured:.4f} s (predicted "
            f"{record['chosen'].step_time:.4f} s"
            + (f", {calibrated:.4f} s calibrated by the plan it replaced)" if calibrated else ")")
        )
        _log_scalars(
            trainer, {"autoplan/measured_step_s": measured, "autoplan/predicted_step_s": record["chosen"].step_time}
        )
        self._after = None
        before = record["current_measured_step_s"]
        switched = record["chosen"] is not record["current"]
        if switched and before and self.revert_factor and measured > self.revert_factor * before:
            self._revert(trainer, record, measured, before)

    def _revert(self, trainer: Trainer, record: dict[str, Any], measured: float, before: float) -> None:
        """Move back to the plan a switch replaced; profiling starts over from there when re-checking."""
        rank_zero_info(
            f"AutoPlanner: the new plan measures {measured:.4f} s a step, {measured / before:.2f}x the "
            f"{before:.4f} s of the plan it replaced (revert_factor {self.revert_factor}): going back to "
            f"{record['current'].plan.describe()}"
        )
        self._set_loss_mode(trainer.strategy, record["current"].plan)
        trainer.strategy.reconfigure(record["current"].plan)
        record["reverted"] = True
        self._start_step, self._steps_seen = trainer.global_step, self.profile_steps
        self._actions, self._ends = defaultdict(list), []

    def _set_loss_mode(self, strategy: Any, plan: PipelinePlan) -> None:
        """The loss mode ``plan`` runs with: ``"previous"`` for 2BW, which the planner prices as its
        never-flushed stream (PipeDream-2BW paper, section 3.1; a step returning its own loss
        waits at every window end), else the strategy's own; said once it changes."""
        if self._configured_loss is None:
            self._configured_loss = strategy.loss
        mode = "previous" if plan.spec.streams else self._configured_loss
        if mode != strategy.loss:
            rank_zero_info(
                f"AutoPlanner: {plan.schedule} runs with loss={mode!r}"
                + (": each step returns the previous step's loss" if mode == "previous" else "")
            )
            strategy.loss = mode

    def _report(self, trainer: Trainer, record: dict[str, Any]) -> None:
        origin = f"{record['global_batch_origin']}\n" if record["global_batch_origin"] else ""
        measured, calibrated = record["current_measured_step_s"], record["calibrated_step_s"]
        steps = (
            f"running plan: predicted {record['current'].step_time:.4f} s"
            + (f", measured {measured:.4f} s" if measured else "")
            + f"; chosen: predicted {record['chosen'].step_time:.4f} s"
            + (f" ({calibrated:.4f} s calibrated by the running plan's measured step)\n" if calibrated else "\n")
        )
        profile = record["profile"]
        shared = f"ranks sharing {profile.cores:.2f} effective cores; " if profile.cores is not None else ""
        fit = (
            f"{shared}fitted: compute x{profile.compute_scale:.2f}, optimizer step x{profile.optimizer_scale:.2f}, "
            f"all-reduce x{profile.allreduce_scale:.2f} + {profile.allreduce_latency * 1e3:.2f} ms, "
            f"{profile.step_overhead * 1e3:.1f} ms a step outside the "
            "program\n"
        )
        text = (
            f"AutoPlanner at step {record['step']}: {record['reason']}\n{origin}{steps}{fit}"
            f"chosen: {record['chosen'].plan.describe()}, "
            f"switch took {record['switch_seconds']:.3f} s\n{record['table']}"
        )
        rank_zero_info(text)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                experiment = getattr(logger, "experiment", None)
                if callable(getattr(experiment, "add_text", None)):
                    experiment.add_text("autoplan/decision", f"```\n{text}\n```", record["step"])
        _log_scalars(
            trainer,
            {
                "autoplan/switch_s": record["switch_seconds"],
                "autoplan/predicted_step_s": record["chosen"].step_time,
                "autoplan/current_predicted_step_s": record["current"].step_time,
            },
        )


def _same_kind(optimizer: torch.optim.Optimizer) -> Callable[[list[Any]], torch.optim.Optimizer]:
    """Builds an optimizer of ``optimizer``'s class and settings over other parameters (its state bytes)."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    settings = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return lambda params: type(optimizer)(params, **settings)


def _safe_start(plan: PipelinePlan, global_batch: int) -> PipelinePlan:
    """Where a job with no layout of its own starts: the same processes, recompute on every stage,
    the smallest microbatch (one sample: ``m`` = the replica's batch), so the profiled steps fit."""
    return plan.replace(microbatches=max(global_batch // plan.width, 1), recompute=True)


def _check_steps(profile_steps: int, steps: Union[int, float], what: str = "Trainer(max_steps=...) allows") -> None:
    """Refuse a fit too short to profile: it would end before the AutoPlanner decides anything."""
    if 0 <= steps < profile_steps:
        raise ValueError(
            f"AutoPlanner(profile_steps={profile_steps}) profiles that many training steps before "
            f"deciding, but {what} only {int(steps)}: lower profile_steps or train longer"
        )


def _link_bytes(
    captured: dict[int, list[tuple[Tensor, ...]]], device: torch.device, most: int = 2**20, least: int = 2**14
) -> int:
    """Size of the large message of the link measurement: one microbatch's input of a stage after
    the first, which a link carries (stage 0's comes from the data: token ids can be a hundredth
    of an activation, and a bandwidth read off a message that small is its latency's noise); the
    smallest over ranks, so every rank agrees, at most ``most`` and at least ``least``. Every
    rank of a link holds such a message in its step (its output sent, or its input received), so
    the measurement stays within the memory the captured inputs free (a fixed 1 MiB took a small
    job over its budget). Where no stage after the first runs (one stage), the smallest input."""

    def smallest(received: bool) -> float:
        inputs = [kept[0] for stage, kept in captured.items() if kept and (stage > 0) == received]
        return min((sum(t.numel() * t.element_size() for t in x) for x in inputs), default=math.inf)

    sizes = torch.tensor([smallest(True), smallest(False)], dtype=torch.float64, device=device)
    dist.all_reduce(sizes, op=dist.ReduceOp.MIN)
    carried, data = sizes.tolist()
    size = min(carried if carried < math.inf else data, most)
    return max(int(size), least)


def _profile_inputs(captured: list[tuple[Tensor, ...]]) -> list[tuple[Tensor, ...]]:
    """A stage's inputs at the microbatch sizes its in-job profile times: the first rows of the
    captured microbatch at one sample, at the geometric middle of one and its size, at half its
    size, and the whole of it (where a microbatch is one sample: the first of two captured, and
    both concatenated). A block's time at any other size is interpolated between the nearest two
    (:meth:`~lightning_pipe.planning.profile.BlockProfile.at`): a plan of smaller microbatches
    than the profiled ones would be extrapolated along the line through the two smallest, which
    per-operation overheads and caches bend (down to zero seconds, or below). Profiling one block
    at a time at no more than a microbatch holds no more than the step does, so the job stays
    within its budget (at twice the microbatch, a recomputed stage's profile can peak above its
    plan's step)."""
    first = captured[0]
    size = batch_size(first)
    if size > 1:
        sizes = sorted({1, round(math.sqrt(size)), size // 2, size})
        return [tuple(t[:n] if t.dim() > 0 else t for t in first) for n in sizes[:-1]] + [first]
    return captured[:1] + ([tuple(torch.cat(p) for p in zip(*captured))] if len(captured) > 1 else [])


def _shared_cores(trainer: Trainer) -> Optional[float]:
    """Effective CPU cores the job's ranks share (:attr:`Profile.cores`), measured: every rank's
    slowdown on a fixed matrix product while all compute at once against alone
    (:func:`~lightning_pipe.planning.profiler.host_slowdown`), averaged over the ranks, once per
    process and world size; ``None`` on accelerators (a device each)."""
    if trainer.strategy.root_device.type != "cpu":
        return None
    world = dist.get_world_size()
    if world not in _MEASURED_CORES:  # once per job: its ranks share the same host all along
        _MEASURED_CORES[world] = _measured_cores(world)
    return _MEASURED_CORES[world]


#: Effective cores measured in this process, by world size.
_MEASURED_CORES: dict[int, float] = {}


def _measured_cores(world: int) -> float:
    """The ``world`` ranks over their mean slowdown computing all at once (collective: every rank calls it)."""
    a, b = torch.randn(96, 96) / 10, torch.empty(96, 96)  # 72 KiB: the job's memory is not the probe's
    work = functools.partial(_matmuls, a, b, 1536)  # tens of milliseconds: long enough for the ranks to overlap
    slowdown = torch.tensor([host_slowdown(work, dist.barrier, dist.get_rank(), world, 5)], dtype=torch.float64)
    dist.all_reduce(slowdown)
    return effective_cores(world, float(slowdown) / world)


def _matmuls(a: Tensor, b: Tensor, times: int) -> None:
    """``times`` products of ``a`` with itself into ``b`` and back, allocating nothing."""
    for _ in range(times):
        torch.tanh(torch.mm(a, a, out=b), out=a)


def _host_shared(trainer: Trainer) -> bool:
    """Whether the job's ranks compute on fewer effective cores than there are ranks (:func:`_shared_cores`)."""
    cores = _shared_cores(trainer)
    return cores is not None and cores < dist.get_world_size()


def _in_turn(work: Callable[[], Any], shared: bool) -> Any:
    """``work()``'s result on this rank; where ``shared``, the ranks run it one at a time, rank 0
    first, each while the others wait in a barrier (collective: every rank calls it)."""
    if not shared:
        return work()
    result = None
    for rank in range(dist.get_world_size()):
        if rank == dist.get_rank():
            result = work()
        dist.barrier()
    return result


def _rows(batch: Any, start: int, size: int) -> Any:
    """``size`` samples of ``batch`` from row ``start`` (microbatches are contiguous rows)."""
    return tree_map(lambda t: t[start : start + size] if isinstance(t, Tensor) and t.dim() > 0 else t, batch)


def _sharded(plan: PipelinePlan) -> bool:
    """Whether ``plan``'s replicas hold FSDP shards (``data_parallel="fsdp"`` with replicas to shard over)."""
    return plan.data_parallel == "fsdp" and plan.width > 1


def _calibrated(
    profiles: list[BlockProfile], b: int, recompute: bool, forward: float, backward: float
) -> list[BlockProfile]:
    """Scale the stage's profiled times so that at microbatch size ``b`` its F and B equal the
    measured ones (``forward``/``backward`` seconds per microbatch; a recomputed B includes a forward)."""
    at = [p.at(b) for p in profiles]
    f_pred = sum(s.forward for s in at)
    b_pred = sum(s.backward + (s.forward if recompute else 0.0) for s in at)
    f_scale = forward / f_pred if forward > 0 and f_pred > 0 else 1.0
    b_scale = backward / b_pred if backward > 0 and b_pred > 0 else 1.0

    def scaled(s: BlockSample) -> BlockSample:
        return dataclasses.replace(
            s,
            forward=s.forward * f_scale,
            backward=s.backward * b_scale,
            input_grad=s.input_grad * b_scale,
            weight_grad=s.weight_grad * b_scale,
        )

    return [dataclasses.replace(p, samples=[scaled(s) for s in p.samples]) for p in profiles]


def _calibrated_step(best: predict.Prediction, current: predict.Prediction, measured: list[float]) -> Optional[float]:
    """``best``'s predicted step scaled by the running plan's measured over predicted step: what the
    model misses on this host for the running plan (the executor's costs, contention) it is
    taken to miss alike for the other; ``None`` without a measured step."""
    if not measured or current.step_time <= 0:
        return None
    return best.step_time * statistics.median(measured) / current.step_time


def _choose(current: predict.Prediction, best: predict.Prediction, min_gain: float) -> tuple[predict.Prediction, str]:
    """The plan to run and why."""
    if not current.feasible:
        return best, f"the current plan does not fit ({current.why_infeasible()}); switching to the fastest that does"
    gain = best.samples_per_second / current.samples_per_second - 1
    if best.plan != current.plan and gain >= min_gain:
        return best, f"the best plan is predicted {gain:.1%} faster than the current one (min_gain {min_gain:.0%})"
    return current, f"keeping the current plan: the best is predicted {gain:.1%} faster (min_gain {min_gain:.0%})"


def _table(
    current: predict.Prediction, ranked: list[predict.Prediction], rows: int = 10, rejected_rows: int = 6
) -> str:
    """The candidate table: the fastest plans that fit, the fastest rejected for memory (and why),
    and the current plan; each with its microbatch size, predicted step, throughput and peak memory."""
    fits = [p for p in ranked if p.feasible]
    rejected = [p for p in ranked if not p.feasible]
    shown = fits[:rows] + rejected[:rejected_rows]
    is_current = lambda p: (p.plan, p.microbatch_size) == (current.plan, current.microbatch_size)  # noqa: E731
    lines = ["rank | plan | b | step (s) | samples/s | peak per stage | verdict"]
    for p in shown + ([] if any(map(is_current, shown)) else [current]):  # the current plan once
        verdict = "fits" if p.feasible else "rejected: " + p.why_infeasible()
        place = ranked.index(p) + 1 if p in ranked else "-"
        lines.append(
            f"{place} | {p.plan.describe()} | {p.microbatch_size} | {p.step_time:.4f} | "
            f"{p.samples_per_second:.1f} | {predict._size(max(p.stage_memory))} | "
            f"{'current, ' if is_current(p) else ''}{verdict}"
        )
    lines.append(f"({len(ranked)} candidates, {len(rejected)} rejected for memory)")
    return "\n".join(lines)


def _measured_peak(trainer: Trainer) -> Optional[float]:
    """The most device memory any rank allocated so far (CUDA), or ``None`` (not measured on CPU)."""
    device = trainer.strategy.root_device
    if device.type != "cuda":
        return None
    peaks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, torch.cuda.max_memory_allocated(device))
    return float(max(peaks))


def _device_bytes(trainer: Trainer, extra: list[Tensor]) -> int:
    """Bytes any rank's CUDA device holds between steps beyond its stage's weights, gradients,
    optimizer state and ``extra`` (library workspaces, communication buffers); 0 off CUDA."""
    device = trainer.strategy.root_device
    if device.type != "cuda":
        return 0
    engine = trainer.strategy.engine
    params = [p for slot in engine.versions.slots for p in slot or ()]
    known = storages(t for t in held_tensors(params, trainer.optimizers) + extra if t.device == device)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, max(torch.cuda.memory_allocated(device) - sum(known.values()), 0))
    return int(max(gathered))


def _log_scalars(trainer: Trainer, metrics: dict[str, float]) -> None:
    if trainer.is_global_zero:
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
