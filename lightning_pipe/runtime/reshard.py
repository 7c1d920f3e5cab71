"""Move state keyed by original name from the ranks of one layout to the ranks of another, point to point.

A key ("model.<name>" for a parameter or buffer, "optimizer.state.<name>.<field>" and
"optimizer.param_groups.<name>.<field>" for optimizer state flattened by torch.distributed.checkpoint)
belongs to the block that owns ``<name>``. A rank whose new stage holds a block its old stage did
not receives that block's keys from the old stage's replica of the same index (modulo the old
width); keys it already holds stay where they are, uncopied. Every rank computes the same list of
transfers from the two plans, so no coordinator is needed: one gather of key descriptions from
each old stage's first replica, then one ``batch_isend_irecv``. FSDP shards (DTensors) move as
whole tensors: :func:`gathered` first gathers them over their replicas, and the new layout's
placement splits them again over its own replicas.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_pipe.core.pipeline_plan import PipelinePlan

#: (dtype, shape) of a tensor value, or ("value", the value) of a plain Python value.
Description = tuple[Any, Any]


def key_name(key: str) -> str:
    """The parameter or buffer name inside a state key ("model.<name>" or "optimizer.<kind>.<name>.<field>")."""
    if key.startswith("model."):
        return key[len("model.") :]
    inner = key[len("optimizer.") :]
    return inner[inner.index(".") + 1 : inner.rindex(".")]


def gathered(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` with every DTensor (an FSDP shard of a parameter or of its optimizer state)
    replaced by its whole tensor; other values are kept as they are.

    A collective over each DTensor's mesh: the replicas of a stage hold the same keys and gather
    them in the same (sorted) order, each stage over its own replica group.
    """
    return {k: state[k].full_tensor() if isinstance(state[k], DTensor) else state[k] for k in sorted(state)}


def stage_of_block(plan: PipelinePlan) -> list[int]:
    """Pipeline position of every block under ``plan`` (partition resolved): its stage's, or under
    several stages per rank the rank's that runs its stage (:meth:`PipelinePlan.rank_of_stage`)."""
    return [plan.rank_of_stage(s) for s, rng in enumerate(plan.stage_ranges()) for _ in rng]


def _describe(value: Any) -> Description:
    return (value.dtype, tuple(value.shape)) if isinstance(value, Tensor) else ("value", value)


def _wire(t: Tensor) -> Tensor:
    """A flat, contiguous view gloo can move (bools as bytes)."""
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def _transfers(
    described: dict[str, Description], blocks_of: Callable[[str], list[int]], old: PipelinePlan, new: PipelinePlan
) -> list[tuple[str, int, int]]:
    """(key, source rank, destination rank) of every key a rank gains, in one order every rank agrees on."""
    old_stage, new_stage = stage_of_block(old), stage_of_block(new)
    out = []
    for key in sorted(described):
        blocks = blocks_of(key)  # several for a tied parameter: every stage using it holds a copy
        source = old_stage[blocks[0]]
        holders = {old.topology.rank_of(r, old_stage[b]) for r in range(old.width) for b in blocks}
        for replica in range(new.width):
            for dst in sorted({new.topology.rank_of(replica, new_stage[b]) for b in blocks} - holders):
                out.append((key, old.topology.rank_of(replica % old.width, source), dst))
    return out


def exchange(
    state: Mapping[str, Any],
    blocks_of: Callable[[str], list[int]],
    old: PipelinePlan,
    new: PipelinePlan,
    rank: int,
    device: Optional[torch.device] = None,
) -> dict[str, Any]:
    """The state this rank holds under ``new``: its own keys that stay, plus those sent to it.

    A collective over the default process group: every rank of the job calls it with its
    ``state`` under ``old`` (drained: the newest weights and their optimizer state).

    Args:
        state: this rank's keys under ``old`` (see the module docstring for the key forms).
        blocks_of: the indices of the blocks a key belongs to (several for a tied parameter).
        old, new: the layouts (same world size, partitions resolved).
        rank: this process's global rank.
        device: where received tensors are allocated.

    Returns:
        Keys of the blocks of this rank's stage under ``new`` (tensors received here are new;
        kept ones are ``state``'s own objects).
    """
    if old.world_size != new.world_size:
        raise ValueError(f"cannot move state from {old.describe()} to {new.describe()}: different process counts")
    device = device or torch.device("cpu")
    first = {old.topology.rank_of(0, s) for s in range(old.depth)}
    mine = {k: _describe(v) for k, v in state.items()} if rank in first else {}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    described = {k: d for part in gathered for k, d in part.items()}
    new_stage = stage_of_block(new)
    here = new.topology.position_of(rank)
    result = {k: v for k, v in state.items() if here in {new_stage[b] for b in blocks_of(k)}}
    ops, received = [], {}
    for key, src, dst in _transfers(described, blocks_of, old, new):
        kind, shape = described[key]
        if kind == "value":
            if dst == rank:
                result[key] = shape
            continue
        if src == rank:
            ops.append(dist.P2POp(dist.isend, _wire(state[key]), dst))
        elif dst == rank:
            received[key] = torch.empty(shape, dtype=kind, device=device)
            ops.append(dist.P2POp(dist.irecv, _wire(received[key]), src))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    result.update(received)
    return result
