"""Frozen (w, d) layout: which rank runs which replica of which stage."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


#: The dimensions of a layout's DeviceMesh: the replicas of a stage, then the stages of a pipeline
#: (the names of Lightning's ``ModelParallelStrategy`` for its data-parallel dimension).
MESH_DIMS = ("data_parallel", "pipeline_parallel")


@dataclass(frozen=True)
class Topology:
    """``w`` data-parallel replicas of a ``d``-stage pipeline over ``w * d`` ranks.

    With ``inner="pp"`` (default) rank ``r`` runs stage ``r % d`` of replica ``r // d``: the
    stages of one pipeline are neighbouring ranks, so activations and gradients between stages
    stay inside a node (PipeDream-2BW paper, section 3.3). With ``inner="dp"`` rank ``r`` runs stage
    ``r // w`` of replica ``r % w``: the replicas of a stage are neighbours, so the gradient
    all-reduce stays inside a node instead. Neighbouring ranks share a node under every
    launcher (torchrun and Lightning number the ranks of a node consecutively).

    Args:
        world_size: total number of processes.
        depth: number of pipeline stages ``d``.
        inner: which dimension's ranks are neighbours, "pp" or "dp".
    """

    world_size: int
    depth: int
    inner: str = "pp"

    def __post_init__(self) -> None:
        if self.depth < 1 or self.world_size < 1:
            raise ValueError(f"pipeline depth ({self.depth}) and world size ({self.world_size}) must be >= 1")
        if self.world_size % self.depth:
            raise ValueError(
                f"world size {self.world_size} is not divisible by pipeline_depth={self.depth}; "
                f"use a number of devices that is a multiple of {self.depth}"
            )
        if self.inner not in ("pp", "dp"):
            raise ValueError(
                f"inner must be 'pp' (pipelines on neighbouring ranks) or 'dp' (replicas), got {self.inner!r}"
            )

    @property
    def width(self) -> int:
        """Number of data-parallel replicas ``w`` of every stage."""
        return self.world_size // self.depth

    def position_of(self, rank: int) -> int:
        """``rank``'s position in its pipeline, ``0 .. d-1``: the stage it runs with one stage per rank
        (with ``v`` stages per rank, position ``p`` runs stages ``p, p + d, ...``)."""
        return rank % self.depth if self.inner == "pp" else rank // self.width

    def stage_of(self, rank: int) -> int:
        """Deprecated alias of :meth:`position_of` (a position, not a stage, under interleaving)."""
        warnings.warn("Topology.stage_of is deprecated; use Topology.position_of", DeprecationWarning, stacklevel=2)
        return self.position_of(rank)

    def replica_of(self, rank: int) -> int:
        """Data-parallel replica (pipeline) that ``rank`` belongs to."""
        return rank // self.depth if self.inner == "pp" else rank % self.width

    def rank_of(self, replica: int, stage: int) -> int:
        """Global rank of ``stage`` in pipeline ``replica``."""
        return replica * self.depth + stage if self.inner == "pp" else stage * self.width + replica

    def grid(self) -> list[list[int]]:
        """``grid[replica][stage]``: the global rank of each replica of each stage."""
        return [[self.rank_of(r, s) for s in range(self.depth)] for r in range(self.width)]

    def build_mesh(self, device_type: str) -> "DeviceMesh":
        """A DeviceMesh with dimensions :data:`MESH_DIMS`, ranks placed by :meth:`grid`: entry
        ``[r][s]`` is the rank of replica ``r`` of stage ``s``, so a rank's "data_parallel" slice is
        its stage's replicas and its "pipeline_parallel" slice its pipeline, under either ``inner``."""
        import torch
        from torch.distributed.device_mesh import DeviceMesh

        return DeviceMesh(device_type, torch.tensor(self.grid()), mesh_dim_names=MESH_DIMS)
