"""Frozen (w, d, t) layout: which rank runs which replica of which stage, and which tensor-parallel part of it."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


#: The dimensions of a layout's DeviceMesh: the replicas of a stage, then the stages of a pipeline
#: (the names of Lightning's ``ModelParallelStrategy`` for its data-parallel dimension).
MESH_DIMS = ("data_parallel", "pipeline_parallel")

#: The third dimension of the mesh when a stage is split over ``t > 1`` tensor-parallel ranks (the
#: name of Lightning's ``ModelParallelStrategy`` for its tensor-parallel dimension).
TP_DIM = "tensor_parallel"


@dataclass(frozen=True)
class Topology:
    """``w`` data-parallel replicas of a ``d``-stage pipeline, each stage split over ``t``
    tensor-parallel ranks: ``w * d * t`` ranks.

    With ``inner="pp"`` (default) rank ``r`` runs stage ``r % d`` of replica ``r // d``: the
    stages of one pipeline are neighbouring ranks, so activations and gradients between stages
    stay inside a node (PipeDream-2BW paper, section 3.3). With ``inner="dp"`` rank ``r`` runs stage
    ``r // w`` of replica ``r % w``: the replicas of a stage are neighbours, so the gradient
    all-reduce stays inside a node instead. Neighbouring ranks share a node under every
    launcher (torchrun and Lightning number the ranks of a node consecutively).

    With ``t > 1`` the tensor-parallel ranks of a stage replica are the innermost neighbours
    (rank ``b * t + k`` is tensor-parallel rank ``k`` of the ``(w, d)`` slot ``b`` above):
    they all-reduce inside every layer, the most frequent transfer, so they share a node, as
    Megatron-LM places its tensor-parallel groups (Narayanan et al., "Efficient Large-Scale
    Language Model Training on GPU Clusters Using Megatron-LM", section 3.3). Tensor-parallel
    rank ``k`` of a stage exchanges activations with rank ``k`` of the neighbouring stages: each
    ``k`` is a pipeline of its own, a *lane*, and the replicas of a stage part ``k`` are the
    ``w`` ranks ``(r, s, k)``.

    Args:
        world_size: total number of processes.
        depth: number of pipeline stages ``d``.
        inner: which dimension's ranks are neighbours, "pp" or "dp".
        tensor_parallel: ranks ``t`` each stage replica is split over.
    """

    world_size: int
    depth: int
    inner: str = "pp"
    tensor_parallel: int = 1

    def __post_init__(self) -> None:
        if self.depth < 1 or self.world_size < 1:
            raise ValueError(f"pipeline depth ({self.depth}) and world size ({self.world_size}) must be >= 1")
        if self.tensor_parallel < 1:
            raise ValueError(f"tensor_parallel must be >= 1, got {self.tensor_parallel}")
        slots = self.depth * self.tensor_parallel
        if self.world_size % slots:
            split = f"pipeline_depth={self.depth}" + (
                f" x tensor_parallel={self.tensor_parallel}" if self.tensor_parallel > 1 else ""
            )
            raise ValueError(
                f"world size {self.world_size} is not divisible by {split}; "
                f"use a number of devices that is a multiple of {slots}"
            )
        if self.inner not in ("pp", "dp"):
            raise ValueError(
                f"inner must be 'pp' (pipelines on neighbouring ranks) or 'dp' (replicas), got {self.inner!r}"
            )

    @property
    def width(self) -> int:
        """Number of data-parallel replicas ``w`` of every stage."""
        return self.world_size // (self.depth * self.tensor_parallel)

    def position_of(self, rank: int) -> int:
        """``rank``'s position in its pipeline, ``0 .. d-1``: the stage it runs with one stage per rank
        (with ``v`` stages per rank, position ``p`` runs stages ``p, p + d, ...``)."""
        slot = rank // self.tensor_parallel
        return slot % self.depth if self.inner == "pp" else slot // self.width

    def stage_of(self, rank: int) -> int:
        """Deprecated alias of :meth:`position_of` (a position, not a stage, under interleaving)."""
        warnings.warn("Topology.stage_of is deprecated; use Topology.position_of", DeprecationWarning, stacklevel=2)
        return self.position_of(rank)

    def replica_of(self, rank: int) -> int:
        """Data-parallel replica (pipeline) that ``rank`` belongs to."""
        slot = rank // self.tensor_parallel
        return slot // self.depth if self.inner == "pp" else slot % self.width

    def tp_index_of(self, rank: int) -> int:
        """``rank``'s index ``k`` among the tensor-parallel ranks of its stage replica (its lane)."""
        return rank % self.tensor_parallel

    def rank_of(self, replica: int, stage: int, tp_index: int = 0) -> int:
        """Global rank of tensor-parallel part ``tp_index`` of ``stage`` in pipeline ``replica``."""
        slot = replica * self.depth + stage if self.inner == "pp" else stage * self.width + replica
        return slot * self.tensor_parallel + tp_index

    def lanes(self) -> list[tuple[int, int]]:
        """Every pipeline of the job as ``(replica, tp_index)``: the stages ``rank_of(replica, s, tp_index)``
        exchange activations (one lane per replica without tensor parallel)."""
        return [(r, k) for r in range(self.width) for k in range(self.tensor_parallel)]

    def lane_ranks(self, rank: int) -> list[int]:
        """The ranks of ``rank``'s pipeline (its lane), stage by stage."""
        replica, k = self.replica_of(rank), self.tp_index_of(rank)
        return [self.rank_of(replica, s, k) for s in range(self.depth)]

    def grid(self) -> list[list[int]]:
        """``grid[replica][stage]``: the global rank of each replica of each stage (its
        tensor-parallel part 0; :meth:`build_mesh` holds every part)."""
        return [[self.rank_of(r, s) for s in range(self.depth)] for r in range(self.width)]

    @property
    def mesh_dims(self) -> tuple[str, ...]:
        """The mesh's dimension names: :data:`MESH_DIMS`, and :data:`TP_DIM` with ``t > 1``."""
        return MESH_DIMS + ((TP_DIM,) if self.tensor_parallel > 1 else ())

    def mesh_ranks(self) -> list[Any]:
        """The mesh's ranks: ``[r][s]`` (``t = 1``) or ``[r][s][k]`` (``t > 1``), as :meth:`rank_of` places them."""
        if self.tensor_parallel == 1:
            return self.grid()
        t = self.tensor_parallel
        return [[[self.rank_of(r, s, k) for k in range(t)] for s in range(self.depth)] for r in range(self.width)]

    def build_mesh(self, device_type: str) -> "DeviceMesh":
        """A DeviceMesh with dimensions :attr:`mesh_dims`, ranks placed by :meth:`mesh_ranks`: entry
        ``[r][s]`` (``[r][s][k]``) is the rank of replica ``r`` of stage ``s`` (part ``k``), so a
        rank's "data_parallel" slice is its stage's (part's) replicas, its "pipeline_parallel"
        slice its pipeline (lane) and its "tensor_parallel" slice the ranks its stage replica is
        split over, under either ``inner``."""
        import torch
        from torch.distributed.device_mesh import DeviceMesh

        return DeviceMesh(device_type, torch.tensor(self.mesh_ranks()), mesh_dim_names=self.mesh_dims)
