"""Reversible placement of a plan on one rank, and this rank's state exported and imported by original name."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Container, Mapping, Optional

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim import Optimizer

from lightning_pipe.core.partition import block_cost
from lightning_pipe.core.pipeline_plan import PipelinePlan
from lightning_pipe.runtime.sharding import ShardedStage, local, shard_blocks
from lightning_pipe.runtime.stage import Stage
from lightning_pipe.runtime.ties import (
    Tie,
    alias_names,
    find_ties,
    retie,
    share_again,
    shared_blocks,
    shared_slots,
    untie_remote,
)
from lightning_pipe.runtime.unshard import unshard_block

if TYPE_CHECKING:
    from lightning_pipe.runtime.engine import PipelineEngine

#: Optimizer state flattened to one key per parameter name and field ("state.<name>.exp_avg",
#: "param_groups.<name>.lr"), so stages never overwrite each other's param_groups in a checkpoint.
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


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


def block_costs(module: nn.Module, blocks: list[nn.Module]) -> list[float]:
    """Cost of each block for a "balanced" partition: ``pipeline_block_costs()`` or parameter counts."""
    costs_fn = getattr(module, "pipeline_block_costs", None)
    return list(costs_fn()) if callable(costs_fn) else [block_cost(b) for b in blocks]


def _parents(module: nn.Module, blocks: list[nn.Module]) -> list[tuple[nn.Module, str]]:
    index = {id(m): (parent, name) for parent in module.modules() for name, m in parent.named_children()}
    missing = [i for i, b in enumerate(blocks) if id(b) not in index]
    if missing:
        raise ValueError(
            f"pipeline blocks {missing} are not submodules of {type(module).__name__}; register them as attributes"
        )
    return [index[id(b)] for b in blocks]


def _names_by_block(module: nn.Module, blocks: list[nn.Module]) -> dict[str, int]:
    """Block index of every state name of ``module`` (blocks not placed yet: their paths are real)."""
    paths = {id(m): name for name, m in module.named_modules(remove_duplicate=False)}
    return {f"{paths[id(b)]}.{k}": i for i, b in enumerate(blocks) for k in b.state_dict()}


def _check_parameters(module: nn.Module, blocks: list[nn.Module]) -> None:
    owned = {id(p) for block in blocks for p in block.parameters()}
    stray = [n for n, p in module.named_parameters() if id(p) not in owned]
    if stray:
        raise ValueError(
            f"parameters outside every pipeline block would never train: {stray[:5]}; move them into a block"
        )


def check_shapes(names: Mapping[str, Any], found: Mapping[str, Any], what: str) -> None:
    """Raise naming the first parameters of ``names`` (name -> shape) that ``found`` lacks or shapes otherwise."""
    missing = [k for k in names if k not in found]
    if missing:
        raise KeyError(f"{what} lacks {len(missing)} weights of this stage, first: {missing[:5]}")
    wrong = [f"{k}: {tuple(found[k])} here {tuple(names[k])}" for k in names if tuple(found[k]) != tuple(names[k])]
    if wrong:
        raise ValueError(f"{what} holds {len(wrong)} weights of another shape, first: {wrong[:5]}")


class Placement:
    """Apply a :class:`PipelinePlan` to one rank's module, undo it, and move its state by name.

    Applying keeps this rank's stage's blocks (moved to ``device``) and swaps a
    :class:`RemoteBlock` in for every other block; the other blocks' weights are dropped
    (moved to the meta device), so a rank holds only its own stage. Undoing puts the original
    blocks back; applying another plan then allocates the blocks this rank gains, whose values
    :meth:`import_state` must fill (see :attr:`unfilled`).

    Args:
        module: the user's LightningModule (any module with ``pipeline_blocks()``).

    Attributes:
        shared_blocks: groups of blocks that share a parameter (tied weights), by index, read
            from the whole module before any placement.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.blocks = pipeline_blocks_of(module)
        self._parents = _parents(module, self.blocks)
        self._block_of_name = _names_by_block(module, self.blocks)
        self.plan: Optional[PipelinePlan] = None
        self.stage_index = -1
        self._dropped: set[int] = set()
        self.unfilled: set[int] = set()
        self.ties: list[Tie] = []
        self._aliases = alias_names(module)  # other name of a tied parameter -> the name state is kept under
        self.shared_blocks = shared_blocks(module, self.blocks)  # before any placement unties them
        self._shared_slots = shared_slots(self.blocks)  # tied again by undo(), whatever this rank dropped
        self._untied: list[tuple[nn.Module, str, nn.Parameter]] = []
        self._sharded: list[int] = []  # this rank's blocks wrapped by fully_shard (data_parallel="fsdp")

    def apply(
        self,
        plan: PipelinePlan,
        rank: int,
        device: Optional[torch.device] = None,
        replica_mesh: Optional[Any] = None,
        configure_stage: Optional[Callable[[list[nn.Module]], None]] = None,
    ) -> list[Stage]:
        """Place ``plan`` on ``rank``: returns the stages it runs (one, or ``virtual_stages`` of
        them in chain order); the module keeps only those stages' blocks.

        Args:
            plan: the layout.
            rank: this process's global rank.
            device: where this rank's blocks go.
            replica_mesh: with ``plan.data_parallel == "fsdp"`` and replicas, the 1-D DeviceMesh
                of this rank's stage's replicas (:attr:`PipelineGroups.replica_mesh`): the
                blocks are sharded over it (:func:`~lightning_pipe.runtime.sharding.shard_blocks`).
            configure_stage: called once with each of this rank's stages' blocks, once they are on
                ``device`` and before the stage is built, so the stage trains the parameters it
                leaves (a tensor-parallel plan replaces them by DTensor parts).

        Raises:
            RuntimeError: if a plan is already applied (undo it first).
            ValueError: if the partition does not fit the chain, a parameter is shared across
                stages, or (FSDP) shared between blocks, or no ``replica_mesh`` is given, or a
                parameter is shared across stages with ``tensor_parallel > 1``.
        """
        if self.plan is not None:
            raise RuntimeError("a plan is already placed on this module; call undo() before applying another")
        plan = self.resolved(plan)
        ranges = plan.stage_ranges()
        if ranges[-1].stop != len(self.blocks):
            raise ValueError(
                f"partition {list(plan.partition)} covers {ranges[-1].stop} blocks, the chain has {len(self.blocks)}"
            )
        _check_parameters(self.module, self.blocks)
        sharding = plan.data_parallel == "fsdp" and plan.width > 1
        if sharding:
            self._check_shardable(replica_mesh)
        position = plan.topology.position_of(rank)
        device = device or torch.device("cpu")
        by_rank = [[i for s in plan.stages_of(r) for i in ranges[s]] for r in range(plan.depth)]
        self.ties = find_ties(self.module, self.blocks, by_rank)  # between pipeline ranks: one copy per rank
        if self.ties and plan.tensor_parallel > 1:
            raise ValueError(
                f"parameters tied across stages ({', '.join(t.name for t in self.ties[:3])}) are not supported with "
                f"tensor_parallel={plan.tensor_parallel}; keep tied blocks on one stage (partition=[...]) or use "
                "tensor_parallel=1"
            )
        mine = set(by_rank[position])
        self._untied = untie_remote(
            self.blocks, sorted(mine), [i for i in range(len(self.blocks)) if i not in mine], self.ties
        )
        for s, rng in enumerate(ranges):
            for i in rng:
                self._place_block(i, s if i not in mine else None, device)
        if sharding:
            self._shard(plan, sorted(mine), replica_mesh)
        if configure_stage is not None:
            for s in plan.stages_of(position):
                configure_stage([self.blocks[i] for i in ranges[s]])
        self.plan, self.stage_index = plan, position
        return [
            Stage(
                [self.blocks[i] for i in ranges[s]],
                ranges[s].start,
                plan.recompute[s],
                tuple(self.ties),
                index=s,
                sharded=ShardedStage([self.blocks[i] for i in ranges[s]], plan.reshard_after_forward)
                if sharding
                else None,
            )
            for s in plan.stages_of(position)
        ]

    def _check_shardable(self, replica_mesh: Optional[Any]) -> None:
        """Refuse, on every rank alike, what FSDP replicas cannot keep: a parameter two blocks share."""
        if replica_mesh is None:
            raise ValueError("data_parallel='fsdp' with replicas needs the stage's replica mesh (PipelineGroups)")
        if self.shared_blocks:
            names = ", ".join(sorted(self._aliases)[:3])
            raise ValueError(
                f"data_parallel='fsdp' shards each block on its own, and blocks {self.shared_blocks[0]} share a "
                f"parameter ({names}): a shard's gradient cannot be summed with its tied copy's; use "
                "data_parallel='ddp' for a model with tied weights"
            )

    def _shard(self, plan: PipelinePlan, mine: list[int], replica_mesh: Any) -> None:
        """Wrap this rank's blocks with ``fully_shard`` over ``replica_mesh``."""
        shard_blocks([self.blocks[i] for i in mine], replica_mesh, plan.reshard_after_forward)
        self._sharded = mine

    @property
    def sharded(self) -> bool:
        """Whether this rank's blocks are wrapped by ``fully_shard`` (a placed ``data_parallel="fsdp"`` plan)."""
        return bool(self._sharded)

    def _place_block(self, i: int, remote_stage: Optional[int], device: torch.device) -> None:
        parent, name = self._parents[i]
        block = self.blocks[i]
        if remote_stage is not None:
            parent._modules[name] = RemoteBlock(remote_stage)
            block.to("meta")  # frees the weights this rank does not train
            self._dropped.add(i)
        elif i in self._dropped:
            block.to_empty(device=device)
            self._dropped.discard(i)
            self.unfilled.add(i)
        else:
            block.to(device)

    def resolved(self, plan: PipelinePlan) -> PipelinePlan:
        """``plan`` with a "balanced" or "uniform" partition turned into block counts for this chain."""
        return plan if plan.is_resolved else plan.resolve(block_costs(self.module, self.blocks))

    def blocks_of(self, name: str) -> list[int]:
        """Indices of the blocks that hold parameter or buffer ``name`` (a name of the unplaced
        module): one, or for a tied parameter every block that uses it."""
        names = [name] + [alias for alias, kept in self._aliases.items() if kept == name]
        found = sorted({self._block_of_name[n] for n in names if n in self._block_of_name})
        if not found:
            raise KeyError(f"{name!r} is not a parameter or buffer of any pipeline block")
        return found

    def undo(self) -> None:
        """Put every original block back into the module (blocks of other stages hold no weights).

        Blocks an FSDP plan sharded are unwrapped (:func:`~lightning_pipe.runtime.unshard.unshard_block`)
        and hold no weights either: like blocks of other stages, the next plan allocates them and
        :meth:`import_state` fills them (export the state, gathered, first).
        """
        for i in self._sharded:
            unshard_block(self.blocks[i])
            self._dropped.add(i)
        self._sharded = []
        retie(self._untied)
        self._untied = []
        share_again(self._shared_slots)
        for (parent, name), block in zip(self._parents, self.blocks):
            parent._modules[name] = block
        self.plan, self.stage_index = None, -1

    def summary(self) -> str:
        """A table of the placed plan: stage, blocks, parameters and recompute, for every stage."""
        assert self.plan is not None, "apply a plan first"
        lines = [f"Pipeline plan: {self.plan.describe()}", "stage | blocks | parameters | recompute"]
        for s, rng in enumerate(self.plan.stage_ranges()):
            names = ", ".join(type(self.blocks[i]).__name__ for i in rng)
            params = sum(p.numel() for i in rng for p in self.blocks[i].parameters())
            lines.append(f"{s} | {rng.start}-{rng.stop - 1} ({names}) | {params:,} | {self.plan.recompute[s]}")
        lines.append("(Lightning's model summary shows rank 0's stage only: RemoteBlock rows live on other stages.)")
        return "\n".join(lines)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Name and shape of every tensor this rank's state holds (parameters and buffers; a tied
        parameter under the one name it is kept under)."""
        return {self._aliases.get(k, k): tuple(v.shape) for k, v in self.module.state_dict().items()}

    def export_state(self, optimizer: Optional[Optimizer] = None) -> dict[str, Any]:
        """This rank's state by original names: ``{"model": ..., "optimizer": ...}`` (no copies).

        The optimizer's state is flattened to one key per parameter name and field. Under
        2BW, drain first so the module holds the newest weights and the optimizer points at them.
        """
        state: dict[str, Any] = {
            "model": {self._aliases.get(k, k): v.detach() for k, v in self.module.state_dict().items()}
        }
        if optimizer is not None:
            state["optimizer"] = self.optimizer_template(optimizer)
        return state

    def optimizer_template(self, optimizer: Optimizer) -> dict[str, Any]:
        """This rank's optimizer state by name, to be filled in place (e.g. by a checkpoint load)."""
        flat = get_optimizer_state_dict(self.module, optimizer, options=FLAT)
        return {_renamed(k, self._aliases): v for k, v in flat.items()}

    def import_state(self, state: Mapping[str, Any], optimizer: Optional[Optimizer] = None) -> None:
        """Load this rank's parameters, buffers and optimizer state from ``state`` (keyed as :meth:`export_state`).

        ``state`` may hold other stages' names too; only this rank's are read. Gradients left
        by an earlier step are dropped. Optimizer state without any per-parameter entry (no
        step taken yet) leaves ``optimizer`` as it is.

        Raises:
            KeyError / ValueError: naming the first weights of this stage that are missing or shaped otherwise.
        """
        model = state["model"]
        check_shapes(self.shapes(), {k: v.shape for k, v in model.items()}, "the state")
        own = self.module.state_dict()
        with torch.no_grad():
            for k, v in own.items():
                value = model[self._aliases.get(k, k)]
                if isinstance(v, DTensor) and not isinstance(value, DTensor):  # a whole tensor into a shard
                    value = distribute_tensor(value.to(v.device), v.device_mesh, v.placements, src_data_rank=None)
                if local(v).data_ptr() != local(value).data_ptr():  # a checkpoint load may have filled it in place
                    v.copy_(value)
        self.unfilled.clear()
        for p in self.module.parameters():  # a finished step's gradients: DCP initialises optimizer
            p.grad = None  # state only for parameters without one, and would load none
        if optimizer is not None and "optimizer" in state:
            flat = _own_optimizer_keys(state["optimizer"], {self._aliases.get(k, k) for k in own})
            if not any(k.startswith("state.") for k in flat):
                # Nothing stepped yet (a move before the first step): the fresh optimizer is that state.
                # Loading it would have torch initialise the state by a zero step, counting one step.
                return
            back = {kept: alias for alias, kept in self._aliases.items() if alias in own}  # this rank's name for it
            params = dict(self.module.named_parameters())
            renamed = {_renamed(k, back): v for k, v in flat.items()}
            renamed = {k: _sharded_like(v, params.get(k[k.index(".") + 1 : k.rindex(".")])) for k, v in renamed.items()}
            set_optimizer_state_dict(self.module, optimizer, optim_state_dict=renamed, options=FLAT)


def _sharded_like(value: Any, param: Optional[torch.Tensor]) -> Any:
    """A whole tensor of a parameter's shape split as the parameter is, where it is an FSDP
    shard (a DTensor) and the value is not (a one-file checkpoint's optimizer state); else ``value``."""
    if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
        if value.shape == param.shape:
            return distribute_tensor(value.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
    return value


def _own_optimizer_keys(flat: Mapping[str, Any], own: Container[str]) -> dict[str, Any]:
    """The entries of a flattened optimizer state dict (``"state.<name>.<field>"``,
    ``"param_groups.<name>.<field>"``; fields hold no dots) that belong to names in ``own``."""
    return {k: v for k, v in flat.items() if k[k.index(".") + 1 : k.rindex(".")] in own}


def _renamed(key: str, names: Mapping[str, str]) -> str:
    """A flattened optimizer key with its parameter name mapped through ``names`` (others unchanged)."""
    kind, name, field = key[: key.index(".")], key[key.index(".") + 1 : key.rindex(".")], key[key.rindex(".") + 1 :]
    return f"{kind}.{names.get(name, name)}.{field}" if name in names else key


def place(
    module: nn.Module,
    plan: PipelinePlan,
    rank: int,
    device: Optional[torch.device] = None,
    groups: Optional[Any] = None,
    gradient_clip_val: Optional[float] = None,
    loss: str = "current",
    bucket_bytes: Optional[int] = None,
    broadcast_buffers: bool = True,
) -> "PipelineEngine":
    """Place ``plan`` on ``rank`` and return the engine that runs its steps (scripts, tests, benchmarks).

    Args:
        module: the user's model.
        plan: the layout.
        rank: this process's global rank.
        device: where this rank's stage runs.
        groups: the layout's :class:`~lightning_pipe.runtime.groups.PipelineGroups` (a collective
            to build); ``None`` in one process.
        gradient_clip_val: clip to this global norm before each step.
        loss: what ``train_step`` returns, ``"current"`` or ``"previous"`` (see :class:`PipelineEngine`).
        bucket_bytes: replica all-reduce bucket size (0: one blocking all-reduce); ``None``: the engine's default.
        broadcast_buffers: with replicas, replica 0's buffers overwrite the other replicas' before
            each training step (DDP's rule; see :class:`PipelineEngine`); ``False``: replicas drift.
    """
    from lightning_pipe.runtime.engine import PipelineEngine

    stages = Placement(module).apply(plan, rank, device, groups.replica_mesh if groups is not None else None)
    options: dict[str, Any] = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
    return PipelineEngine(
        module,
        stages,
        plan,
        rank,
        groups,
        device,
        gradient_clip_val,
        loss,
        broadcast_buffers=broadcast_buffers,
        **options,
    )
