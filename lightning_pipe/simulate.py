"""Pure simulator: runs per-rank action lists over a cost model and reports time, bubble and stash."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Union

import numpy as np

from lightning_pipe.schedules.actions import COMPUTE_KINDS, Action, Kind, ScheduleError, format_actions
from lightning_pipe.schedules.flat import CODES, FlatProgram, flatten

CostModel = Union[Mapping[Kind, float], Callable[[Action], float]]

# A receive can start once the matching send on the neighbouring stage has completed.
_SENDER: dict[Kind, tuple[Kind, int]] = {Kind.RECV_ACT: (Kind.SEND_ACT, -1), Kind.RECV_GRAD: (Kind.SEND_GRAD, +1)}
# Actions that take a microbatch into / out of the stage's activation stash.
STASH_IN: frozenset[Kind] = frozenset({Kind.FORWARD})
STASH_OUT: frozenset[Kind] = frozenset({Kind.BACKWARD, Kind.WEIGHT_GRAD})


@dataclass(frozen=True)
class StashModel:
    """Bytes one microbatch holds on a stage: ``activation`` from F until its backward; with
    split backward, ``after_input_grad`` of it (what W still needs: weight-op inputs and
    intermediate gradients) from I until W."""

    activation: float = 1.0
    after_input_grad: float = 1.0

    def delta(self, kind: Kind) -> float:
        """Change of stashed bytes when an action of ``kind`` completes."""
        return {
            Kind.FORWARD: self.activation,
            Kind.BACKWARD: -self.activation,
            Kind.INPUT_GRAD: self.after_input_grad - self.activation,
            Kind.WEIGHT_GRAD: -self.after_input_grad,
        }.get(kind, 0.0)


@dataclass(frozen=True)
class Interval:
    """One action as it ran (or would run): on which rank, from when to when."""

    rank: int
    action: Action
    start: float
    end: float


@dataclass
class SimResult:
    """What the simulator found for one pipeline."""

    makespan: float
    busy: list[float]
    peak_stash: list[int]
    timeline: list[Interval] = field(default_factory=list)
    peak_stash_bytes: list[float] = field(default_factory=list)

    @property
    def bubble(self) -> list[float]:
        """Idle fraction of each rank: 1 - busy / makespan."""
        return [1.0 - b / self.makespan if self.makespan else 0.0 for b in self.busy]

    @property
    def total_bubble(self) -> float:
        """Idle fraction over all ranks together."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan) if self.makespan else 0.0


def unit_costs(forward: float = 1.0, backward: float = 1.0) -> dict[Kind, float]:
    """Cost model charging only compute; communication and the flush are free."""
    return {Kind.FORWARD: forward, Kind.BACKWARD: backward}


def _cost_fn(costs: CostModel) -> Callable[[Action], float]:
    if callable(costs):
        return costs
    return lambda a: float(costs.get(a.kind, 0.0))


def grid(schedule: list[list[Action]]) -> str:
    """Rank-by-step text of a schedule, printed in errors."""
    return "\n".join(f"  rank {r}: {format_actions(acts)}" for r, acts in enumerate(schedule))


def _dependency(action: Action) -> Optional[Action]:
    if action.kind not in _SENDER:
        return None
    kind, offset = _SENDER[action.kind]
    return Action(action.stage + offset, kind, action.microbatch)


def _peak(actions: list[Action], delta: Callable[[Kind], float]) -> float:
    live, peak = 0.0, 0.0
    for a in actions:
        live += delta(a.kind)
        peak = max(peak, live)
    return peak


def _microbatch_delta(kind: Kind) -> float:
    return float(kind in STASH_IN) - float(kind in STASH_OUT)


def _advance(rank: int, actions: list[Action], ptr: int, clock: float, done: dict, cost, out: list) -> tuple[int, float]:
    """Run rank's actions from ``ptr`` until one waits on a send not yet simulated."""
    while ptr < len(actions):
        action = actions[ptr]
        dep = _dependency(action)
        if dep is not None and dep not in done:
            break
        start = max(clock, done.get(dep, 0.0)) if dep is not None else clock
        clock = start + cost(action)
        done[action] = clock
        out.append(Interval(rank, action, start, clock))
        ptr += 1
    return ptr, clock


def simulate(schedule: list[list[Action]], costs: CostModel, stash: StashModel = StashModel()) -> SimResult:
    """Simulate one pipeline; rank ``r`` runs ``schedule[r]`` in order, sends never block.

    Reports the makespan, busy time per rank, peak microbatches stashed per stage (held from
    F until B, or until W with split backward) and peak stashed bytes under ``stash``.

    Raises:
        ScheduleError: if the ranks deadlock (a receive whose send never comes).
    """
    cost = _cost_fn(costs)
    ptrs, clocks = [0] * len(schedule), [0.0] * len(schedule)
    done: dict[Action, float] = {}
    timeline: list[Interval] = []
    while any(p < len(a) for p, a in zip(ptrs, schedule)):
        before = list(ptrs)
        for r, actions in enumerate(schedule):
            ptrs[r], clocks[r] = _advance(r, actions, ptrs[r], clocks[r], done, cost, timeline)
        if ptrs == before:
            stuck = {r: str(schedule[r][p]) for r, p in enumerate(ptrs) if p < len(schedule[r])}
            raise ScheduleError(f"deadlock: ranks wait at {stuck}\n{grid(schedule)}")
    busy = [sum(i.end - i.start for i in timeline if i.rank == r and i.action.kind in COMPUTE_KINDS) for r in range(len(schedule))]
    peaks = [int(_peak(a, _microbatch_delta)) for a in schedule]
    peak_bytes = [_peak(a, stash.delta) for a in schedule]
    return SimResult(max(clocks, default=0.0), busy, peaks, timeline, peak_bytes)


@dataclass(frozen=True)
class CompiledProgram:
    """A program flattened once for repeated makespans under different costs (the planner's hot loop).

    Every action is listed in an order the simulator can run them (each after its rank's
    previous action and after the send it receives), as three lists of plain integers (millions
    of tuples would burden the garbage collector): ``order_ranks`` its rank, ``order_keys`` its
    cost key, ``order_waits`` the index in that order of the send it waits for, or -1. An
    action's cost depends only on its key, (stage, kind); ``keys`` holds the first action of each key.
    """

    ranks: int
    keys: tuple[Action, ...]
    order_ranks: list[int]
    order_keys: list[int]
    order_waits: list[int]
    counts: tuple[int, ...] = ()  # actions of each key

    def makespan(self, key_costs: list[float]) -> float:
        """The same makespan :func:`simulate` finds when every action costs ``key_costs[key]``."""
        clock, end = [0.0] * self.ranks, [0.0] * len(self.order_ranks)
        for i, (rank, key, dep) in enumerate(zip(self.order_ranks, self.order_keys, self.order_waits)):
            start = clock[rank]
            if dep >= 0 and end[dep] > start:
                start = end[dep]
            clock[rank] = end[i] = start + key_costs[key]
        return max(clock, default=0.0)

    def busy(self, key_costs: list[float], kinds: frozenset[Kind] = COMPUTE_KINDS) -> float:
        """Seconds all ranks together spend in actions of ``kinds`` (compute, by default)."""
        return sum(n * c for n, c, a in zip(self.counts, key_costs, self.keys) if a.kind in kinds)

    def costs_from(self, cost: Callable[[Action], float]) -> list[float]:
        """``cost`` evaluated once per key."""
        return [cost(a) for a in self.keys]


def compile_program(schedule: list[list[Action]], flat: Optional[FlatProgram] = None) -> CompiledProgram:
    """Flatten ``schedule`` in an order the simulator can run it (see :class:`CompiledProgram`):
    each rank advances until a receive whose send is not placed yet, round after round, as
    :func:`simulate` does, on its arrays (``flat``, made here if not given; Action objects are
    slow to read).

    Raises:
        ScheduleError: if the ranks deadlock.
    """
    flat = flat or flatten(schedule)
    codes = flat.stage * len(CODES) + flat.kind
    _, first, key_of = np.unique(codes, return_index=True, return_inverse=True)
    source, starts = flat.source.tolist(), flat.starts.tolist()
    placed = [-1] * len(source)  # each action's index in the order
    ranks: list[int] = []
    order: list[int] = []  # the actions' indices in flat
    waits: list[int] = []
    ptrs, moved = starts[:-1], True
    while moved:
        moved = False
        for rank, end in enumerate(starts[1:]):
            p = ptrs[rank]
            while p < end:
                dep = source[p]
                if dep >= 0:
                    dep = placed[dep]
                    if dep < 0:
                        break
                placed[p] = len(order)
                order.append(p)
                waits.append(dep)
                p += 1
            moved |= p != ptrs[rank]
            ranks += [rank] * (p - ptrs[rank])
            ptrs[rank] = p
    stuck = {r: str(flat.actions[p]) for r, p in enumerate(ptrs) if p < starts[r + 1]}
    if stuck:
        raise ScheduleError(f"deadlock: ranks wait at {stuck}\n{grid(schedule)}")
    counts = np.bincount(key_of, minlength=len(first)).tolist()
    return CompiledProgram(len(schedule), tuple(flat.actions[i] for i in first.tolist()), ranks, key_of[order].tolist(), waits, tuple(counts))
