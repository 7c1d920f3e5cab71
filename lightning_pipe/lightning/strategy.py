"""PipelineStrategy: Lightning glue that places a PipelinePlan on every rank, runs its engine, checkpoints by name."""

from __future__ import annotations

import atexit
import dataclasses
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, Mapping, Optional

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import _destroy_dist_connection
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer
from torch.utils._pytree import tree_map
from typing_extensions import override

from lightning_pipe.core.pipeline_plan import PartitionArg, PipelinePlan, RecomputeArg
from lightning_pipe.core.topology import Topology
from lightning_pipe.lightning import checkpoint as _checkpoint
from lightning_pipe.lightning.data import ResumableLoader, per_replica_loader, starting_global_batch
from lightning_pipe.lightning.profiled_partition import profiled_partition
from lightning_pipe.lightning.reconfigure import reconfigure
from lightning_pipe.runtime.autograd.deferred_norm import convert_deferred_batch_norm
from lightning_pipe.runtime.comm.groups import PipelineGroups
from lightning_pipe.runtime.engine import PipelineEngine
from lightning_pipe.runtime.placement import Placement, pipeline_blocks_of
from lightning_pipe.schedules.registry import get as get_schedule

#: The layout arguments' defaults: PipelinePlan's own, with ``pipeline_depth=None`` (every device in one pipeline).
_LAYOUT_DEFAULTS: dict[str, Any] = {
    "pipeline_depth": None,
    **{f.name: f.default for f in dataclasses.fields(PipelinePlan) if f.name not in ("width", "depth")},
}


def _destroy_groups_at_exit() -> None:
    """Destroy every process group when the interpreter exits, before it finalizes (registered
    once per process, however many runs call this). Lightning does so only for NCCL; gloo's
    threads can still hold work when a group is left to the interpreter's finalization, which
    can abort the process ("terminate called without an active exception"; pytorch/pytorch PR
    179291)."""
    atexit.unregister(_destroy_dist_connection)
    atexit.register(_destroy_dist_connection)


class PipelineStrategy(DDPStrategy):
    """Train a :class:`~lightning_pipe.PipelineMixin` module over ``w x d`` processes.

    Each of ``d`` pipeline stages holds a contiguous slice of the model's blocks and is
    replicated ``w = world_size / (d * t)`` times; replicas of a stage average their gradients.
    With ``tensor_parallel=t > 1`` each replica of a stage runs on ``t`` ranks, which split its
    layers as the module's :meth:`~lightning_pipe.PipelineMixin.configure_stage` says.
    The layout is a :class:`~lightning_pipe.PipelinePlan`: pass one as ``plan=``, or the
    separate layout arguments below (the plan is then built once the world size is known).

    A parameter shared by blocks on different stages (tied weights) has a copy on each; their
    gradients are summed so every copy takes the same step. The copies are compared by checksum
    before validation, testing and the end of fit (after training steps) and before every
    checkpoint save, never per step; if they differ, every rank raises
    :class:`~lightning_pipe.runtime.ties.TiedCopiesDivergedError` naming the parameter and its
    stages. Edit tied weights only through the optimizer, or identically in every copy.

    Args:
        schedule: "gpipe", "1f1b" (PipeDream-Flush) or "2bw" (PipeDream-2BW: two weight
            versions, 1-stale updates, no flush between steps; needs ``microbatches >= d``).
        pipeline_depth: number of stages ``d``; default: all devices form one pipeline.
        microbatches: microbatches ``m`` each batch is split into (unevenly if needed).
        partition: "balanced" (by ``pipeline_block_costs()`` or parameter count), "uniform",
            "profile" (by the F + B time of each block, profiled on rank 0 at setup on the
            module's ``example_input_array``) or an explicit list of blocks per stage.
        recompute: activation recomputation (torch.utils.checkpoint), for all or per stage.
        gradient_clip_val: clip gradients to this global norm, computed over all stages
            (Lightning's own ``Trainer(gradient_clip_val=...)`` is not available with manual
            optimization). Steps with a non-finite gradient are always skipped, on every rank.
        loss: what ``pipeline_step`` returns (and the example logs as ``train_loss``):
            ``"current"``, the step's own mean loss, for which every stage waits until the last
            stage has it; ``"previous"``, the previous step's, already on every stage, so no
            stage waits (under 2BW the stream then never synchronises at window ends). The
            first step after the layout is placed returns its own.
        split_backward: split each backward into input gradients (sent upstream at once) and
            weight gradients (delayed into idle time), 2BP; any module, through autograd.
        split_max_pending: with ``split_backward``, the most microbatches waiting for their
            weight gradients on every stage (bounds memory). ``None``: stage ``s`` keeps ``s``
            (Zero Bubble's ZB-H1 bound; GPipe defers W's up to it, see schedules/w_placement.py).
            GPipe and 1F1B only: 2BW keeps at most one waiting.
        split_placement: with ``split_backward``, where the weight gradients go: ``None`` for
            the schedule's own, "drain" (1F1B, one stage per rank): only the backwards after a
            stage's last forward split (1F1B's peak memory; half of ZB-H1's saving with equal
            F, I and W), or "end", "cooldown", "zb-h1", "bounded" (schedules/w_placement.py; see
            :class:`~lightning_pipe.PipelinePlan`).
        inner: "pp" (default): the stages of a pipeline run on neighbouring ranks, so
            activations stay inside a node; "dp": the replicas of a stage do, so the gradient
            all-reduce stays inside a node (multi-node jobs; ``python -m lightning_pipe.plan``
            says which carries more bytes).
        virtual_stages: stages per rank ``v`` (default 1). Above 1 the chain is cut into
            ``d * v`` stages and each rank runs ``v`` of them (which ones: ``placement``);
            ``partition`` and ``recompute`` lists then give one entry per stage (``d * v``).
            With ``schedule="1f1b"`` the schedule is interleaved 1F1B (Megatron-LM's): the
            bubble is ``v`` times smaller for ``v`` times the messages; it needs ``microbatches``
            a multiple of ``d``, and with ``split_backward`` each rank places its W's as ZB-H1
            does. With ``schedule="2bw"`` it is interleaved 2BW (each rank's stream never
            flushed; under the loop placement ``m`` a multiple of ``d`` with
            ``m v >= 2 (d-1) + (v-1) d``, in a V ``v = 2`` and ``m >= 2d - 1``; split backward
            keeps one W waiting per stage). ``schedule="looped_bfs"`` runs any ``v``; "zbv" and
            "dualpipev" need ``v = 2``.
        placement: which rank runs which stage with ``virtual_stages > 1``: "loop" (rank ``r``:
            stages ``r, r + d, ...``) or "v" (rank ``r``: stages ``r`` and ``2d - 1 - r``, the
            V of ZB-V and DualPipeV, and of 2BW); ``None`` for the schedule's own (schedules/layout.py).
        data_parallel: how the ``w`` replicas of a stage hold it: "ddp" (default), full copies
            whose gradients are all-reduced in buckets; "fsdp", shards: each block of the stage
            is wrapped with FSDP2's ``fully_shard`` over ``device_mesh["data_parallel"]``,
            so its weights, gradients and optimizer state (built by ``configure_optimizers``
            over the sharded parameters) are split ``w`` ways; parameters are all-gathered
            for each block's forward and backward, and gradients reduce-scattered once per
            batch, after its last backward (under split backward, after its last W). GPipe,
            1F1B and interleaved 1F1B, with or without split backward, and ZB-V; 2BW is
            refused. Parameters tied across stages are refused.
        reshard_after_forward: with ``data_parallel="fsdp"``: free a block's gathered
            parameters after each forward (ZeRO-3 memory, default), or keep them gathered until
            the batch's gradients are reduced (``False``: ZeRO-2 memory, fewer all-gathers).
        tensor_parallel: ranks ``t`` each stage replica is split over (default 1; the job then
            needs ``w * d * t`` processes). The mesh gains a "tensor_parallel" dimension, and
            the module's ``configure_stage(blocks, tp_mesh)`` hook receives its slice for each
            stage, after placement and before ``configure_optimizers``, to call
            ``torch.distributed.tensor.parallel.parallelize_module``. The ``t`` ranks of a
            stage replica receive the same activations (rank ``k`` of a stage exchanges with
            rank ``k`` of its neighbours) and read the same batches; gradients are averaged over
            the ``w`` replicas only, and the clipping norm counts every split parameter's parts
            once. GPipe and 1F1B, one stage per rank, DDP replicas, no split backward; the
            AutoPlanner and :meth:`reconfigure` are refused.
        plan: the whole layout as one value, instead of the layout arguments above; its
            ``width * depth`` must equal the number of processes.
        save_distributed_checkpoint: write checkpoints as a torch.distributed.checkpoint
            directory, one shard per stage (default); ``False`` writes one consolidated file,
            gathered on rank 0 only.
        global_batch_size: samples per training step over all replicas; the training
            DataLoader's batch size is set to ``global_batch_size / w``, so any width trains on
            the same global batches. Without it, reconfiguring during fit (the AutoPlanner) keeps
            the starting layout's: the DataLoader's batch size times the starting width.
        bucket_cap_mb: with ``w > 1``, each stage's gradients are averaged over its replicas in
            buckets of at most this many MiB, each all-reduce posted during the backward as soon
            as its gradients are final, as DDP does (default 25, DDP's); 0: one blocking
            all-reduce after the stage's last backward.
        deferred_batch_norm: replace every BatchNorm in the blocks by a
            :class:`~lightning_pipe.runtime.deferred_norm.DeferredBatchNorm` (torchgpipe's): each
            microbatch is still normalised with its own statistics, but the running statistics
            are updated once per batch, from the whole batch. Default: they are updated once per
            microbatch, in order, as gradient accumulation over the microbatches would.
        broadcast_buffers: with ``w > 1``, replica 0's buffers (BatchNorm's running statistics)
            overwrite every other replica's before each training step and before evaluation and
            checkpoints, in one coalesced broadcast per stage, as
            ``DistributedDataParallel(broadcast_buffers=True)`` does (default), so every replica
            evaluates and saves the same model. ``False``: each replica updates its statistics
            from its own shard only, the replicas drift apart, and a checkpoint keeps one of them.
        timeout: timeout of every collective and transfer; a stuck rank fails after it.
        process_group_backend: "gloo" or "nccl"; default from the device.
        start_method: Lightning launcher start method; "popen" (default) re-runs the script.
    """

    strategy_name = "pipeline"

    def __init__(
        self,
        schedule: str = PipelinePlan.schedule,
        pipeline_depth: Optional[int] = None,
        microbatches: int = PipelinePlan.microbatches,
        partition: PartitionArg = PipelinePlan.partition,
        recompute: RecomputeArg = PipelinePlan.recompute,
        gradient_clip_val: Optional[float] = None,
        loss: str = "current",
        split_backward: bool = PipelinePlan.split_backward,
        split_max_pending: Optional[int] = PipelinePlan.split_max_pending,
        split_placement: Optional[str] = PipelinePlan.split_placement,
        inner: str = PipelinePlan.inner,
        virtual_stages: int = PipelinePlan.virtual_stages,
        placement: Optional[str] = PipelinePlan.placement,
        data_parallel: str = PipelinePlan.data_parallel,
        reshard_after_forward: bool = PipelinePlan.reshard_after_forward,
        tensor_parallel: int = PipelinePlan.tensor_parallel,
        plan: Optional[PipelinePlan] = None,
        save_distributed_checkpoint: bool = True,
        global_batch_size: Optional[int] = None,
        bucket_cap_mb: float = 25,
        deferred_batch_norm: bool = False,
        broadcast_buffers: bool = True,
        timeout: Optional[timedelta] = default_pg_timeout,
        process_group_backend: Optional[str] = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        accelerator: Any = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
    ) -> None:
        layout = dict(
            schedule=schedule,
            pipeline_depth=pipeline_depth,
            microbatches=microbatches,
            partition=partition,
            recompute=recompute,
            split_backward=split_backward,
            split_max_pending=split_max_pending,
            inner=inner,
            virtual_stages=virtual_stages,
            split_placement=split_placement,
            placement=placement,
            data_parallel=data_parallel,
            reshard_after_forward=reshard_after_forward,
            tensor_parallel=tensor_parallel,
        )
        self._layout = _check_layout(layout, plan)
        if global_batch_size is not None and global_batch_size < 1:
            raise ValueError(f"global_batch_size must be >= 1, got {global_batch_size}")
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        if loss not in PipelineEngine.LOSS_MODES:
            raise ValueError(f"loss must be one of {PipelineEngine.LOSS_MODES}, got {loss!r}")
        self.gradient_clip_val, self.loss = gradient_clip_val, loss
        if bucket_cap_mb < 0:
            raise ValueError(f"bucket_cap_mb must be >= 0, got {bucket_cap_mb}")
        self.bucket_bytes = int(bucket_cap_mb * 2**20)
        self.deferred_batch_norm, self.broadcast_buffers = deferred_batch_norm, broadcast_buffers
        self.save_distributed_checkpoint, self.global_batch_size = save_distributed_checkpoint, global_batch_size
        self._requested_plan = plan
        self._plan: Optional[PipelinePlan] = None
        self._groups: Optional[PipelineGroups] = None
        self._global_batches = False  # every rank loads the global batch and keeps its replica's rows
        #: Where a global batch the user did not set came from (:meth:`enable_reconfiguration`), or ``None``.
        self.global_batch_origin: Optional[str] = None

    @property
    def is_distributed(self) -> bool:
        """Lightning injects a DistributedSampler and syncs logs for distributed strategies."""
        return True

    @property
    def plan(self) -> PipelinePlan:
        """The layout in use; its partition is resolved to block counts once the model is set up."""
        if self._plan is None:
            raise RuntimeError("PipelineStrategy.plan is only available after the processes are set up")
        return self._plan

    @property
    def topology(self) -> Topology:
        """The ``(w, d)`` layout, known once the processes are connected."""
        return self.plan.topology

    @property
    def data_parallel(self) -> str:
        """How the replicas of a stage hold it, "ddp" or "fsdp" (the requested layout's, known before setup)."""
        if self._requested_plan is not None:
            return self._requested_plan.data_parallel
        return self._layout["data_parallel"]

    @property
    def device_mesh(self) -> DeviceMesh:
        """The job's DeviceMesh, dimensions ("data_parallel", "pipeline_parallel"): entry ``[r][s]``
        is the rank running replica ``r`` of stage ``s``; ``device_mesh["data_parallel"]`` is this
        rank's stage's replicas (what ``data_parallel="fsdp"`` shards over), and
        ``device_mesh["pipeline_parallel"]`` its pipeline. With ``tensor_parallel > 1`` a third
        dimension, "tensor_parallel": entry ``[r][s][k]`` is part ``k`` of replica ``r`` of stage
        ``s``, and ``device_mesh["tensor_parallel"]`` the ranks this rank's stage replica is split
        over. Available once the processes are connected; rebuilt when :meth:`reconfigure`
        changes the layout."""
        if self._groups is None:
            raise RuntimeError("PipelineStrategy.device_mesh is only available after the processes are set up")
        return self._groups.mesh

    @property
    def engine(self) -> PipelineEngine:
        """This rank's pipeline engine, available after ``setup``."""
        return self._module_checked(self.lightning_module).pipeline_engine

    @property
    def placement(self) -> Placement:
        """This rank's placement of the plan on the module, available after ``setup``."""
        return self._module_checked(self.lightning_module)._pipeline_placement

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every stage of a pipeline reads the same shard; replicas read different shards (or,
        once :meth:`enable_reconfiguration` was called, every rank reads every batch)."""
        if self._global_batches:
            return {"num_replicas": 1, "rank": 0}
        return {"num_replicas": self.topology.width, "rank": self.topology.replica_of(self.global_rank)}

    @property
    def layout_given(self) -> bool:
        """Whether the user chose a layout (``plan=`` or any layout argument off its default)."""
        return self._requested_plan is not None or any(v != _LAYOUT_DEFAULTS[k] for k, v in self._layout.items())

    def start_with(self, plan: PipelinePlan) -> None:
        """Use ``plan`` instead of the configured layout; only before the model is placed (a callback's ``setup``).

        Raises:
            RuntimeError: once the model is placed (use :meth:`reconfigure` then).
            ValueError: for a plan of another process count.
        """
        module = self.lightning_module
        if module is not None and getattr(module, "_pipeline_engine", None) is not None:
            raise RuntimeError("the model is already placed; use reconfigure() to change the layout of a running job")
        if self._plan is not None:
            _refuse_moving_tensor_parallel(self._plan, "a start plan (AutoPlanner, start_with)")
            plan.check_world_size(self._plan.world_size)
        if self._groups is not None and (plan.width, plan.depth, plan.inner, plan.tensor_parallel) != (
            self.plan.width,
            self.plan.depth,
            self.plan.inner,
            self.plan.tensor_parallel,
        ):
            self._groups.destroy()
            self._groups = PipelineGroups.build(plan.topology, self.global_rank, self.root_device.type)
        self._plan = plan

    def enable_reconfiguration(self) -> None:
        """Let :meth:`reconfigure` change the width during fit: call before the data is set up
        (a callback's ``setup``). Every rank then loads the whole global batch and trains on its
        replica's rows (``replica_batch``), so a global batch holds the same samples under any
        width, and an epoch the same batches; evaluation runs the whole evaluation set on every
        replica. Without ``global_batch_size``, the global batch is the starting layout's: the
        training DataLoader's batch size times the width when the data is set up
        (:attr:`global_batch_origin` says so).

        Raises:
            ValueError: with ``tensor_parallel > 1`` (the AutoPlanner and reconfiguration move DDP stages only).
        """
        _refuse_moving_tensor_parallel(self._requested_plan or self._layout, "reconfiguration (AutoPlanner)")
        self._global_batches = True

    @property
    def loads_global_batches(self) -> bool:
        """Whether every rank loads the whole global batch (after :meth:`enable_reconfiguration`)."""
        return self._global_batches

    def replica_batch(self, batch: Any) -> Any:
        """This replica's rows of a global batch (rows ``r, r + w, ...``: the samples Lightning's
        distributed sampler would give replica ``r``), or ``batch`` itself without reconfiguration."""
        if not self._global_batches:
            return batch
        width, replica = self.topology.width, self.topology.replica_of(self.global_rank)
        return tree_map(lambda t: t[replica::width] if isinstance(t, Tensor) and t.dim() > 0 else t, batch)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """Checkpoints load by name into the placed stage, so the model is set up first."""
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        """Optimizer state is loaded by name in :meth:`load_checkpoint`, not by Lightning."""
        return False

    def _build_plan(self, world_size: int) -> PipelinePlan:
        if self._requested_plan is not None:
            self._requested_plan.check_world_size(world_size)
            return self._requested_plan
        fields = {k: v for k, v in self._layout.items() if k != "pipeline_depth"}
        return PipelinePlan.for_world(world_size, self._layout["pipeline_depth"], **fields)

    @override
    def setup_environment(self) -> None:
        """Validate the plan for this world size, connect the processes, build the process groups."""
        self._plan = self._build_plan(self.num_nodes * self.num_processes)  # fails before any collective
        super().setup_environment()
        _destroy_groups_at_exit()
        self._groups = PipelineGroups.build(self._plan.topology, self.global_rank, self.root_device.type)

    @staticmethod
    def _module_checked(module: Optional[LightningModule]) -> Any:
        if module is None:
            raise RuntimeError("PipelineStrategy has no LightningModule attached yet")
        pipeline_blocks_of(module)  # raises a clear TypeError without pipeline_blocks()
        return module

    def _place(self, module: Any) -> PipelineEngine:
        """Apply the plan on this rank (or keep the placement of the same plan from an earlier Trainer)."""
        placement: Optional[Placement] = getattr(module, "_pipeline_placement", None)
        if placement is not None and placement.plan is not None:
            engine: PipelineEngine = module._pipeline_engine
            if _same_layout(placement.plan, self.plan) and engine.rank == self.global_rank:
                self._plan = placement.plan
                self._adopt_groups(engine.groups)
                return engine
            engine.close()
            placement.undo()
            if engine.groups is not None and engine.groups is not self._groups:
                engine.groups.destroy()  # an earlier Trainer's layout: no engine uses them any more
        placement = placement or Placement(module)
        if self.plan.partition == "profile":
            self._plan = self.plan.replace(
                partition=profiled_partition(module, self.plan, self.global_rank, self.broadcast)
            )
        if self.deferred_batch_norm:  # a batch is this plan's microbatches
            for block in placement.blocks:
                convert_deferred_batch_norm(block, self.plan.microbatches)
        assert self._groups is not None
        tp_mesh, hook = self._groups.tp_mesh, getattr(module, "configure_stage", None)
        stages = placement.apply(
            self.plan,
            self.global_rank,
            self.root_device,
            self._groups.replica_mesh,
            (lambda blocks: hook(blocks, tp_mesh)) if callable(hook) else None,
        )
        self._plan = placement.plan
        module._pipeline_placement = placement
        rank_zero_info(placement.summary())
        return PipelineEngine(
            module,
            stages,
            self.plan,
            self.global_rank,
            self._groups,
            self.root_device,
            self.gradient_clip_val,
            self.loss,
            self.bucket_bytes,
            self.broadcast_buffers,
        )

    def _adopt_groups(self, groups: Optional[PipelineGroups]) -> None:
        """Use the groups of an earlier Trainer's engine (the same layout), destroying the ones built for this run."""
        if groups is not None and groups is not self._groups:
            if self._groups is not None:
                self._groups.destroy()
            self._groups = groups

    @override
    def connect(self, model: LightningModule) -> None:
        """Attach the module, first refusing the Trainer options the pipeline does its own way."""
        trainer = getattr(model, "_trainer", None)
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            _refuse_trainer_options(trainer)
        super().connect(model)

    @override
    def setup(self, trainer: Trainer) -> None:
        """Place this rank's stage of the plan, then set up optimizers and precision."""
        module = self._module_checked(self.lightning_module)
        if module.automatic_optimization:
            raise ValueError(
                "PipelineStrategy needs manual optimization: set `self.automatic_optimization = False` in "
                f"{type(module).__name__}.__init__ and call self.pipeline_step(batch) in training_step"
            )
        if getattr(self.precision_plugin, "scaler", None) is not None:
            raise ValueError(
                "PipelineStrategy does not support loss-scaled fp16 ('16-mixed'); use precision='bf16-mixed'"
            )
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(module)
        module._pipeline_engine = self._place(module)
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Only let Lightning count the step: the engine already ran (or, under 2BW, scheduled)
        the real update inside ``pipeline_step``, where its place in the schedule is known."""
        return closure()

    # -- reconfiguration -------------------------------------------------------------------
    def reconfigure(self, plan: PipelinePlan) -> PipelinePlan:
        """Move the running job to ``plan`` between two training steps, without restarting processes
        (:func:`~lightning_pipe.lightning.reconfigure.reconfigure`). A collective: every rank calls it
        with the same plan.

        Returns:
            The plan now in use (partition resolved).

        Raises:
            ValueError: with ``tensor_parallel > 1``, in the running plan or in ``plan``.
        """
        _refuse_moving_tensor_parallel(self.plan, "reconfigure()")
        _refuse_moving_tensor_parallel(plan, "reconfigure()")
        return reconfigure(self, plan)

    def place(self, plan: PipelinePlan) -> None:
        """Place ``plan``'s stages and engine on this rank (the old layout's engine closed and its
        placement undone first), with the process groups of its ``(w, d)`` layout: the old
        layout's where the layout is the same (another schedule, partition or ``data_parallel``),
        else new ones."""
        module = self._module_checked(self.lightning_module)
        kept = self._groups is not None and self._plan is not None and self._plan.topology == plan.topology
        self._plan = plan
        if not kept:
            if self._groups is not None:
                self._groups.destroy()
            self._groups = PipelineGroups.build(plan.topology, self.global_rank, self.root_device.type)
        module._pipeline_engine = self._place(module)

    def single_optimizer(self) -> Optimizer:
        """The one optimizer pipeline training supports.

        Raises:
            ValueError: when ``configure_optimizers`` returned several.
        """
        optimizers = [o._optimizer if isinstance(o, LightningOptimizer) else o for o in self.optimizers]
        if len(optimizers) != 1:
            raise ValueError(
                f"pipeline training supports one optimizer, configure_optimizers returned {len(optimizers)}"
            )
        return optimizers[0]

    # -- data --------------------------------------------------------------------------------
    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Training data: per-replica batch from ``global_batch_size``, and resumable mid-epoch."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or trainer.state.stage != RunningStage.TRAINING or not hasattr(dataloader, "batch_sampler"):
            return dataloader
        if self.global_batch_size is None and self._global_batches:  # before any width change
            self.global_batch_size, self.global_batch_origin = starting_global_batch(dataloader, self.topology.width)
            rank_zero_info(f"PipelineStrategy: {self.global_batch_origin}")
        if self.global_batch_size is not None:
            width = 1 if self._global_batches else self.topology.width
            dataloader = per_replica_loader(dataloader, self.global_batch_size, width)  # type: ignore[arg-type]
        progress = trainer.fit_loop.epoch_loop.batch_progress.current
        return ResumableLoader(dataloader, lambda: progress.processed, lambda: trainer.current_epoch)  # type: ignore[arg-type]

    # -- lifecycle -------------------------------------------------------------------------
    def drain(self) -> None:
        """Finish every in-flight microbatch and apply the outstanding update (2BW; no-op otherwise)."""
        self._drain()

    def _drain(self, check_ties: bool = False) -> None:
        module = self.lightning_module
        if module is not None and getattr(module, "_pipeline_engine", None) is not None:
            module._pipeline_engine.drain(check_ties)

    def _check_weights(self) -> None:
        """Raise on every rank (a collective) if blocks moved to any rank without their weights."""
        unfilled = sorted(self.placement.unfilled)
        missing = self.reduce(torch.tensor(float(len(unfilled)), device=self.root_device), reduce_op="sum")
        if int(missing):
            raise RuntimeError(
                f"{int(missing)} pipeline block(s) moved to ranks without their weights (here: {unfilled}); "
                "load a checkpoint (ckpt_path=...) after changing the layout of a placed model"
            )

    @override
    def on_train_start(self) -> None:
        """Check the weights are in place; continue the mixin's LR-scheduler counters after a resume."""
        self._check_weights()
        module = self.lightning_module
        module._pipeline_updates = module.trainer.global_step
        module._pipeline_epoch = module.trainer.current_epoch

    @override
    def on_validation_start(self) -> None:
        """2BW: apply outstanding updates so validation sees consistent weights."""
        self._check_weights()
        self._drain()

    @override
    def on_test_start(self) -> None:
        """2BW: apply outstanding updates before testing."""
        self._check_weights()
        self._drain()

    @override
    def on_predict_start(self) -> None:
        """2BW: apply outstanding updates before predicting."""
        self._check_weights()
        self._drain()

    @override
    def on_train_end(self) -> None:
        """2BW: apply the last batch's update at the end of fit."""
        self._drain()
        super().on_train_end()

    # -- checkpoints -----------------------------------------------------------------------
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This stage's weights by name (sharded), or the whole model's on rank 0 (one file)."""
        self._drain(check_ties=True)  # a checkpoint must not keep one of two diverged tied copies
        return self._shard_or_gathered(self.placement.export_state()["model"])

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """This stage's optimizer state by parameter name (sharded), or every stage's on rank 0 (one file)."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return self._shard_or_gathered(self.placement.export_state(optimizer)["optimizer"])

    def _shard_or_gathered(self, shard: dict[str, Any]) -> dict[str, Any]:
        """``shard`` itself (sharded checkpoints), or on rank 0 the union of the first pipeline's
        shards, gathered there only (other ranks return ``{}``)."""
        if self.save_distributed_checkpoint:
            return shard
        shard = {k: _checkpoint.whole(v) for k, v in shard.items()}  # FSDP, TP: every part gathers its stage
        if self.topology.replica_of(self.global_rank) != 0 or self.topology.tp_index_of(self.global_rank) != 0:
            return {}
        assert self._groups is not None
        ranks = [self.topology.rank_of(0, s) for s in range(self.plan.depth)]
        return _checkpoint.gather_on_first(shard, ranks, self._groups.pp, self.root_device)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Write atomically: a DCP directory from every rank, or one file from rank 0."""
        path = Path(self.broadcast(str(filepath)))
        if self.save_distributed_checkpoint:
            shards = {_checkpoint.MODEL: checkpoint.pop("state_dict")}
            shards.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
            _checkpoint.save_sharded(path, shards, checkpoint, self.global_rank, self.barrier)
        elif self.is_global_zero:
            _checkpoint.save_file(checkpoint, path)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Load this rank's weights and optimizer state by name, whatever layout saved them."""
        path = Path(self.broadcast(str(checkpoint_path)))
        module = self._module_checked(self.lightning_module)
        optimizers = [o._optimizer if isinstance(o, LightningOptimizer) else o for o in self.optimizers]
        load = _checkpoint.load_sharded if path.is_dir() else _checkpoint.load_file
        rest = load(path, self.placement, optimizers, strict=module.strict_loading)
        _optimizers_to_device(optimizers, self.root_device)
        return rest

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Nothing to do: :meth:`load_checkpoint` already loaded this stage's weights by name."""

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Nothing to do: :meth:`load_checkpoint` already loaded this stage's optimizer state by name."""


def _refuse_trainer_options(trainer: Trainer) -> None:
    """Refuse ``Trainer(accumulate_grad_batches=...)`` and ``Trainer(gradient_clip_val=...)``
    before Lightning's own check, whose advice (automatic optimization) the pipeline cannot take.

    Raises:
        ValueError: naming the option and what does the same under a pipeline.
    """
    if trainer.accumulate_grad_batches != 1:
        raise ValueError(
            f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) does not apply to PipelineStrategy: "
            "the pipeline already accumulates gradients over the microbatches of each batch. For the same memory "
            "with a larger batch, raise the batch size (or PipelineStrategy(global_batch_size=...)) together with "
            "PipelineStrategy(microbatches=...), and remove accumulate_grad_batches"
        )
    if trainer.gradient_clip_val:
        raise ValueError(
            f"Trainer(gradient_clip_val={trainer.gradient_clip_val}) does not apply to PipelineStrategy (Lightning "
            f"clips only under automatic optimization): pass PipelineStrategy(gradient_clip_val="
            f"{trainer.gradient_clip_val}) instead, which clips to the global norm over all stages"
        )


def _refuse_moving_tensor_parallel(layout: Any, what: str) -> None:
    """Refuse ``what`` (a change of layout during the run) for a tensor-parallel layout (a
    :class:`PipelinePlan` or the strategy's layout arguments).

    Raises:
        ValueError: naming ``what`` and what to do instead.
    """
    t = layout.get("tensor_parallel", 1) if isinstance(layout, dict) else layout.tensor_parallel
    if t > 1:
        raise ValueError(
            f"{what} does not apply with tensor_parallel={t}: configure_stage split the stages' layers for good, "
            "and the AutoPlanner plans and moves whole (DDP) stages only; fix the layout in PipelineStrategy(...) "
            "(plan offline with python -m lightning_pipe.plan for tensor_parallel=1), or use tensor_parallel=1"
        )


def _same_layout(placed: PipelinePlan, wanted: PipelinePlan) -> bool:
    """Whether ``placed`` is ``wanted`` (whose partition may still be "balanced" or "uniform")."""
    if wanted.is_resolved or wanted.stages != placed.stages:
        return placed == wanted
    return placed == wanted.replace(partition=placed.partition)


def _check_layout(layout: dict[str, Any], plan: Optional[PipelinePlan]) -> dict[str, Any]:
    """Refuse layout arguments given next to ``plan=``; validate the rest as far as possible without the world size."""
    if plan is not None:
        clash = [k for k, v in layout.items() if v != _LAYOUT_DEFAULTS[k]]
        if clash:
            raise ValueError(f"pass the layout either as plan= or as arguments, not both (also given: {clash})")
        return layout
    depth = layout["pipeline_depth"]
    if depth is not None and depth < 1:
        raise ValueError(f"pipeline_depth must be >= 1, got {depth}")
    virtual = max(layout["virtual_stages"], 1)
    given = {k: len(v) for k in ("recompute", "partition") if not isinstance(v := layout[k], (bool, str))}
    for name, entries in given.items():
        if entries % virtual:
            raise ValueError(
                f"{name} lists {entries} stages, not a multiple of virtual_stages={virtual}: "
                f"it needs pipeline_depth x virtual_stages entries, one per stage"
            )
    lists = [entries // virtual for entries in given.values()]
    hint = depth or next(iter(lists), None)
    fields = {k: v for k, v in layout.items() if k != "pipeline_depth"}
    if hint is None:  # depth comes from the world size: what needs it is checked once that is known
        if get_schedule(layout["schedule"]).virtual_stages is not None:  # its checks all need the depth
            return layout
        hint, fields["virtual_stages"], fields["placement"] = 1, 1, None
    PipelinePlan(depth=hint, **fields)
    return layout


StrategyRegistry.register(
    PipelineStrategy.strategy_name,
    PipelineStrategy,
    description="Pipeline parallelism (GPipe, 1F1B, 2BW, split backward) over w x d processes",
)
