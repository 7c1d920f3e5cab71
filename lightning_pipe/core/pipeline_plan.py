"""PipelinePlan: the frozen, validated layout (w, d, t, m, schedule, split, partition, recompute) every piece reads."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence, Union

from lightning_pipe.core.partition import partition_sizes, stage_ranges
from lightning_pipe.core.topology import Topology
from lightning_pipe.schedules.layout import rank_stages, stage_rank
from lightning_pipe.schedules.passes import check_two_bw_split
from lightning_pipe.schedules.registry import ScheduleSpec, get
from lightning_pipe.schedules.w_placement import PLACEMENTS

PartitionArg = Union[str, Sequence[int]]

#: How the replicas of a stage hold it: full copies ("ddp") or shards ("fsdp").
DATA_PARALLEL = ("ddp", "fsdp")
RecomputeArg = Union[bool, Sequence[bool]]


@dataclass(frozen=True)
class PipelinePlan:
    """One layout of a pipeline job: ``width`` replicas of a ``depth``-stage pipeline and how it runs.

    Every misconfiguration is refused here, once, when the plan is built (before any process
    communicates). A plan is a value: equal plans describe the same layout, and
    :meth:`replace` gives a changed copy that is validated again.

    Args:
        width: data-parallel replicas ``w`` of every stage.
        depth: pipeline stages ``d``.
        microbatches: microbatches ``m`` each replica's batch is split into.
        schedule: a name of the registry (``schedules/registry.py``): "gpipe", "1f1b", "2bw" (needs
            ``microbatches >= depth``), "looped_bfs", "zbv" or "dualpipev" (two stages per rank
            in a V; DualPipeV needs ``microbatches >= 2 depth``), or an alias (torch's class names).
        split_backward: split each backward into input and weight gradients (2BP).
        split_max_pending: with ``split_backward``, the most microbatches waiting for their W on
            every stage; ``None``: ``s`` on stage ``s`` (ZB-H1's bound), as the schedule places W's.
            GPipe and 1F1B only: 2BW's placement keeps one.
        partition: blocks per stage (a list of ``depth * virtual_stages`` positive counts), or "balanced" /
            "uniform" until :meth:`resolve` turns it into counts for a given chain, or "profile"
            (balanced by profiled time; :class:`~lightning_pipe.PipelineStrategy` resolves it).
        recompute: activation recomputation, one flag for all stages or one per stage
            (``depth * virtual_stages`` of them); kept as one flag per stage. With
            ``split_backward`` a recomputed stage's forward keeps no
            graph, and I reruns it once; W reuses that graph.
        inner: which dimension's ranks are neighbours (and so share a node): "pp" (the stages
            of a pipeline, default) or "dp" (the replicas of a stage); see :class:`Topology`.
        virtual_stages: stages per rank ``v``. Above 1 the chain is cut into ``depth * v``
            stages, rank ``r`` of a pipeline runs the stages ``placement`` gives it, and the
            schedule is one of several stages per rank: interleaved 1F1B (``schedule="1f1b"``,
            ``microbatches`` a multiple of ``depth``; see ``schedules/interleaved.py``: the
            bubble shrinks ``v`` times for ``v`` times the messages; with ``split_backward``
            each rank places its W's as ZB-H1 does), interleaved 2BW (``schedule="2bw"``: each
            rank's stream never flushed; the loop placement needs ``m v >= 2 (d-1) + (v-1) d``,
            the V ``v = 2`` and ``m >= 2d - 1``; with ``split_backward`` each stage of a rank keeps
            its own W waiting; see ``schedules/two_bw.py``), looped BFS, ZB-V or DualPipeV.
        split_placement: with ``split_backward``, where the W's go (``schedules/w_placement.py``):
            ``None`` for the schedule's own (ZB-H1 for 1F1B, "bounded" for GPipe, "carry" for 2BW; named,
            it becomes ``None``: the same plan), or one of "end", "cooldown", "zb-h1", "bounded",
            "drain". "drain" (1F1B, one stage per rank)
            splits only the backwards after a stage's last forward: 1F1B's peak memory, and half
            of ZB-H1's saving with equal F, I and W.
        data_parallel: how the ``width`` replicas of a stage hold it: "ddp" (default), each a
            full copy, gradients averaged by all-reduce; "fsdp", the stage's weights, gradients
            and optimizer state sharded over the replicas (FSDP2's ``fully_shard`` on each
            block, over the mesh's "data_parallel" dimension), parameters all-gathered for
            each block's forward and backward, gradients reduce-scattered once per batch.
            GPipe, 1F1B and interleaved 1F1B, with or without split backward (a stage stays
            gathered from an I until its W: runtime/sharding.py), and ZB-V; not 2BW.
        reshard_after_forward: with ``data_parallel="fsdp"``, free each block's gathered
            parameters after its forward and gather them again for its backward (ZeRO-3's
            memory, default); ``False`` keeps them gathered from a block's first forward to the
            batch's gradient reduction (ZeRO-2's memory, fewer all-gathers).
        tensor_parallel: ranks ``t`` each stage replica is split over (default 1): the job runs
            on ``width * depth * t`` processes; the ``t`` ranks of a stage replica see the same
            activations and data and split the stage's layers as the module's
            ``configure_stage`` hook says (``torch.distributed.tensor.parallel``). GPipe and
            1F1B with one stage per rank, DDP replicas, no split backward: FSDP, 2BW, split
            backward and ``virtual_stages > 1`` are refused with ``t > 1``.
    """

    width: int = 1
    depth: int = 1
    microbatches: int = 1
    schedule: str = "1f1b"
    split_backward: bool = False
    split_max_pending: Optional[int] = None
    partition: PartitionArg = "balanced"
    recompute: RecomputeArg = False
    inner: str = "pp"
    virtual_stages: int = 1
    split_placement: Optional[str] = None
    placement: Optional[str] = None
    data_parallel: str = "ddp"
    reshard_after_forward: bool = True
    tensor_parallel: int = 1

    def __post_init__(self) -> None:
        Topology(self.world_size, self.depth, self.inner, self.tensor_parallel)  # all >= 1, a known orientation
        if self.width < 1:
            raise ValueError(f"width must be >= 1, got {self.width}")
        if self.microbatches < 1:
            raise ValueError(f"microbatches must be >= 1, got {self.microbatches}")
        object.__setattr__(self, "schedule", get(self.schedule).name)  # an alias names the same plan
        self.spec.check(self.depth, self.microbatches, self.virtual_stages, self.placement)
        object.__setattr__(self, "placement", self.spec.placement(self.virtual_stages, self.placement))
        self._normalise_recompute()
        self._normalise_partition()
        if self.split_max_pending is not None:
            if not self.split_backward:
                raise ValueError("split_max_pending only applies with split_backward=True")
            if self.split_max_pending < 0:
                raise ValueError(f"split_max_pending must be >= 0, got {self.split_max_pending}")
            if self.spec.fixed_placement:
                raise ValueError(
                    f"split_max_pending does not apply to schedule {self.schedule!r}: its placement, "
                    f"{self.spec.w_placement!r}, is part of the schedule (schedules/w_placement.py)"
                )
        if self.spec.streams and self.virtual_stages > 1 and self.split_backward:
            check_two_bw_split(self.depth, self.microbatches, self.virtual_stages, self.placement)
        self._check_placement()
        self._check_data_parallel()
        self._check_tensor_parallel()

    def _check_tensor_parallel(self) -> None:
        """Refuse, with ``tensor_parallel > 1``, what the tensor-parallel runtime does not run: each
        error names what to use instead."""
        if self.tensor_parallel == 1:
            return
        why = f"tensor_parallel={self.tensor_parallel}"
        if self.data_parallel == "fsdp":
            raise ValueError(
                f"{why} does not run with data_parallel='fsdp' (FSDP and tensor parallel on one stage need a "
                "2-D sharding this strategy does not build); use data_parallel='ddp' with tensor parallel, or "
                "tensor_parallel=1 with FSDP"
            )
        if self.spec.streams:
            raise ValueError(
                f"{why} does not run schedule {self.schedule!r} (its second weight version is a plain copy of "
                "the stage's weights, not of their tensor-parallel shards); use schedule='1f1b' or 'gpipe'"
            )
        if self.split_backward:
            raise ValueError(
                f"{why} does not run split_backward=True (the deferred weight gradients are computed on plain "
                "tensors, not on tensor-parallel shards); use split_backward=False"
            )
        if self.virtual_stages > 1:
            raise ValueError(f"{why} runs one stage per rank; use virtual_stages=1 (schedule='1f1b' or 'gpipe')")

    def _check_data_parallel(self) -> None:
        if self.data_parallel not in DATA_PARALLEL:
            raise ValueError(f"unknown data_parallel {self.data_parallel!r}; use one of {DATA_PARALLEL}")
        if self.data_parallel != "fsdp":
            if not self.reshard_after_forward:
                raise ValueError("reshard_after_forward only applies with data_parallel='fsdp'")
            return
        if self.spec.streams:
            raise ValueError(
                f"data_parallel='fsdp' does not run schedule {self.schedule!r}: its two weight versions are "
                "plain copies of the stage's weights; use schedule='1f1b' (or 'gpipe', or virtual_stages > 1) "
                "with data_parallel='fsdp', or data_parallel='ddp' with 2BW"
            )

    def _check_placement(self) -> None:
        placement = self.split_placement
        if placement is None:
            return
        if not self.split_backward:
            raise ValueError("split_placement only applies with split_backward=True")
        if placement == self.spec.w_placement:  # the schedule's own, named: the same plan as None
            object.__setattr__(self, "split_placement", None)
            return
        if self.spec.fixed_placement:
            raise ValueError(
                f"split_placement does not apply to schedule {self.schedule!r} (it places W's by its own "
                f"rule, {self.spec.w_placement!r}: see schedules/w_placement.py)"
            )
        if placement not in PLACEMENTS:
            raise ValueError(f"unknown split_placement {placement!r}; use one of {PLACEMENTS}")
        if placement == "drain":
            self._check_drain()

    def _check_drain(self) -> None:
        if not self.spec.offers_drain(self.virtual_stages):
            raise ValueError(
                "split_placement='drain' is for 1F1B with one stage per rank (GPipe's backwards are all in "
                f"its drain: use its default; got schedule={self.schedule!r}, virtual_stages={self.virtual_stages})"
            )
        if self.split_max_pending is not None:
            raise ValueError(
                "split_max_pending does not apply with split_placement='drain' (each W runs right after its I)"
            )

    def _normalise_recompute(self) -> None:
        flags = self.recompute
        flags = (bool(flags),) * self.stages if isinstance(flags, bool) else tuple(bool(f) for f in flags)
        if len(flags) != self.stages:
            count = f"{self.stages}: {self._per_rank}" if self._per_rank else str(self.stages)
            raise ValueError(f"recompute needs one flag per stage ({count}), got {len(flags)}")
        object.__setattr__(self, "recompute", flags)

    def _normalise_partition(self) -> None:
        spec = self.partition
        if isinstance(spec, str):
            if spec not in ("balanced", "uniform", "profile"):
                raise ValueError(
                    f"unknown partition {spec!r}; use 'balanced', 'uniform', 'profile' or a list of blocks per stage"
                )
            return
        sizes = tuple(int(s) for s in spec)
        if len(sizes) != self.stages or min(sizes) < 1:
            why = f" ({self._per_rank})" if self._per_rank else ""
            raise ValueError(
                f"partition {list(sizes)} must list {self.stages} positive block counts, one per stage{why}"
            )
        object.__setattr__(self, "partition", sizes)

    @classmethod
    def for_world(cls, world_size: int, depth: Optional[int] = None, **fields: object) -> "PipelinePlan":
        """The plan that spreads ``world_size`` processes over ``depth`` stages (default: one pipeline)
        of ``fields["tensor_parallel"]`` ranks each (default 1).

        Raises:
            ValueError: if ``world_size`` is not a multiple of ``depth``, or any field is invalid.
        """
        tensor_parallel = int(fields.get("tensor_parallel", 1))  # type: ignore[call-overload]
        depth = depth or max(world_size // tensor_parallel, 1)
        topology = Topology(world_size, depth, tensor_parallel=tensor_parallel)
        return cls(width=topology.width, depth=depth, **fields)  # type: ignore[arg-type]

    @property
    def spec(self) -> ScheduleSpec:
        """The schedule's registry entry: its properties (``schedules/registry.py``)."""
        return get(self.schedule)

    @property
    def stages(self) -> int:
        """Stages the chain is cut into: ``depth * virtual_stages``."""
        return self.depth * self.virtual_stages

    def stages_of(self, pipeline_rank: int) -> list[int]:
        """The stages the ``pipeline_rank``-th rank of a pipeline runs, in chain order."""
        return rank_stages(pipeline_rank, self.depth, self.virtual_stages, self.stage_placement)

    def rank_of_stage(self, stage: int) -> int:
        """The pipeline rank (position in its pipeline) that runs ``stage``."""
        return stage_rank(stage, self.depth, self.stage_placement)

    @property
    def stage_placement(self) -> str:
        """The resolved stage placement, "loop" or "v" (:attr:`placement`)."""
        return self.placement or "loop"

    @property
    def _per_rank(self) -> str:
        """How the stage count comes about, as the user set it (empty with one stage per rank)."""
        return f"pipeline_depth={self.depth} x virtual_stages={self.virtual_stages}" if self.virtual_stages > 1 else ""

    @property
    def world_size(self) -> int:
        """Processes the plan needs: ``width * depth * tensor_parallel``."""
        return self.width * self.depth * self.tensor_parallel

    def check_world_size(self, world_size: int) -> None:
        """Raise a clear error unless this plan runs on ``world_size`` processes.

        Raises:
            ValueError: naming the plan, the processes it needs and the processes the run has.
        """
        if world_size != self.world_size:
            raise ValueError(f"plan {self.describe()} needs {self.world_size} processes, this run has {world_size}")

    @property
    def topology(self) -> Topology:
        """Which rank runs which replica of which stage."""
        return Topology(self.world_size, self.depth, self.inner, self.tensor_parallel)

    @property
    def is_resolved(self) -> bool:
        """Whether the partition is a list of block counts (not "balanced" or "uniform")."""
        return not isinstance(self.partition, str)

    def resolve(self, costs: Sequence[float]) -> "PipelinePlan":
        """This plan with its partition turned into block counts for a chain with ``costs`` per block.

        Raises:
            ValueError: if there are fewer blocks than stages or the counts do not sum to the chain.
        """
        if self.partition == "profile":
            raise ValueError("partition='profile' is resolved from a profile (PipelineStrategy does it at setup)")
        if len(costs) < self.stages:
            over = (
                f"{self.stages} stages ({self._per_rank})" if self._per_rank else f"pipeline_depth={self.depth} stages"
            )
            raise ValueError(
                f"cannot split {len(costs)} pipeline blocks over {over}: need at least one block per stage"
            )
        sizes = partition_sizes(
            self.partition if isinstance(self.partition, str) else list(self.partition), costs, self.stages
        )
        return self.replace(partition=tuple(sizes))

    def stage_ranges(self) -> list[range]:
        """Block indices of each stage (the partition must be resolved)."""
        if not self.is_resolved:
            raise ValueError(f"partition {self.partition!r} is not resolved yet; call plan.resolve(block_costs)")
        return stage_ranges(list(self.partition))  # type: ignore[arg-type]

    def replace(self, **changes: object) -> "PipelinePlan":
        """A copy with ``changes`` applied, validated again."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def describe(self) -> str:
        """One line: ``w x d``, microbatches, schedule, split, partition and the recomputing stages."""
        split = " + split backward" if self.split_backward else ""
        split += f" ({self.split_placement})" if self.split_placement else ""
        ranks = ", replicas on neighbouring ranks" if self.inner == "dp" else ""
        virtual = f" interleaved, {self.virtual_stages} stages per rank" if self.virtual_stages > 1 else ""
        virtual += " in a V" if self.stage_placement == "v" else ""
        if self.data_parallel == "fsdp":
            ranks += f", FSDP replicas{'' if self.reshard_after_forward else ' (kept gathered: ZeRO-2)'}"
        if self.tensor_parallel > 1:
            ranks += f", each stage over {self.tensor_parallel} tensor-parallel ranks"
        stages = [s for s, on in enumerate(self.recompute) if on]
        recompute = f", recompute stages {stages}" if stages else ""
        return (
            f"w={self.width} x d={self.depth}, m={self.microbatches}, {self.schedule}{virtual}{split}, "
            f"partition {list(self.partition) if self.is_resolved else self.partition}{recompute}{ranks}"
        )
