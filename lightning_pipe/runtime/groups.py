"""The process groups of one layout, built in one place: the ("dp", "pp") mesh, the gradient-norm groups and the headers' CPU side channel."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_pipe.runtime.p2p import DIRECT, Channel
from lightning_pipe.topology import Topology


@dataclass(frozen=True)
class PipelineGroups:
    """This rank's process groups for one ``(w, d)`` layout.

    Attributes:
        mesh: DeviceMesh with a "dp" (replicas of a stage) and a "pp" (stages of a pipeline) dimension.
        dp: the replicas of this rank's stage (gradient averaging).
        pp: the stages of this rank's pipeline (loss and output broadcasts).
        norm: a second group over the same stages for the asynchronous gradient-norm sums, so
            their order never interleaves with the broadcasts on ``pp`` (2BW posts them at
            different points on different stages).
        headers: a gloo group over the job for the transfers' headers when the tensors are not
            on the CPU (NCCL), so that reading a header never waits on the device (``None``:
            headers travel with the tensors).
        payload: with ``headers``, a group over the job, of the devices' backend, for the
            tensors alone: NCCL runs a group's batched transfers and its collectives on one
            stream, in the order posted, so a loss broadcast posted at the start of a step on
            ``pp`` (the whole job when ``w = 1``) would hold back every transfer behind it. Its
            first operation is an all-reduce that every rank joins: a first batched transfer
            between two ranks of a larger NCCL group is undefined (``batch_isend_irecv``'s note).
    """

    mesh: Any
    dp: Any
    pp: Any
    norm: Optional[Any]
    headers: Optional[Any] = None
    payload: Optional[Any] = None

    @classmethod
    def build(cls, topology: Topology, rank: int, device_type: str = "cpu",
              side_channel: Optional[bool] = None) -> "PipelineGroups":  # fmt: skip
        """Create the groups of ``topology`` (a collective: every rank of the job calls it).

        ``side_channel``: send headers over a gloo group of their own; by default when the
        devices are not CPUs and the pipeline has more than one stage.
        """
        mesh = topology.build_mesh(device_type)
        norm = pipeline_group(topology, rank) if topology.depth > 1 else None
        if side_channel is None:
            side_channel = device_type != "cpu" and topology.depth > 1
        headers = dist.new_group(backend="gloo") if side_channel else None
        payload = dist.new_group() if side_channel else None
        if payload is not None and device_type != "cpu":  # NCCL: every rank joins the first operation on a group
            dist.all_reduce(torch.zeros(1, device=device_type), group=payload)
        return cls(mesh, mesh.get_group("dp"), mesh.get_group("pp"), norm, headers, payload)

    def destroy(self) -> None:
        """Destroy this rank's groups of the layout (each holds threads and sockets): once no
        engine uses them. The default group, which a dimension spanning the whole job reuses, stays."""
        destroy_groups([self.dp, self.pp, self.norm, self.headers, self.payload])

    @property
    def channel(self) -> Channel:
        """Where the pipeline's transfers send their headers and tensors."""
        return DIRECT if self.headers is None else Channel(self.headers, self.payload, torch.device("cpu"))


def pipeline_group(topology: Topology, rank: int) -> Any:
    """A new group over the stages of ``rank``'s pipeline, apart from the mesh's "pp" group (a
    collective: every rank of the job creates every replica's group, in the same order)."""
    groups = [dist.new_group([topology.rank_of(r, s) for s in range(topology.depth)]) for r in range(topology.width)]
    return groups[topology.replica_of(rank)]


def destroy_groups(groups: Any) -> None:
    """Destroy each distinct group of ``groups`` on this rank, skipping ``None``, the default group
    and the marker of groups this rank is not in."""
    for group in {id(g): g for g in groups}.values():
        if group is not None and group is not dist.GroupMember.WORLD and group is not dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(group)
