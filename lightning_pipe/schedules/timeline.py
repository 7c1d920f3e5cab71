"""Pipeline timelines: recording the actions that ran, their idle fraction, and drawing them.

Measured traces (from the executor) and simulated ones (:func:`lightning_pipe.schedules.simulate`) are
both lists of :class:`~lightning_pipe.schedules.simulate.Interval`, so one drawing and one bubble
formula serve both, which is how the monitor's numbers are checked against the simulator.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from lightning_pipe.schedules.actions import COMPUTE_KINDS, Action, Kind
from lightning_pipe.schedules.simulate import Interval

# Colours of the papers' figures (2BP, Zero Bubble): forward blue, backward green, split backward light green
# (input gradients) and orange (weight gradients); optimizer steps grey.
COLOURS: dict[Kind, str] = {
    Kind.FORWARD: "#4c72b0",
    Kind.BACKWARD: "#55a868",
    Kind.INPUT_GRAD: "#8fd18f",
    Kind.WEIGHT_GRAD: "#dd8452",
    Kind.OPTIMIZER_STEP: "#7f7f7f",
}


@dataclass
class Trace:
    """The actions one rank ran, with wall-clock start and end times.

    Times come from ``time.time()``: one clock for every process of a host, so traces of
    ranks on one machine line up; across hosts they are as close as the hosts' clocks.

    Args:
        rank: the global rank whose actions are recorded.
    """

    rank: int
    intervals: list[Interval] = field(default_factory=list)

    def record(self, action: Action, start: float, end: float) -> None:
        """Append one action that ran from ``start`` to ``end``."""
        self.intervals.append(Interval(self.rank, action, start, end))

    def clear(self) -> None:
        """Forget what was recorded."""
        self.intervals = []


def now() -> float:
    """The clock traces use."""
    return time.time()


def compute_time(intervals: Iterable[Interval]) -> dict[int, float]:
    """Seconds each rank spent in compute actions (F, B, I, W)."""
    busy: dict[int, float] = {}
    for i in intervals:
        busy.setdefault(i.rank, 0.0)
        if i.action.kind in COMPUTE_KINDS:
            busy[i.rank] += i.end - i.start
    return busy


def span(intervals: Iterable[Interval]) -> float:
    """Seconds from the first action's start to the last action's end."""
    items = list(intervals)
    return max(i.end for i in items) - min(i.start for i in items) if items else 0.0


def bubble_fraction(intervals: Iterable[Interval]) -> tuple[dict[int, float], float]:
    """Idle fraction of each rank and of all ranks together over the intervals' span.

    Idle is everything but compute (F, B, I, W): waiting on receives, the flush, optimizer
    steps, as the simulator's ``SimResult.bubble`` counts it.

    Returns:
        ``({rank: 1 - busy / span}, 1 - sum(busy) / (ranks * span))``.
    """
    items = list(intervals)
    total, busy = span(items), compute_time(items)
    if not total:
        return {r: 0.0 for r in busy}, 0.0
    per_rank = {r: 1.0 - b / total for r, b in busy.items()}
    return per_rank, 1.0 - sum(busy.values()) / (len(busy) * total)


def draw(intervals: Iterable[Interval], title: str = "", labels: Optional[dict[int, str]] = None) -> Any:
    """A matplotlib figure of the timeline: one row per rank (rank 0 on top), one box per
    compute action labelled with its microbatch, optimizer steps in grey.

    Args:
        intervals: measured or simulated actions.
        title: figure title.
        labels: row label of each rank (default "rank r").

    Returns:
        The ``matplotlib.figure.Figure``; the caller saves or logs it and closes it.
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    items = [i for i in intervals if i.action.kind in COLOURS]
    ranks = sorted({i.rank for i in items})
    origin = min((i.start for i in items), default=0.0)
    scale, unit = _unit(span(items))
    fig = Figure(figsize=(12, 0.6 * len(ranks) + 1.4))
    ax = fig.add_subplot()
    min_label = span(items) * scale / 80  # boxes narrower than this get no microbatch number
    for row, rank in enumerate(ranks):
        for i in (i for i in items if i.rank == rank):
            _box(ax, row, (i.start - origin) * scale, (i.end - i.start) * scale, i.action, min_label)
    ax.set_yticks(range(len(ranks)), [(labels or {}).get(r, f"rank {r}") for r in ranks])
    ax.set_ylim(len(ranks) - 0.5, -0.5)
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(title)
    kinds = [k for k in COLOURS if any(i.action.kind == k for i in items)]
    ax.legend(
        handles=[Patch(color=COLOURS[k], label=k.name.lower().replace("_", " ")) for k in kinds],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize="small",
    )
    fig.tight_layout()
    return fig


def _unit(seconds: float) -> tuple[float, str]:
    return (1.0, "s") if seconds >= 10 else (1e3, "ms")


def _box(ax: Any, row: int, start: float, width: float, action: Action, min_label: float) -> None:
    ax.barh(row, width, left=start, height=0.8, color=COLOURS[action.kind], edgecolor="black", linewidth=0.4)
    if action.kind in COMPUTE_KINDS and width >= min_label:
        ax.text(start + width / 2, row, str(action.microbatch), ha="center", va="center", fontsize=7, clip_on=True)
