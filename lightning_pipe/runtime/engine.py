"""One rank's share of the pipeline: partitions the user's chain, runs steps, gathers state."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from lightning_pipe.partition import PartitionSpec, block_cost, partition_sizes, stage_ranges
from lightning_pipe.runtime.executor import Executor, Hooks, Position, StepState
from lightning_pipe.runtime.microbatch import split_batch
from lightning_pipe.runtime.stage import Stage
from lightning_pipe.schedules import Action, build_inference, build_schedule, resolve, verify
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
        schedule: name of the training schedule ("gpipe", "1f1b").
        microbatches: microbatches ``m`` per batch.
        partition: "balanced", "uniform" or an explicit list of blocks per stage.
        recompute: activation recomputation, for all stages or per stage.
        device: device of this rank's stage.
        mesh: DeviceMesh with "dp" and "pp" dimensions; ``None`` only when running one process.
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
    ) -> None:
        resolve(schedule)
        if microbatches < 1:
            raise ValueError(f"microbatches must be >= 1, got {microbatches}")
        self.module, self.topology, self.rank = module, topology, rank
        self.schedule, self.microbatches = schedule, microbatches
        self.device = device or torch.device("cpu")
        self.stage_index = topology.stage_of(rank)
        self.stage = self._build_stage(partition, recompute)
        self.position = self._position()
        self.dp_group = mesh.get_group("dp") if mesh is not None else None
        self.pp_group = mesh.get_group("pp") if mesh is not None else None
        self.last_peak_stash = 0
        self._programs: dict[tuple[bool, int], list[Action]] = {}

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

    @property
    def last_rank(self) -> int:
        """Global rank of the last stage of this rank's pipeline."""
        return self.topology.rank_of(self.topology.replica_of(self.rank), self.topology.depth - 1)

    # -- programs --------------------------------------------------------------------------
    def train_program(self, microbatches: int) -> list[Action]:
        """This rank's verified training actions for ``microbatches`` microbatches."""
        return self._program(True, microbatches)

    def inference_program(self, microbatches: int) -> list[Action]:
        """This rank's verified forward-only actions."""
        return self._program(False, microbatches)

    def _program(self, train: bool, microbatches: int) -> list[Action]:
        key = (train, microbatches)
        if key not in self._programs:
            d = self.topology.depth
            program = build_schedule(self.schedule, d, microbatches) if train else build_inference(d, microbatches)
            verify(program, microbatches, train=train)
            self._programs[key] = program[self.stage_index]
        return self._programs[key]

    def _hooks(self, optimizer_step: Callable[[], None]) -> Hooks:
        return Hooks(self.module.pipeline_inputs, self.module.pipeline_loss, self.all_reduce_gradients, optimizer_step)

    def _run(self, actions: list[Action], state: StepState, optimizer_step: Callable[[], None]) -> StepState:
        return Executor(self.stage, self.position, self.device, self._hooks(optimizer_step)).run(actions, state)

    # -- steps -----------------------------------------------------------------------------
    def train_step(self, batch: Any, optimizer_step: Callable[[], None]) -> Tensor:
        """Run one flushed training step on ``batch`` and return its mean loss on every stage."""
        microbatches, shares = split_batch(batch, self.microbatches)
        for p in self.stage.parameters():
            p.grad = None
        state = self._run(self.train_program(len(microbatches)), StepState(microbatches, shares), optimizer_step)
        self.last_peak_stash = state.peak_stash
        return self._from_last_stage(torch.tensor(state.loss_sum, device=self.device))

    def forward(self, batch: Any, with_loss: bool = False) -> Any:
        """Forward-only pass; returns the model output (or mean loss) on every stage of the pipeline."""
        microbatches, shares = split_batch(batch, self.microbatches)
        state = self._run(self.inference_program(len(microbatches)), StepState(microbatches, shares, train=False), lambda: None)
        if not self.position.is_last:
            return self._from_last_stage(torch.zeros((), device=self.device) if with_loss else None)
        outputs = [state.results[k] for k in range(len(microbatches))]
        if with_loss:
            losses = [self.module.pipeline_loss(o, mb) * s for o, mb, s in zip(outputs, microbatches, shares)]
            return self._from_last_stage(torch.stack(losses).sum().float())
        return self._from_last_stage(_concat(outputs))

    # -- collectives -----------------------------------------------------------------------
    def all_reduce_gradients(self) -> None:
        """Average the stage's gradients over its ``w`` replicas (missing gradients count as zero)."""
        params = self.stage.parameters()
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.dp_group is None or self.topology.width == 1:
            return
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for p in params:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=self.dp_group)
            flat /= self.topology.width
            for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                g.copy_(reduced)

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
        local = {k: v.detach().cpu() for k, v in self.module.state_dict().items()}
        if self.pp_group is None or self.topology.depth == 1:
            return local
        parts: list[Any] = [None] * self.topology.depth
        dist.all_gather_object(parts, local, group=self.pp_group)
        return {k: v for part in parts for k, v in part.items()}

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
