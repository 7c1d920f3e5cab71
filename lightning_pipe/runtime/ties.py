"""Parameters tied across stages (an input embedding reused by the output head), found from shared Parameter objects.

Each stage whose blocks use a tied parameter holds a copy. The copies start equal; after the
replica all-reduce their gradients are summed over exactly the ranks of those stages (one group
per replica), so every copy takes the same step and they stay bitwise equal (Megatron's
"embedding group" for the word embeddings, here for any parameter). The global gradient norm
counts each tied parameter once, on the first stage that holds it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from lightning_pipe.core.topology import Topology
from lightning_pipe.runtime.comm.groups import destroy_groups, pipeline_group


@dataclass(frozen=True)
class Tie:
    """One parameter that blocks on several stages share.

    Attributes:
        name: its name in the unplaced module (the first :meth:`~torch.nn.Module.named_parameters` gives):
            the one name checkpoints keep it under.
        aliases: its other names there (e.g. ``head.weight`` for ``embed.weight``).
        stages: the pipeline ranks (their positions in the pipeline: the stages, unless a rank runs
            several virtual stages) whose blocks use it, ascending.
    """

    name: str
    aliases: tuple[str, ...]
    stages: tuple[int, ...]


def find_ties(module: nn.Module, blocks: Sequence[nn.Module], ranges: Sequence[Sequence[int]]) -> list[Tie]:
    """Every parameter used by blocks of more than one pipeline rank (``ranges``: the block
    indices of each), by name (the same list on every rank)."""
    stages: dict[int, set[int]] = {}
    for s, rng in enumerate(ranges):
        for i in rng:
            for p in blocks[i].parameters():
                stages.setdefault(id(p), set()).add(s)
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    ties = [
        Tie(names[key][0], tuple(names[key][1:]), tuple(sorted(used))) for key, used in stages.items() if len(used) > 1
    ]
    return sorted(ties, key=lambda t: t.name)


def shared_blocks(module: nn.Module, blocks: Sequence[nn.Module]) -> list[list[int]]:
    """Groups of blocks (by index) that share a parameter, each group once, in order: the ties
    (:func:`find_ties`) of a layout with one block per stage."""
    ties = find_ties(module, blocks, [[i] for i in range(len(blocks))])
    return [list(group) for group in sorted({tie.stages for tie in ties})]


def alias_names(module: nn.Module) -> dict[str, str]:
    """Every other name of a parameter the module holds under several names (tied within or
    across stages), mapped to its first: the one name checkpoints keep it under."""
    first: dict[int, str] = {}
    aliases = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if first.setdefault(id(p), name) != name:
            aliases[name] = first[id(p)]
    return aliases


class TiedGradients:
    """Sums the gradients of this rank's tied copies over the ranks that hold the other copies.

    Creating it is a collective: every rank of the job creates the groups of every tie (one per
    set of stages and replica), in the same order.

    Args:
        ties: every tie of the layout (:func:`find_ties`).
        names: the name of each of this stage's parameters (aligned with ``Stage.parameters()``).
        topology: the layout.
        rank: this process's global rank.
    """

    def __init__(self, ties: Sequence[Tie], names: Sequence[str], topology: Topology, rank: int) -> None:
        stage, replica = topology.position_of(rank), topology.replica_of(rank)
        index = {name: i for i, name in enumerate(names)}
        self.any = bool(ties)
        self._groups: list[tuple[Any, list[int]]] = []
        self.counted: set[int] = set()  # tied parameters this stage counts in the global norm
        self.tied: set[int] = set()
        for stages in sorted({t.stages for t in ties}):
            groups = [dist.new_group([topology.rank_of(r, s) for s in stages]) for r in range(topology.width)]
            if stage not in stages:
                continue
            mine = [_local_index(t, index) for t in ties if t.stages == stages]
            self._groups.append((groups[replica], mine))
            self.tied.update(mine)
            if stage == stages[0]:
                self.counted.update(mine)
        self._batches: deque[list[tuple[Tensor, Any, list[Tensor]]]] = deque()  # sums in flight, oldest batch first
        # The tied parameters' share of the global norm is summed over the pipeline at each
        # optimizer step, on a group of its own: the norm group's posts come in another order
        # on different stages under 2BW (each posts at its AR).
        self.norm_group = pipeline_group(topology, rank)

    def destroy(self) -> None:
        """Destroy the groups it created (its engine is being replaced)."""
        destroy_groups([group for group, _ in self._groups] + [self.norm_group])
        self._groups = []

    def post(self, params: Sequence[Tensor]) -> None:
        """Start summing one batch's tied gradients (``params``: its weight slot, aligned with the stage's)."""
        works = []
        for group, mine in self._groups:
            grads = [params[i].grad for i in mine]
            flat = _flatten_dense_tensors(grads)
            works.append((flat, dist.all_reduce(flat, group=group, async_op=True), grads))
        self._batches.append(works)

    def wait(self) -> None:
        """Finish the oldest batch's sums: every copy holds the summed gradient. Only that batch's:
        under 2BW the next batch's sum may already be posted here and not yet on the other stage."""
        for flat, work, grads in self._batches.popleft():
            work.wait()
            for g, summed in zip(grads, _unflatten_dense_tensors(flat, grads)):
                g.copy_(summed)

    def discard(self) -> None:
        """Forget sums in flight (a failed or restarted step)."""
        self._batches.clear()


class TiedCopiesDivergedError(RuntimeError):
    """The copies of a parameter tied across stages no longer hold the same values."""


class TieChecksums:
    """Compares the copies of every tied parameter by checksum: the sum, the sum of squares and
    the element count of each copy, in float64, gathered by one all-reduce over the job.

    Gradient summing keeps the copies equal only while every change goes through the
    optimizer; an in-place edit of one copy (weight normalisation, a manual clamp) splits them
    for good. The check reads every copy, so it runs at drains and checkpoint saves, never per step.
    Every rank gets every checksum and raises the same error, so none is left waiting.

    Args:
        ties: every tie of the layout (:func:`find_ties`; the same list on every rank).
        names: the name of each of this rank's parameters (aligned with the engine's parameters).
        topology: the layout.
        rank: this process's global rank.
    """

    #: Copies differ when a checksum differs by more than this, relative to its scale (the sums' rounding).
    RTOL = 1e-9
    _FIELDS = 3  # sum, sum of squares, count

    def __init__(self, ties: Sequence[Tie], names: Sequence[str], topology: Topology, rank: int) -> None:
        stage, replica = topology.position_of(rank), topology.replica_of(rank)
        index = {name: i for i, name in enumerate(names)}
        self._copies: list[tuple[Tie, int, int]] = []  # (tie, replica, offset of its first stage's checksum)
        self._mine: list[tuple[int, int]] = []  # (offset, local parameter index) of this rank's copies
        offset = 0
        for tie in ties:
            for r in range(topology.width):
                self._copies.append((tie, r, offset))
                if r == replica and stage in tie.stages:
                    self._mine.append((offset + self._FIELDS * tie.stages.index(stage), _local_index(tie, index)))
                offset += self._FIELDS * len(tie.stages)
        self._size = offset

    @torch.no_grad()
    def check(self, params: Sequence[Tensor], device: torch.device) -> None:
        """Raise :class:`TiedCopiesDivergedError` on every rank if any tie's copies differ (a
        collective over the job: every rank calls it at the same point).

        Args:
            params: this rank's parameters (aligned with ``names``), holding the newest weights.
            device: where the collective's tensor lives.
        """
        sums = torch.zeros(self._size, dtype=torch.float64, device=device)
        for at, i in self._mine:
            sums[at : at + self._FIELDS] = _checksum(params[i])
        dist.all_reduce(sums)
        values = sums.tolist()
        diverged = [
            self._describe(tie, r, values[at:]) for tie, r, at in self._copies if self._differ(tie, values[at:])
        ]
        if diverged:
            raise TiedCopiesDivergedError(
                "; ".join(diverged) + ". Their gradients are summed so that every copy takes the same step, but "
                "an in-place edit of one copy (weight normalisation, a manual clamp) splits them for good: edit "
                "tied weights only through the optimizer, or identically in every copy (on every stage that "
                "holds one), or untie them (give each block its own Parameter)"
            )

    def _differ(self, tie: Tie, values: Sequence[float]) -> bool:
        first = values[: self._FIELDS]
        for j in range(1, len(tie.stages)):
            other = values[self._FIELDS * j : self._FIELDS * (j + 1)]
            scale = max(first[1], other[1], 1e-30)  # the sum of squares bounds both sums' rounding
            sum_scale = (scale * max(first[2], 1.0)) ** 0.5
            if abs(first[0] - other[0]) > self.RTOL * sum_scale or abs(first[1] - other[1]) > self.RTOL * scale:
                return True
        return False

    def _describe(self, tie: Tie, replica: int, values: Sequence[float]) -> str:
        stages = ", ".join(str(s) for s in tie.stages)
        sums = " vs ".join(f"{values[self._FIELDS * j]:.6g}" for j in range(len(tie.stages)))
        squares = " vs ".join(f"{values[self._FIELDS * j + 1]:.6g}" for j in range(len(tie.stages)))
        return (
            f"the copies of tied parameter {tie.name!r} on pipeline stages {stages} (replica {replica}) differ: "
            f"sum {sums}, sum of squares {squares}"
        )


def _checksum(param: Tensor, chunk: int = 1 << 22) -> Tensor:
    """Sum, sum of squares and count of ``param`` in float64, a chunk at a time (bounded temporaries)."""
    flat = param.detach().reshape(-1)
    total = torch.zeros(3, dtype=torch.float64, device=param.device)
    for part in flat.split(chunk):
        wide = part.to(torch.float64)
        total[0] += wide.sum()
        total[1] += wide.square().sum()
    total[2] = flat.numel()
    return total


def _local_index(tie: Tie, index: dict[str, int]) -> int:
    for name in (tie.name, *tie.aliases):
        if name in index:
            return index[name]
    raise KeyError(f"tied parameter {tie.name} is used on this stage but none of its names is")


def untie_remote(
    blocks: Sequence[nn.Module], local: Sequence[int], remote: Sequence[int], ties: Sequence[Tie]
) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """In the blocks of other stages, replace each parameter a local block also uses by a meta
    placeholder, so dropping those blocks' weights leaves the local copy alone.

    Returns:
        ``(submodule, attribute, original)`` for each replacement (:func:`retie` undoes them).
    """
    if not ties:
        return []
    here = {id(p) for i in local for p in blocks[i].parameters()}
    replaced = []
    for i in remote:
        for sub in blocks[i].modules():
            for attr, p in list(sub._parameters.items()):
                if p is not None and id(p) in here:
                    sub._parameters[attr] = nn.Parameter(
                        torch.empty_like(p, device="meta"), requires_grad=p.requires_grad
                    )
                    replaced.append((sub, attr, p))
    return replaced


def shared_slots(blocks: Sequence[nn.Module]) -> list[list[tuple[nn.Module, str]]]:
    """The ``(submodule, attribute)`` slots of each parameter that more than one slot of ``blocks`` holds."""
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    for block in blocks:
        for sub in block.modules():
            for attr, p in sub._parameters.items():
                if p is not None:
                    slots.setdefault(id(p), []).append((sub, attr))
    return [found for found in slots.values() if len(found) > 1]


def share_again(slots: Sequence[Sequence[tuple[nn.Module, str]]]) -> None:
    """Make each group of slots hold one parameter object again (the first slot's). A rank that
    dropped every block of a tie moved each to the meta device on its own, which split the
    parameter in two; the next layout's ties are found by identity."""
    for group in slots:
        sub, attr = group[0]
        for other, name in group[1:]:
            other._parameters[name] = sub._parameters[attr]


def retie(replaced: Sequence[tuple[nn.Module, str, nn.Parameter]]) -> None:
    """Put back the parameters :func:`untie_remote` replaced."""
    for sub, attr, p in replaced:
        sub._parameters[attr] = p
