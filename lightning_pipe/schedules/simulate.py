"""Pure simulator: runs per-rank action lists over a cost model and reports time, bubble and stash."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence, Union

import numpy as np

from lightning_pipe.schedules.actions import COMPUTE_KINDS, SEND_KINDS, Action, Kind, ScheduleError, format_actions
from lightning_pipe.schedules.flat import CODES, SEND_ACT, SEND_GRAD, FlatProgram, flatten
from lightning_pipe.schedules.layout import owners

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


@dataclass(frozen=True)
class Exchange:
    """What a message costs beyond its receive's cost when the two ranks of a link send each
    other at once: under gloo on a CPU host such a message arrives milliseconds late, where one
    sent to a waiting rank takes a tenth of one (see :func:`lightning_pipe.planning.links.profile_links`).

    Args:
        window: a receive is part of an exchange when the send it takes in ended less than this
            many seconds before or after the receiving rank's last send to the same peer.
        extra: seconds such a receive takes beyond its cost.
    """

    window: float
    extra: float

    def applies(self, sent: float, own: Optional[float]) -> bool:
        """Whether a receive whose send ended at ``sent`` is part of an exchange with the receiving
        rank's last send to that peer, which ended at ``own`` (``None``: it sent none)."""
        return own is not None and abs(sent - own) < self.window


#: The stage a send goes to or a receive comes from, relative to the action's own.
_PEER_OFFSET = {Kind.SEND_ACT: 1, Kind.RECV_GRAD: 1, Kind.SEND_GRAD: -1, Kind.RECV_ACT: -1}


def _peer(action: Action, owner: Mapping[int, int]) -> int:
    """The rank a send goes to or a receive comes from (``owner``: each stage's rank)."""
    return owner[action.stage + _PEER_OFFSET[action.kind]]


def _advance(
    rank: int,
    actions: list[Action],
    ptr: int,
    clock: float,
    done: dict,
    cost,
    out: list,
    exchange: Optional[Exchange],
    last_sent: dict,
    owner: Mapping[int, int],
    latency: float = 0.0,
) -> tuple[int, float]:
    """Run rank's actions from ``ptr`` until one waits on a send not yet simulated
    (``last_sent``: when each rank's last send to each peer ended, for ``exchange``)."""
    while ptr < len(actions):
        action = actions[ptr]
        dep = _dependency(action)
        if dep is not None and dep not in done:
            break
        start = max(clock, done[dep] + latency) if dep is not None else clock
        seconds = cost(action)
        if (
            dep is not None
            and exchange is not None
            and exchange.applies(done[dep], last_sent.get((rank, _peer(action, owner))))
        ):
            seconds += exchange.extra
        clock = start + seconds
        done[action] = clock
        if action.kind in SEND_KINDS:
            last_sent[rank, _peer(action, owner)] = clock
        out.append(Interval(rank, action, start, clock))
        ptr += 1
    return ptr, clock


def simulate(
    schedule: list[list[Action]],
    costs: CostModel,
    stash: StashModel = StashModel(),
    exchange: Optional[Exchange] = None,
    latency: float = 0.0,
) -> SimResult:
    """Simulate one pipeline; rank ``r`` runs ``schedule[r]`` in order, sends never block.

    Reports the makespan, busy time per rank, peak microbatches stashed per stage (held from
    F until B, or until W with split backward) and peak stashed bytes under ``stash``.
    ``exchange``: charge the receives of messages two ranks send each other at once more.
    ``latency``: seconds a message travels from the end of its send before its receive can
    start (no rank is busy meanwhile), where a receive's cost is the rank's own work.

    Raises:
        ScheduleError: if the ranks deadlock (a receive whose send never comes).
    """
    cost = _cost_fn(costs)
    ptrs, clocks = [0] * len(schedule), [0.0] * len(schedule)
    done: dict[Action, float] = {}
    last_sent: dict[tuple[int, int], float] = {}
    timeline: list[Interval] = []
    owner = owners(schedule)
    while any(p < len(a) for p, a in zip(ptrs, schedule)):
        before = list(ptrs)
        for r, actions in enumerate(schedule):
            ptrs[r], clocks[r] = _advance(
                r, actions, ptrs[r], clocks[r], done, cost, timeline, exchange, last_sent, owner, latency
            )
        if ptrs == before:
            stuck = {r: str(schedule[r][p]) for r, p in enumerate(ptrs) if p < len(schedule[r])}
            raise ScheduleError(f"deadlock: ranks wait at {stuck}\n{grid(schedule)}")
    busy = [
        sum(i.end - i.start for i in timeline if i.rank == r and i.action.kind in COMPUTE_KINDS)
        for r in range(len(schedule))
    ]
    peaks = [int(_peak(a, _microbatch_delta)) for a in schedule]
    peak_bytes = [_peak(a, stash.delta) for a in schedule]
    return SimResult(max(clocks, default=0.0), busy, peaks, timeline, peak_bytes)


@dataclass(frozen=True)
class CompiledProgram:
    """A program compiled once for repeated makespans under different costs (the planner's hot loop).

    Only a receive waits: between two receives a rank runs its actions back to back, so the time
    a rank reaches any action is the end of its last receive before it plus a running sum of
    costs. The makespan then takes one step per receive, the receives listed in an order the
    simulator can run them (each after its rank's previous receive and after the receive that
    precedes its send on the sending rank). An action's cost depends only on its key,
    (stage, kind); ``keys`` holds the first action of each key.

    Attributes:
        ranks: ranks that run the program.
        keys: the first action of each key.
        key_of: each action's key, every rank's actions one after another.
        starts: where each rank's actions begin in ``key_of``, and (last) their total.
        receives: the receives' indices in ``key_of``, in run order.
        waits: per receive in run order, the position it waits for on its own rank (the action
            before it, -1 for none) and the last receive at or before that position (its index in
            run order and in ``key_of``, -1 for none); likewise for the send it takes in, and for
            its rank's last send to the same peer before it (for :class:`Exchange`).
        finish: per rank, its last action and the last receive at or before it, as in ``waits``.
        counts: actions of each key.
    """

    ranks: int
    keys: tuple[Action, ...]
    key_of: np.ndarray
    starts: np.ndarray
    receives: np.ndarray
    waits: tuple[np.ndarray, ...]
    finish: tuple[np.ndarray, ...]
    counts: tuple[int, ...] = ()

    def makespan(self, key_costs: list[float], exchange: Optional[Exchange] = None) -> float:
        """The same makespan :func:`simulate` finds when every action costs ``key_costs[key]``."""
        cost = np.asarray(key_costs, dtype=float)[self.key_of]
        ran = np.zeros(len(cost) + 1)  # ran[i]: a rank's costs up to action i; ran[-1] = 0 stands for none
        for a, b in zip(self.starts[:-1].tolist(), self.starts[1:].tolist()):
            ran[a:b] = np.cumsum(cost[a:b])
        own_at, own_order, own_flat, send_at, send_order, send_flat, mine_at, mine_order, mine_flat = self.waits
        own_gap, send_gap = (ran[own_at] - ran[own_flat]).tolist(), (ran[send_at] - ran[send_flat]).tolist()
        end = [0.0] * (len(self.receives) + 1)  # end[-1] = 0: no receive before
        columns = zip(own_order.tolist(), own_gap, send_order.tolist(), send_gap, cost[self.receives].tolist())
        if exchange is None:
            for k, (p, g, q, h, c) in enumerate(columns):
                ready, sent = end[p] + g, end[q] + h
                end[k] = (ready if ready > sent else sent) + c
        else:  # as above, and a receive that is part of an exchange costs more
            mine_gap = (ran[mine_at] - ran[mine_flat]).tolist()
            for k, ((p, g, q, h, c), o, x, at) in enumerate(
                zip(columns, mine_order.tolist(), mine_gap, mine_at.tolist())
            ):
                ready, sent = end[p] + g, end[q] + h
                extra = exchange.extra if exchange.applies(sent, end[o] + x if at >= 0 else None) else 0.0
                end[k] = (ready if ready > sent else sent) + c + extra
        last_at, last_order, last_flat = self.finish
        return max(
            (end[q] + g for q, g in zip(last_order.tolist(), (ran[last_at] - ran[last_flat]).tolist())), default=0.0
        )

    def busy(self, key_costs: list[float], kinds: frozenset[Kind] = COMPUTE_KINDS) -> float:
        """Seconds all ranks together spend in actions of ``kinds`` (compute, by default)."""
        return sum(n * c for n, c, a in zip(self.counts, key_costs, self.keys) if a.kind in kinds)

    def costs_from(self, cost: Callable[[Action], float]) -> list[float]:
        """``cost`` evaluated once per key."""
        return [cost(a) for a in self.keys]


def compile_program(schedule: list[list[Action]], flat: Optional[FlatProgram] = None) -> CompiledProgram:
    """Compile ``schedule`` for :meth:`CompiledProgram.makespan`: its receives in an order the
    simulator can run them, found as :func:`simulate` does (each rank advances until a receive
    whose send is not reached yet, round after round), on the arrays of ``flat`` (made here if
    not given; Action objects are slow to read).

    Raises:
        ScheduleError: if the ranks deadlock.
    """
    flat = flat or flatten(schedule)
    n, starts = len(flat.kind), flat.starts
    _, first, key_of = np.unique(flat.stage * len(CODES) + flat.kind, return_index=True, return_inverse=True)
    receives, last_receive = np.flatnonzero(flat.source >= 0), _last_receives(flat)
    receive_number = np.full(n + 1, -1)  # [-1]: none
    receive_number[receives] = np.arange(len(receives))
    own_at = np.where(receives > starts[flat.owner[receives]], receives - 1, -1)
    own_flat = np.where(own_at >= 0, last_receive[own_at], -1)
    send_at = flat.source[receives]
    send_flat = last_receive[send_at]
    mine_at = _last_sends_to_source(flat, receives)
    mine_flat = np.where(mine_at >= 0, last_receive[mine_at], -1)
    order, stuck = _receive_order(receive_number[send_flat].tolist(), np.searchsorted(receives, starts).tolist())
    if stuck:
        raise ScheduleError(
            f"deadlock: ranks wait at { {r: str(flat.actions[receives[k]]) for r, k in stuck.items()} }\n"
            f"{grid(schedule)}"
        )
    placed = np.full(len(receives) + 1, -1)  # [-1]: none
    placed[order] = np.arange(len(order))
    order = np.asarray(order, dtype=np.int64)
    numbered = lambda at: placed[receive_number[at]]  # noqa: E731  # a flat receive index (or -1) as its place in the order
    waits = (
        own_at[order],
        numbered(own_flat[order]),
        own_flat[order],
        send_at[order],
        numbered(send_flat[order]),
        send_flat[order],
        mine_at[order],
        numbered(mine_flat[order]),
        mine_flat[order],
    )
    last_at = starts[1:] - 1
    has = np.diff(starts) > 0
    last_flat = np.where(has, last_receive[np.where(has, last_at, 0)] if n else -1, -1)
    finish = (np.where(has, last_at, -1), numbered(last_flat), last_flat)
    counts = np.bincount(key_of, minlength=len(first)).tolist()
    return CompiledProgram(
        len(schedule),
        tuple(flat.actions[i] for i in first.tolist()),
        key_of,
        starts,
        receives[order],
        waits,
        finish,
        tuple(counts),
    )


def _last_receives(flat: FlatProgram) -> np.ndarray:
    """For each action, the last receive at or before it on its rank (its index), or -1."""
    if not len(flat.kind):
        return np.zeros(0, np.int64)
    last = np.maximum.accumulate(np.where(flat.source >= 0, np.arange(len(flat.kind)), -1))
    return np.where(last >= flat.starts[flat.owner], last, -1)


def _last_sends_to_source(flat: FlatProgram, receives: np.ndarray) -> np.ndarray:
    """For each receive, its rank's last send before it to the rank it receives from (its
    index), or -1."""
    n = len(flat.kind)
    sends = np.flatnonzero((flat.kind == SEND_ACT) | (flat.kind == SEND_GRAD))
    link = lambda at: (flat.owner[at] * flat.ranks + flat.peer[at]) * (n + 1) + at  # noqa: E731  # by link, then position
    keyed = link(sends)
    by_link = np.argsort(keyed, kind="stable")
    wanted = link(receives)
    found = np.searchsorted(keyed[by_link], wanted) - 1
    valid = found >= 0
    found = np.where(valid, found, 0)
    if not len(sends):
        return np.full(len(receives), -1)
    same = valid & (keyed[by_link][found] // (n + 1) == wanted // (n + 1))
    return np.where(same, sends[by_link][found], -1)


def _receive_order(sender: list[int], bounds: list[int]) -> tuple[list[int], dict[int, int]]:
    """Receives (numbered rank after rank; ``bounds``: where each rank's begin) in an order the
    simulator can run them: a rank runs on until a receive whose send follows a receive not run
    yet (``sender``: that receive's number, -1 for none), round after round. Also each rank
    left waiting, at the number of its receive (none unless the program deadlocks)."""
    placed = [False] * len(sender)
    order: list[int] = []
    ptrs, moved = bounds[:-1], True
    while moved:
        moved = False
        for rank, end in enumerate(bounds[1:]):
            p = ptrs[rank]
            while p < end:
                q = sender[p]
                if q >= 0 and not placed[q]:
                    break
                placed[p] = True
                order.append(p)
                p += 1
            moved |= p != ptrs[rank]
            ptrs[rank] = p
    return order, {r: p for r, (p, end) in enumerate(zip(ptrs, bounds[1:])) if p < end}


@dataclass(frozen=True)
class SharedCores:
    """Ranks of one host that compute on the cores they share (processor sharing).

    While ``b`` ranks of the host compute at once, each computes ``max(1, b / cores)`` times
    slower than alone: the host's scheduler shares its cores evenly, and ranks waiting on a
    message take none of them.

    Args:
        cores: the host's effective cores: its ranks over the slowdown measured while all of them
            compute at once (below the physical cores where memory bandwidth or another process
            takes a share).
        copies: ranks that run each program rank's actions at the same moments (the data-parallel
            replicas of a stage, which run the same program in step).
    """

    cores: float
    copies: int = 1

    def slowdown(self, busy: int) -> float:
        """How many times slower than alone a rank computes while ``busy`` program ranks compute."""
        return max(1.0, busy * self.copies / self.cores)


def shared_run(
    flat: FlatProgram,
    cost: Sequence[float],
    cpu: Sequence[bool],
    sharing: SharedCores,
    exchange: Optional[Exchange] = None,
    latency: float = 0.0,
) -> tuple[float, list[float], list[float]]:
    """:func:`simulate` with the ranks' compute sharing the host's cores (:class:`SharedCores`).

    ``cost[i]``: seconds of action ``i`` of ``flat`` run alone; ``cpu[i]``: whether it computes
    (and so shares the cores; others take their seconds whatever the load). Time advances from
    one event to the next (an action ends, a message arrives); between two events every
    computing rank progresses at ``1 / slowdown(ranks computing)``.

    Returns:
        The makespan, and each action's start and end.

    Raises:
        ScheduleError: if the ranks deadlock.
    """
    source, peer, kinds = flat.source.tolist(), flat.peer.tolist(), flat.kind.tolist()
    bounds = flat.starts.tolist()
    ranks, n = len(bounds) - 1, len(source)
    ptr, ends = bounds[:-1], bounds[1:]
    start, end = [0.0] * n, [-1.0] * n
    left, running = [0.0] * ranks, [False] * ranks
    last_sent: dict[tuple[int, int], float] = {}
    sends = {CODES[Kind.SEND_ACT], CODES[Kind.SEND_GRAD]}
    now = 0.0

    def finish(r: int) -> None:
        i = ptr[r]
        end[i], running[r] = now, False
        if kinds[i] in sends:
            last_sent[r, peer[i]] = now
        ptr[r] += 1

    while True:
        arrivals, moved = [], True
        while moved:  # start every action that can start now; free ones end at once
            moved = False
            for r in range(ranks):
                while not running[r] and ptr[r] < ends[r]:
                    i, s = ptr[r], source[ptr[r]]
                    if s >= 0 and end[s] < 0:
                        break
                    if s >= 0 and end[s] + latency > now + 1e-12:
                        arrivals.append(end[s] + latency)
                        break
                    extra = (
                        exchange.extra
                        if s >= 0 and exchange and exchange.applies(end[s], last_sent.get((r, peer[i])))
                        else 0.0
                    )
                    start[i], left[r] = now, cost[i] + extra
                    running[r] = True
                    if left[r] <= 0:
                        finish(r)
                        moved = True
        active = [r for r in range(ranks) if running[r]]
        if not active and not arrivals:
            break
        rate = 1.0 / sharing.slowdown(sum(1 for r in active if cpu[ptr[r]]))
        speed = {r: rate if cpu[ptr[r]] else 1.0 for r in active}
        step = min([left[r] / speed[r] for r in active] + [a - now for a in arrivals])
        now += step
        for r in active:
            left[r] -= step * speed[r]
            if left[r] <= 1e-12 * max(1.0, cost[ptr[r]]):
                finish(r)
    if any(p < e for p, e in zip(ptr, ends)):
        stuck = {r: str(flat.actions[p]) for r, (p, e) in enumerate(zip(ptr, ends)) if p < e}
        raise ScheduleError(f"deadlock: ranks wait at {stuck}")
    return max(end, default=0.0), start, end
