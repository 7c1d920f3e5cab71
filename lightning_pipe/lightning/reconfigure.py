"""Moving a running job to another layout between two training steps, without restarting its processes."""

from __future__ import annotations

from typing import Any, Optional, Protocol

import torch
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch import LightningModule, Trainer
from torch.optim import Optimizer

from lightning_pipe.core.pipeline_plan import PipelinePlan
from lightning_pipe.runtime import reshard
from lightning_pipe.runtime.placement import Placement

_PARTS = ("model", "optimizer")


class Reconfigurable(Protocol):
    """What :func:`reconfigure` reads and calls on the strategy (:class:`~lightning_pipe.PipelineStrategy`)."""

    lightning_module: Optional[LightningModule]
    plan: PipelinePlan
    placement: Placement
    loads_global_batches: bool
    global_rank: int
    root_device: torch.device
    optimizers: list[Optimizer]
    lr_scheduler_configs: list[Any]

    def drain(self) -> None: ...

    def place(self, plan: PipelinePlan) -> None: ...

    def single_optimizer(self) -> Optimizer: ...

    def setup_optimizers(self, trainer: Trainer) -> None: ...


def reconfigure(strategy: Reconfigurable, plan: PipelinePlan) -> PipelinePlan:
    """Move the job ``strategy`` runs to ``plan``; a collective: every rank calls it with the same plan.

    Drains a 2BW stream, moves each rank's weights and optimizer state by name to the ranks of
    the new layout, builds the new layout's process groups, places the new stages and engine,
    then re-creates the optimizer and LR schedulers from ``configure_optimizers`` (their
    counters carried over) and imports the state. ``trainer.global_step``, loggers and
    callbacks go on.

    FSDP replicas (``data_parallel="fsdp"``) move too, before or after: each stage's shards of
    weights and Adam state are gathered over its old replicas into whole tensors, moved as DDP
    state is, and split again over the new stage's replicas when imported (the blocks are
    unwrapped from ``fully_shard`` and wrapped anew). For that moment a rank holds its old
    stage's whole weights and optimizer state, as a DDP replica does.

    Returns:
        The plan now in use (partition resolved).

    Raises:
        ValueError: for a plan of another process count, or a new width without
            :meth:`~lightning_pipe.PipelineStrategy.enable_reconfiguration`.
    """
    module = strategy.lightning_module
    if module is None:
        raise RuntimeError("PipelineStrategy has no LightningModule attached yet")
    old, new = strategy.plan, strategy.placement.resolved(plan)
    new.check_world_size(old.world_size)
    if new.width != old.width and not strategy.loads_global_batches:
        raise ValueError(
            f"changing the width from {old.width} to {new.width} during fit needs "
            "strategy.enable_reconfiguration() before the data is set up (AutoPlanner does it)"
        )
    strategy.drain()
    optimizer = strategy.single_optimizer()
    # An optimizer that has not stepped holds no state to move; torch's export would create it by a zero step.
    exported = strategy.placement.export_state(optimizer if optimizer.state else None)
    flat = reshard.gathered({f"{part}.{k}": v for part in _PARTS for k, v in exported.get(part, {}).items()})
    schedulers = [config.scheduler.state_dict() for config in module.trainer.lr_scheduler_configs]
    moved = reshard.exchange(
        flat,
        lambda key: strategy.placement.blocks_of(reshard.key_name(key)),
        old,
        new,
        strategy.global_rank,
        strategy.root_device,
    )
    module._pipeline_engine.close()
    strategy.placement.undo()
    strategy.place(new)
    _rebind_optimizers(strategy, schedulers)
    state = {part: {k[len(part) + 1 :]: v for k, v in moved.items() if k.startswith(part + ".")} for part in _PARTS}
    strategy.placement.import_state(state, strategy.single_optimizer())
    return strategy.plan


def _rebind_optimizers(strategy: Reconfigurable, schedulers: list[dict[str, Any]]) -> None:
    """A new optimizer and LR schedulers over this rank's new parameters, the schedulers' counters restored."""
    strategy.setup_optimizers(strategy.lightning_module.trainer)
    _optimizers_to_device(strategy.optimizers, strategy.root_device)
    for config, state in zip(strategy.lr_scheduler_configs, schedulers):
        config.scheduler.load_state_dict(state)
