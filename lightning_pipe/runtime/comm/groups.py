"""The process groups of one layout, built in one place: the named DeviceMesh, norm groups, the side channel."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache

from lightning_pipe.core.topology import MESH_DIMS, TP_DIM, Topology
from lightning_pipe.runtime.comm.p2p import DIRECT, Channel


@dataclass(frozen=True)
class PipelineGroups:
    """This rank's process groups for one ``(w, d, t)`` layout.

    Attributes:
        mesh: DeviceMesh with a "data_parallel" (replicas of a stage) and a "pipeline_parallel"
            (stages of a pipeline) dimension (:data:`~lightning_pipe.core.topology.MESH_DIMS`),
            and with ``t > 1`` a "tensor_parallel" one (the ranks a stage replica is split over).
        dp: the mesh's "data_parallel" group: the replicas of this rank's stage (gradient
            averaging); with ``t > 1``, of this rank's tensor-parallel part of it.
        pp: the mesh's "pipeline_parallel" group: the stages of this rank's pipeline (loss and
            output broadcasts); with ``t > 1``, of its lane (the same tensor-parallel index).
        norm: a second group over the same stages for the asynchronous gradient-norm sums, so
            their order never interleaves with the broadcasts on ``pp`` (2BW posts them at
            different points on different stages).
        headers: a gloo group over the job for the transfers' headers when the tensors are not
            on the CPU (NCCL), so that reading a header never waits on the device (``None``:
            headers travel with the tensors).
        links: with ``headers``, a group of the devices' backend for each direction of each link
            between neighbouring stages (the last to the first too, for interleaved 1F1B), by
            (sender, receiver) global ranks: the tensors' own streams (see :class:`Channel`).
        tp: with ``t > 1``, the mesh's "tensor_parallel" group: the ranks this rank's stage
            replica is split over (the global norm sums sharded gradients over it); ``None``
            otherwise.
    """

    mesh: Any
    dp: Any
    pp: Any
    norm: Optional[Any]
    headers: Optional[Any] = None
    links: Optional[dict[tuple[int, int], Any]] = None
    tp: Optional[Any] = None

    @classmethod
    def build(
        cls, topology: Topology, rank: int, device_type: str = "cpu", side_channel: Optional[bool] = None
    ) -> "PipelineGroups":
        """Create the groups of ``topology`` (a collective: every rank of the job calls it).

        ``side_channel``: send headers over a gloo group of their own; by default when the
        devices are not CPUs and the pipeline has more than one stage.
        """
        mesh = topology.build_mesh(device_type)
        norm = pipeline_group(topology, rank) if topology.depth > 1 else None
        if side_channel is None:
            side_channel = device_type != "cpu" and topology.depth > 1
        headers = dist.new_group(backend="gloo") if side_channel else None
        links = link_groups(topology, rank) if side_channel else None
        data, pipeline = MESH_DIMS
        tp = mesh.get_group(TP_DIM) if topology.tensor_parallel > 1 else None
        return cls(mesh, mesh.get_group(data), mesh.get_group(pipeline), norm, headers, links, tp)

    def destroy(self) -> None:
        """Destroy this rank's groups of the layout (each holds threads and sockets): once no
        engine uses them. The default group, which a dimension spanning the whole job reuses, stays."""
        destroy_groups([self.dp, self.pp, self.norm, self.tp, self.headers, *(self.links or {}).values()])

    @property
    def replica_mesh(self) -> Any:
        """This rank's 1-D sub-mesh over the replicas of its stage (the mesh's "data_parallel" slice)."""
        return self.mesh[MESH_DIMS[0]]

    @property
    def tp_mesh(self) -> Optional[Any]:
        """This rank's 1-D sub-mesh over the ranks its stage replica is split over (the mesh's
        "tensor_parallel" slice), or ``None`` without tensor parallel."""
        return self.mesh[TP_DIM] if self.tp is not None else None

    @property
    def channel(self) -> Channel:
        """Where the pipeline's transfers send their headers and tensors."""
        return DIRECT if self.headers is None else Channel(self.headers, None, torch.device("cpu"), self.links)


def pipeline_group(topology: Topology, rank: int) -> Any:
    """A new group over the stages of ``rank``'s pipeline (lane), apart from the mesh's "pipeline_parallel"
    group (a collective: every rank of the job creates every lane's group, in the same order)."""
    lanes = topology.lanes()
    groups = [dist.new_group([topology.rank_of(r, s, k) for s in range(topology.depth)]) for r, k in lanes]
    return groups[lanes.index((topology.replica_of(rank), topology.tp_index_of(rank)))]


def link_groups(topology: Topology, rank: int) -> dict[tuple[int, int], Any]:
    """This rank's groups for its links, one per direction, by (sender, receiver) global rank (a
    collective: every rank of the job creates every pipeline's groups, in the same order)."""
    mine = {}
    for replica, k in topology.lanes():
        stages = [topology.rank_of(replica, s, k) for s in range(topology.depth)]
        pairs = dict.fromkeys(
            (a, b) for s, a in enumerate(stages) for b in (stages[s - 1], stages[(s + 1) % len(stages)]) if a != b
        )
        for pair in pairs:
            group = dist.new_group(sorted(pair))
            if rank in pair:
                mine[pair] = group
    return mine


def destroy_groups(groups: Any) -> None:
    """Destroy each distinct group of ``groups`` on this rank, skipping ``None``, the default group
    and the marker of groups this rank is not in."""
    for group in {id(g): g for g in groups}.values():
        if group is not None and group is not dist.GroupMember.WORLD and group is not dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(group)
    forget_meshes()


def forget_meshes() -> None:
    """Clear DTensor's caches that hold DeviceMeshes, once their groups are destroyed.

    DTensor caches its sharding propagation (in C++, ``torch._C._clear_DTensor_sharding_propagator_cache``
    clears it, and in Python, ``ShardingPropagator.propagate_op_sharding``; results hold the
    output's mesh) and its redistribution plans (``get_redistribute_planner``,
    by a weak reference to the mesh) under keys that compare meshes by ranks and dimension
    names, not by groups. A later mesh equal to an earlier one (the same layout placed again,
    over new groups) would then be handed results naming the earlier mesh's destroyed groups:
    ``p.detach().full_tensor()`` fails with "Could not resolve the process group".
    """
    clear_redistribute_planner_cache()
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_native is not None:
        clear_native()
