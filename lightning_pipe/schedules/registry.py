"""The schedules a user can name, each one :class:`ScheduleSpec`: its generator and the facts other layers read.

Every question about a schedule (does it flush, how many weight versions and gradient sets it
keeps, which ``(d, m, v)`` it runs, where split backward puts its W's) is answered here, so no
other module compares schedule names. Adding a schedule means writing its generator and one
entry in :data:`SCHEDULES`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from lightning_pipe.schedules import interleaved
from lightning_pipe.schedules.generators import Generator, gpipe, one_f_one_b


@dataclass(frozen=True)
class ScheduleSpec:
    """One training schedule and its properties.

    Args:
        name: the name users give (``PipelineStrategy(schedule=...)``, YAML).
        summary: one line for tables and errors.
        generator: one stage's compute actions of one flushed step, or ``None`` for a stream
            whose per-step windows are built by their own pass (2BW, ``schedules/two_bw.py``).
        streams: the microbatches stream on across steps: no flush between steps.
        weight_versions: weight versions kept alive (2 under PipeDream-2BW's double buffering).
        gradient_sets: batches' gradients a stage may hold at once (a streaming stage holds the
            gradient it is accumulating and the one it has not applied yet).
        stale: updates apply gradients computed on older weights (PipeDream-2BW's 1-stale
            rule) rather than matching single-process training.
        w_placement: where split backward puts the W's by default (``schedules/w_placement.py``).
        fixed_placement: the W placement is part of the schedule: ``split_placement`` and
            ``split_max_pending`` do not apply.
        interleaves: runs ``virtual_stages > 1`` (Megatron-LM's interleaved 1F1B).
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

    def check(self, depth: int, microbatches: int, virtual: int = 1) -> None:
        """Raise a clear ``ValueError`` unless it runs ``microbatches`` on ``depth`` ranks of ``virtual`` stages."""
        if virtual > 1 and not self.interleaves:
            names = [s.name for s in SCHEDULES.values() if s.interleaves]
            raise ValueError(
                f"virtual_stages={virtual} runs interleaved 1F1B: use schedule={names[0]!r} "
                f"(got schedule={self.name!r})"
            )
        interleaved.check(depth, microbatches, virtual)
        if self.microbatches_at_least_depth and microbatches < depth:
            raise ValueError(
                f"schedule {self.name!r} needs microbatches >= pipeline_depth (got m={microbatches}, d={depth}); "
                "with fewer, in-flight microbatches would need a third weight version"
            )

    def runs(self, depth: int, microbatches: int, virtual: int = 1) -> bool:
        """Whether :meth:`check` accepts ``(depth, microbatches, virtual)``."""
        try:
            self.check(depth, microbatches, virtual)
        except ValueError:
            return False
        return True

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
            aliases=("1F1B", "PipeDreamFlush"),
        ),
        ScheduleSpec(
            "2bw",
            "PipeDream-2BW: 1F1B streamed across steps, two weight versions, 1-stale updates",
            None,
            streams=True,
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
        ValueError: for an unknown name, or a streaming schedule (built window by window).
    """
    spec = get(name)
    if spec.generator is None:
        raise ValueError(f"schedule {name!r} is not flushed per batch; build it with two_bw_window()")
    return spec.generator
