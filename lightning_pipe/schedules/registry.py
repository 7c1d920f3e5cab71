"""The schedules a user can name, each one :class:`ScheduleSpec`: its generator and the facts other layers read.

Every question about a schedule (does it flush, how many weight versions and gradient sets it
keeps, which ``(d, m, v)`` it runs, where split backward puts its W's) is answered here, so no
other module compares schedule names. Adding a schedule means writing its generator and one
entry in :data:`SCHEDULES`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from lightning_pipe.schedules import interleaved, two_bw, v_shape
from lightning_pipe.schedules.actions import Action
from lightning_pipe.schedules.generators import Generator, gpipe, one_f_one_b
from lightning_pipe.schedules.layout import check_placement

#: One rank's compute actions of a schedule with several stages per rank:
#: ``(rank, depth, microbatches, virtual, placement)``.
RankGenerator = Callable[[int, int, int, int, str], list[Action]]


@dataclass(frozen=True)
class ScheduleSpec:
    """One training schedule and its properties.

    Args:
        name: the name users give (``PipelineStrategy(schedule=...)``, YAML).
        summary: one line for tables and errors.
        generator: one stage's compute actions of one flushed step, or ``None`` for a stream
            whose per-step windows are built by their own pass (2BW, ``schedules/two_bw.py``) and
            for a schedule of several stages per rank only (``rank_generator``).
        streams: the microbatches stream on across steps: no flush between steps.
        weight_versions: weight versions kept alive (2 under PipeDream-2BW's double buffering).
        gradient_sets: batches' gradients a stage may hold at once (a streaming stage holds the
            gradient it is accumulating and the one it has not applied yet).
        stale: updates apply gradients computed on older weights (PipeDream-2BW's 1-stale
            rule) rather than matching single-process training.
        w_placement: where split backward puts the W's by default (``schedules/w_placement.py``).
        fixed_placement: the W placement is part of the schedule: ``split_placement`` and
            ``split_max_pending`` do not apply.
        interleaves: runs ``virtual_stages > 1``, each rank's program written by ``rank_generator``
            (2BW's by its own windows, ``schedules/two_bw.py``).
        rank_generator: one rank's compute actions with ``virtual_stages > 1`` (Megatron-LM's
            interleaved 1F1B for ``"1f1b"``).
        placements: the stage placements it runs with ``virtual_stages > 1``
            (``schedules/layout.py``), its default first.
        virtual_stages: the only stage count per rank it runs (ZB-V's and DualPipeV's 2), or ``None``.
        one_stage: what it is with one stage per rank, if another schedule (looped BFS's GPipe):
            it then needs ``virtual_stages > 1``, and the error names that schedule.
        splits_itself: its generator writes I and W itself (ZB-V, DualPipeV); without split
            backward each I becomes the whole B, run where the I ran (``v_shape.join_backward``).
        microbatches_at_least: needs ``m >= microbatches_at_least * d`` (DualPipeV: 2, one
            microbatch per stage of the V).
        rounds: with ``virtual_stages > 1`` and the loop placement it runs microbatches in rounds
            of ``d`` (interleaved 1F1B: ``m`` a multiple of ``d``).
        drain_split: offers ``split_placement="drain"`` with one stage per rank.
        microbatches_at_least_depth: needs ``m >= d`` (2BW: otherwise a third weight version
            would be in flight).
        aliases: other names accepted for it (torch.distributed.pipelining's class names).
    """

    name: str
    summary: str
    generator: Optional[Generator]
    streams: bool = False
    weight_versions: int = 1
    gradient_sets: int = 1
    stale: bool = False
    w_placement: str = "zb-h1"
    fixed_placement: bool = False
    interleaves: bool = False
    drain_split: bool = False
    microbatches_at_least_depth: bool = False
    aliases: tuple[str, ...] = ()
    rank_generator: Optional[RankGenerator] = None
    placements: tuple[str, ...] = ("loop",)
    virtual_stages: Optional[int] = None
    splits_itself: bool = False
    microbatches_at_least: int = 0
    rounds: bool = True
    one_stage: Optional[str] = None

    def check(self, depth: int, microbatches: int, virtual: int = 1, placement: Optional[str] = None) -> None:
        """Raise a clear ``ValueError`` unless it runs ``microbatches`` on ``depth`` ranks of
        ``virtual`` stages placed by ``placement`` (``None``: its default)."""
        if self.virtual_stages is not None and virtual != self.virtual_stages:
            raise ValueError(
                f"schedule {self.name!r} runs {self.virtual_stages} stages per rank in a V: "
                f"set virtual_stages={self.virtual_stages} (got {virtual})"
            )
        if virtual == 1 and self.one_stage is not None:
            raise ValueError(
                f"schedule {self.name!r} with one stage per rank is {self.one_stage!r}: "
                f"use schedule={self.one_stage!r}, or set virtual_stages > 1"
            )
        if virtual > 1 and not self.interleaves:
            names = [s.name for s in SCHEDULES.values() if s.interleaves]
            raise ValueError(
                f"virtual_stages={virtual} runs interleaved 1F1B: use schedule={names[0]!r}, or another schedule "
                f"of several stages per rank, one of {names[1:]} (got schedule={self.name!r})"
            )
        if placement is not None:
            check_placement(placement)
            if virtual > 1 and placement not in self.placements:
                raise ValueError(
                    f"schedule {self.name!r} runs the stage placements {list(self.placements)}, not {placement!r}: "
                    f"use placement={self.placements[0]!r}"
                )
        shape = self.placement(virtual, placement)
        interleaved.check(depth, microbatches, virtual if self.rounds and shape == "loop" else 1)
        if virtual > 1 and depth < 2:
            raise ValueError("virtual_stages > 1 needs pipeline_depth >= 2 (one rank gains nothing from interleaving)")
        if self.microbatches_at_least and microbatches < self.microbatches_at_least * depth:
            raise ValueError(
                f"schedule {self.name!r} needs microbatches >= {self.microbatches_at_least} x pipeline_depth "
                f"(one per stage of the V; got m={microbatches}, d={depth})"
            )
        if self.streams and virtual > 1:
            (two_bw.check_v if shape == "v" else two_bw.check_interleaved)(depth, microbatches, virtual)
        if self.microbatches_at_least_depth and microbatches < depth:
            raise ValueError(
                f"schedule {self.name!r} needs microbatches >= pipeline_depth (got m={microbatches}, d={depth}); "
                "with fewer, in-flight microbatches would need a third weight version"
            )

    def runs(self, depth: int, microbatches: int, virtual: int = 1, placement: Optional[str] = None) -> bool:
        """Whether :meth:`check` accepts ``(depth, microbatches, virtual, placement)``."""
        try:
            self.check(depth, microbatches, virtual, placement)
        except ValueError:
            return False
        return True

    def placement(self, virtual: int, placement: Optional[str] = None) -> str:
        """The stage placement it runs at ``virtual`` stages per rank: ``placement``, or its
        default; ``"loop"`` with one stage per rank (where every placement is the chain)."""
        return "loop" if virtual == 1 else placement or self.placements[0]

    def offers_drain(self, virtual: int) -> bool:
        """Whether ``split_placement="drain"`` applies at ``virtual`` stages per rank: with one stage
        per rank only (on an interleaved rank the last forward is the rank's, not each stage's)."""
        return self.drain_split and virtual == 1


#: Every schedule a user can name, by name.
SCHEDULES: dict[str, ScheduleSpec] = {
    spec.name: spec
    for spec in (
        ScheduleSpec(
            "gpipe",
            "GPipe: all forwards, then all backwards; every microbatch's activations held",
            gpipe,
            w_placement="bounded",
            aliases=("GPipe",),
        ),
        ScheduleSpec(
            "1f1b",
            "PipeDream-Flush (1F1B): at most d - s microbatches held on stage s; a flush per step",
            one_f_one_b,
            w_placement="zb-h1",
            interleaves=True,
            drain_split=True,
            aliases=("1F1B", "PipeDreamFlush", "Interleaved1F1B", "InterleavedZeroBubble"),
            rank_generator=interleaved.rank_one_f_one_b,
        ),
        ScheduleSpec(
            "looped_bfs",
            "Looped BFS: GPipe over each rank's stages in turn (every forward of one, then the next)",
            None,
            w_placement="bounded",
            interleaves=True,
            aliases=("LoopedBFS", "BFS"),
            rank_generator=interleaved.looped_bfs,
            placements=("loop", "v"),
            rounds=False,
            one_stage="gpipe",
        ),
        ScheduleSpec(
            "zbv",
            "ZB-V (Zero Bubble): two stages per rank in a V, split backward; 1F1B's memory, no bubble at F = I = W",
            None,
            fixed_placement=True,
            interleaves=True,
            aliases=("ZBV", "ZBVZeroBubble", "ZB-V"),
            rank_generator=lambda rank, depth, m, virtual, placement: v_shape.zbv(rank, depth, m),
            placements=("v",),
            virtual_stages=2,
            splits_itself=True,
            rounds=False,
        ),
        ScheduleSpec(
            "dualpipev",
            "DualPipeV (DeepSeek's DualPipe in a V): a forward and a backward of two microbatches paired",
            None,
            fixed_placement=True,
            interleaves=True,
            aliases=("DualPipeV", "DualPipe-V"),
            rank_generator=lambda rank, depth, m, virtual, placement: v_shape.dualpipev(rank, depth, m),
            placements=("v",),
            virtual_stages=2,
            splits_itself=True,
            microbatches_at_least=2,
            rounds=False,
        ),
        ScheduleSpec(
            "2bw",
            "PipeDream-2BW: 1F1B (or interleaved 1F1B) streamed across steps, two weight versions, 1-stale updates",
            None,
            streams=True,
            interleaves=True,
            placements=("loop", "v"),
            weight_versions=2,
            gradient_sets=2,
            stale=True,
            w_placement="carry",
            fixed_placement=True,
            microbatches_at_least_depth=True,
            aliases=("2BW", "PipeDream2BW"),
        ),
    )
}

_BY_ALIAS = {alias: spec for spec in SCHEDULES.values() for alias in (spec.name, *spec.aliases)}

#: The names users can give, canonical ones only.
SCHEDULE_NAMES: tuple[str, ...] = tuple(SCHEDULES)


def get(name: str) -> ScheduleSpec:
    """The spec of schedule ``name`` (its own name or an alias).

    Raises:
        ValueError: for a name no schedule has, listing the ones that exist.
    """
    spec = _BY_ALIAS.get(name)
    if spec is None:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {sorted(SCHEDULE_NAMES)}")
    return spec


def check_name(name: str) -> None:
    """Raise a clear error for a schedule name that does not exist."""
    get(name)


def flushed_generator(name: str) -> Generator:
    """The generator of a schedule that flushes once per step.

    Raises:
        ValueError: for an unknown name, a streaming schedule (built window by window), or one of
            several stages per rank only (its rank generator writes each rank's program).
    """
    spec = get(name)
    if spec.generator is None and not spec.streams:
        raise ValueError(f"schedule {name!r} runs several stages per rank: build it with build_schedule(virtual=...)")
    if spec.generator is None:
        raise ValueError(f"schedule {name!r} is not flushed per batch; build it with two_bw_window()")
    return spec.generator
