"""PipelineStrategy: Lightning glue that sets up the (dp, pp) mesh and one engine per rank."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal, Mapping, Optional

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_pipe.partition import PartitionSpec
from lightning_pipe.runtime.engine import PipelineEngine, Recompute, pipeline_blocks_of
from lightning_pipe.schedules import check_name
from lightning_pipe.topology import Topology


class PipelineStrategy(DDPStrategy):
    """Train a :class:`~lightning_pipe.PipelineMixin` module over ``w x d`` processes.

    Each of ``d`` pipeline stages holds a contiguous slice of the model's blocks and is
    replicated ``w = world_size / d`` times; replicas of a stage average their gradients.

    Args:
        schedule: "gpipe", "1f1b" (PipeDream-Flush) or "2bw" (PipeDream-2BW: two weight
            versions, 1-stale updates, no flush between steps; needs ``microbatches >= d``).
        pipeline_depth: number of stages ``d``; default: all devices form one pipeline.
        microbatches: microbatches ``m`` each batch is split into (unevenly if needed).
        partition: "balanced" (by ``pipeline_block_costs()`` or parameter count), "uniform",
            or an explicit list of blocks per stage.
        recompute: activation recomputation (torch.utils.checkpoint), for all or per stage.
        gradient_clip_val: clip gradients to this global norm, computed over all stages
            (Lightning's own ``Trainer(gradient_clip_val=...)`` is not available with manual
            optimization). Steps with a non-finite gradient are always skipped, on every rank.
        split_backward: split each backward into input gradients (sent upstream at once) and
            weight gradients (delayed into idle time), 2BP; any module, through autograd.
        split_max_pending: with ``split_backward``, the most microbatches waiting for their
            weight gradients (bounds memory; GPipe and 1F1B).
        timeout: timeout of every collective and transfer; a stuck rank fails after it.
        process_group_backend: "gloo" or "nccl"; default from the device.
        start_method: Lightning launcher start method; "popen" (default) re-runs the script.
    """

    strategy_name = "pipeline"

    def __init__(
        self,
        schedule: str = "1f1b",
        pipeline_depth: Optional[int] = None,
        microbatches: int = 1,
        partition: PartitionSpec = "balanced",
        recompute: Recompute = False,
        gradient_clip_val: Optional[float] = None,
        split_backward: bool = False,
        split_max_pending: Optional[int] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        process_group_backend: Optional[str] = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        accelerator: Any = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
    ) -> None:
        check_name(schedule)
        if microbatches < 1:
            raise ValueError(f"microbatches must be >= 1, got {microbatches}")
        if pipeline_depth is not None and pipeline_depth < 1:
            raise ValueError(f"pipeline_depth must be >= 1, got {pipeline_depth}")
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
        self.schedule, self.pipeline_depth, self.microbatches = schedule, pipeline_depth, microbatches
        self.partition, self.recompute, self.gradient_clip_val = partition, recompute, gradient_clip_val
        self.split_backward, self.split_max_pending = split_backward, split_max_pending
        self._topology: Optional[Topology] = None
        self._mesh: Any = None

    @property
    def is_distributed(self) -> bool:
        """Lightning injects a DistributedSampler and syncs logs for distributed strategies."""
        return True

    @property
    def topology(self) -> Topology:
        """The ``(w, d)`` layout, known once the processes are connected."""
        if self._topology is None:
            raise RuntimeError("PipelineStrategy.topology is only available after the processes are set up")
        return self._topology

    @property
    def engine(self) -> PipelineEngine:
        """This rank's pipeline engine, available after ``setup``."""
        return self._module_checked(self.lightning_module).pipeline_engine

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every stage of a pipeline reads the same shard; replicas read different shards."""
        return {"num_replicas": self.topology.width, "rank": self.topology.replica_of(self.global_rank)}

    @override
    def setup_environment(self) -> None:
        """Connect the processes, validate ``(w, d)`` and build the ("dp", "pp") DeviceMesh."""
        depth = self.pipeline_depth or self.num_nodes * self.num_processes
        Topology(self.num_nodes * self.num_processes, depth)  # fail before any collective
        super().setup_environment()
        self._topology = Topology(self.world_size, depth)
        self._mesh = self._topology.build_mesh(self.root_device.type)

    @staticmethod
    def _module_checked(module: Optional[LightningModule]) -> Any:
        if module is None:
            raise RuntimeError("PipelineStrategy has no LightningModule attached yet")
        pipeline_blocks_of(module)  # raises a clear TypeError without pipeline_blocks()
        return module

    def _engine_for(self, module: Any) -> PipelineEngine:
        engine = module._pipeline_engine
        if engine is not None and engine.topology == self.topology and engine.rank == self.global_rank:
            return engine
        return PipelineEngine(
            module, self.topology, self.global_rank, schedule=self.schedule, microbatches=self.microbatches,
            partition=self.partition, recompute=self.recompute, device=self.root_device, mesh=self._mesh,
            gradient_clip_val=self.gradient_clip_val, split_backward=self.split_backward,
            split_max_pending=self.split_max_pending,
        )  # fmt: skip

    @override
    def setup(self, trainer: Trainer) -> None:
        """Partition the model, keep only this rank's blocks, then set up optimizers and precision."""
        module = self._module_checked(self.lightning_module)
        if module.automatic_optimization:
            raise ValueError(
                "PipelineStrategy needs manual optimization: set `self.automatic_optimization = False` in "
                f"{type(module).__name__}.__init__ and call self.pipeline_step(batch) in training_step"
            )
        if getattr(self.precision_plugin, "scaler", None) is not None:
            raise ValueError("PipelineStrategy does not support loss-scaled fp16 ('16-mixed'); use precision='bf16-mixed'")
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(module)
        module._pipeline_engine = self._engine_for(module)
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

    def _drain(self) -> None:
        module = self.lightning_module
        if module is not None and getattr(module, "_pipeline_engine", None) is not None:
            module._pipeline_engine.drain()

    @override
    def on_validation_start(self) -> None:
        """2BW: apply outstanding updates so validation sees consistent weights."""
        self._drain()

    @override
    def on_test_start(self) -> None:
        """2BW: apply outstanding updates before testing."""
        self._drain()

    @override
    def on_predict_start(self) -> None:
        """2BW: apply outstanding updates before predicting."""
        self._drain()

    @override
    def on_train_end(self) -> None:
        """2BW: apply the last batch's update at the end of fit."""
        self._drain()
        super().on_train_end()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The whole model's weights, gathered from every stage (a consolidated checkpoint)."""
        return self.engine.full_state_dict()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Every stage's optimizer state, so a resumed run gives each stage back its own."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return {"pipeline_stages": self.engine.gather_stages(optimizer.state_dict())}

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Load this stage's share of a consolidated state dict."""
        module = self._module_checked(self.lightning_module)
        local = module.state_dict().keys()
        missing = [k for k in local if k not in checkpoint["state_dict"]]
        if strict and missing:
            raise KeyError(f"checkpoint lacks weights of this stage: {missing[:5]}")
        module.load_state_dict({k: checkpoint["state_dict"][k] for k in local if k not in missing}, strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Give this stage its own optimizer state back."""
        stage = self.topology.stage_of(self.global_rank)
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            stages = state["pipeline_stages"]
            if len(stages) != self.topology.depth:
                raise ValueError(f"checkpoint was saved with {len(stages)} stages, this run has {self.topology.depth}")
            optimizer.load_state_dict(stages[stage])
            _optimizers_to_device([optimizer], self.root_device)


StrategyRegistry.register(
    PipelineStrategy.strategy_name, PipelineStrategy, description="Pipeline parallelism (GPipe, 1F1B, 2BW, split backward) over w x d processes"
)
