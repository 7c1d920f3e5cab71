"""Frozen (w, d) layout: which rank runs which replica of which stage, and the process groups."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class Topology:
    """``w`` data-parallel replicas of a ``d``-stage pipeline over ``w * d`` ranks.

    Rank ``r`` runs stage ``r % d`` of replica ``r // d``: the stages of one pipeline are
    neighbouring ranks, so point-to-point traffic stays local (seed 000, section 3.3).

    Args:
        world_size: total number of processes.
        depth: number of pipeline stages ``d``.
    """

    world_size: int
    depth: int

    def __post_init__(self) -> None:
        if self.depth < 1 or self.world_size < 1:
            raise ValueError(f"pipeline depth ({self.depth}) and world size ({self.world_size}) must be >= 1")
        if self.world_size % self.depth:
            raise ValueError(
                f"world size {self.world_size} is not divisible by pipeline_depth={self.depth}; "
                f"use a number of devices that is a multiple of {self.depth}"
            )

    @property
    def width(self) -> int:
        """Number of data-parallel replicas ``w`` of every stage."""
        return self.world_size // self.depth

    def stage_of(self, rank: int) -> int:
        """Pipeline stage that ``rank`` runs."""
        return rank % self.depth

    def replica_of(self, rank: int) -> int:
        """Data-parallel replica (pipeline) that ``rank`` belongs to."""
        return rank // self.depth

    def rank_of(self, replica: int, stage: int) -> int:
        """Global rank of ``stage`` in pipeline ``replica``."""
        return replica * self.depth + stage

    def build_mesh(self, device_type: str) -> "DeviceMesh":
        """A DeviceMesh with a "dp" (replicas) and a "pp" (stages) dimension."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (self.width, self.depth), mesh_dim_names=("dp", "pp"))
