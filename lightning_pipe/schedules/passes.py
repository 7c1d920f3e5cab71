"""Pure lowering passes that turn compute actions into a full per-rank program."""

from __future__ import annotations

from functools import lru_cache, partial
from typing import Optional, Sequence

from lightning_pipe.schedules import interleaved, two_bw
from lightning_pipe.schedules.actions import RECEIVE_KINDS, Action, Kind, ScheduleError, action
from lightning_pipe.schedules.generators import forward_only
from lightning_pipe.schedules.layout import owners, stage_ranks
from lightning_pipe.schedules.registry import flushed_generator, get
from lightning_pipe.schedules.v_shape import join_backward
from lightning_pipe.schedules.w_placement import carry_split, split_backward

Schedule = list[list[Action]]

# For each compute kind: (kind to insert before it, kind to insert after it), and whether the
# "before" half needs a previous stage (True) or a next stage (False).
_COMM: dict[Kind, tuple[Kind, Kind, bool]] = {
    Kind.FORWARD: (Kind.RECV_ACT, Kind.SEND_ACT, True),
    Kind.BACKWARD: (Kind.RECV_GRAD, Kind.SEND_GRAD, False),
    Kind.INPUT_GRAD: (Kind.RECV_GRAD, Kind.SEND_GRAD, False),
}


def add_communication(actions: list[Action], stages: int, ranks: Optional[Sequence[int]] = None) -> list[Action]:
    """Insert receives before and (non-blocking) sends after each F and B of a ``stages``-stage chain.

    ``ranks``: the rank of each stage (default: each its own). Two neighbouring stages on one
    rank (the V placement's turn, ``schedules/layout.py``) exchange nothing: the later stage's F
    reads the earlier's output and the earlier's backward the later's input gradient, on the
    rank itself, so the program must run them in that order (:func:`~.verify.verify` checks it).
    """
    local = (
        set()
        if ranks is None
        else {s for s in range(stages - 1) if ranks[s] == ranks[s + 1]}  # s and s + 1 share a rank
    )
    out: list[Action] = []
    for a in actions:  # one loop, no call per action: the planner lowers millions of them
        comm = _COMM.get(a.kind)
        if comm is None:
            out.append(a)
            continue
        before, after, before_needs_prev = comm
        has_prev = a.stage > 0 and a.stage - 1 not in local
        has_next = a.stage < stages - 1 and a.stage not in local
        if has_prev if before_needs_prev else has_next:
            out.append(action(a.stage, before, a.microbatch))
        out.append(a)
        if has_next if before_needs_prev else has_prev:
            out.append(action(a.stage, after, a.microbatch))
    return out


#: What each send delivers: the receive it matches, on the stage ``offset`` away.
DELIVERS: dict[Kind, tuple[Kind, int]] = {Kind.SEND_ACT: (Kind.RECV_ACT, +1), Kind.SEND_GRAD: (Kind.RECV_GRAD, -1)}


def receive_order(schedule: Schedule, rank: int) -> dict[int, list[Action]]:
    """Pipeline rank ``rank``'s receives from each rank (by index in ``schedule``), in the order
    that rank sends them: messages between two ranks arrive in the order they were sent, which
    is not the order the receiver reads them when one rank sends another both activations and
    gradients (interleaved 1F1B at ``d = 2``)."""
    owner = owners(schedule)
    order: dict[int, list[Action]] = {}
    for sender, actions in enumerate(schedule):
        for a in actions:
            if a.kind in DELIVERS:
                kind, offset = DELIVERS[a.kind]
                if owner.get(a.stage + offset) == rank:
                    order.setdefault(sender, []).append(action(a.stage + offset, kind, a.microbatch))
    return order


def add_optimizer(actions: list[Action], stage: int) -> list[Action]:
    """Append the flush: gradient all-reduce across stage replicas, then the optimizer step."""
    return actions + [action(stage, Kind.ALL_REDUCE), action(stage, Kind.OPTIMIZER_STEP)]


def build_schedule(
    name: str,
    depth: int,
    microbatches: int,
    split: bool = False,
    max_pending: Optional[int] = None,
    virtual: int = 1,
    placement: Optional[str] = None,
    stage_placement: Optional[str] = None,
) -> Schedule:
    """Full training program of every rank: compute, communication and the optimizer flush.

    Args:
        name: a flushed schedule of the registry (``schedules/registry.py``).
        depth: pipeline ranks ``d``.
        microbatches: microbatches ``m``.
        split: split each backward into I and W (2BP, see schedules/w_placement.py).
        max_pending: with ``split``, most microbatches that may wait for their W.
        virtual: stages per rank ``v``; above 1, the schedule's rank generator over ``d * v``
            stages (interleaved 1F1B for ``"1f1b"``, schedules/interleaved.py).
        placement: with ``split``, where the W's go (schedules/w_placement.py); default the
            schedule's own (:attr:`~lightning_pipe.schedules.registry.ScheduleSpec.w_placement`).
        stage_placement: which rank runs which stage (``"loop"`` or ``"v"``,
            schedules/layout.py); default the schedule's own.
    """
    spec = get(name)
    if spec.streams:
        flushed_generator(name)  # raises: a stream is built window by window
    spec.check(depth, microbatches, virtual, stage_placement)
    shape = spec.placement(virtual, stage_placement)
    if virtual == 1 and spec.generator is not None:
        generator = flushed_generator(name)
    else:
        assert spec.rank_generator is not None, f"schedule {name!r} has no rank generator"
        generator = partial(spec.rank_generator, virtual=virtual, placement=shape)
    ranks = stage_ranks(depth, virtual, shape)
    programs = []
    for r in range(depth):
        compute = generator(r, depth, microbatches)
        if spec.splits_itself:
            compute = compute if split else join_backward(compute)
        elif split:
            compute = split_backward(compute, placement or spec.w_placement, max_pending)
        programs.append(add_optimizer(add_communication(compute, depth * virtual, ranks), r))
    return programs


def build_inference(depth: int, microbatches: int, virtual: int = 1, stage_placement: str = "loop") -> Schedule:
    """Forward-only program of every rank (validation, test, predict); with ``virtual`` stages
    per rank, the forwards in interleaved 1F1B's order (loop placement, ``m`` a multiple of
    ``d``) or each stage's in turn (looped BFS's, any placement and ``m``)."""
    if virtual > 1:
        ranks = stage_ranks(depth, virtual, stage_placement)
        rounds = stage_placement == "loop" and microbatches % depth == 0  # interleaved 1F1B's rounds of d
        order = interleaved.forwards if rounds else _bfs_forwards(stage_placement)
        return [add_communication(order(r, depth, microbatches, virtual), depth * virtual, ranks) for r in range(depth)]
    return [add_communication(forward_only(s, depth, microbatches), depth) for s in range(depth)]


def _bfs_forwards(stage_placement: str):
    """Looped BFS's forwards under ``stage_placement`` (``(rank, depth, m, v)`` -> actions)."""

    def order(rank: int, depth: int, microbatches: int, virtual: int) -> list[Action]:
        program = interleaved.looped_bfs(rank, depth, microbatches, virtual, stage_placement)
        return [a for a in program if a.kind is Kind.FORWARD]

    return order


def _split_2bw(
    part: list[Action], before: list[Action], microbatches: int, steps_before: int, split: bool
) -> list[Action]:
    """``part`` of a rank's 2BW stream (one stage's, or an interleaved rank's), split by the
    ``"carry"`` placement (schedules/w_placement.py): the W's carried from the part ``before`` it
    (the previous window, after ``steps_before`` optimizer steps) run in this one."""
    return carry_split([before, part], microbatches, steps_before)[1] if split else part


def _rank_window(
    rank: int, depth: int, microbatches: int, step: int, early: bool, virtual: int, placement: str
) -> list[Action]:
    """2BW: rank ``rank``'s compute actions of window ``step`` (interleaved under ``placement``
    with ``virtual > 1``)."""
    if virtual == 1:
        return two_bw.window(rank, depth, microbatches, step, early)
    if placement == "v":
        return two_bw.v_window(rank, depth, microbatches, step, early)
    return two_bw.rank_window(rank, depth, microbatches, step, virtual, early)


def _rank_drain(rank: int, depth: int, microbatches: int, last_step: int, virtual: int, placement: str) -> list[Action]:
    """2BW: rank ``rank``'s compute actions of the drain after ``last_step`` (interleaved under
    ``placement`` with ``virtual > 1``)."""
    if virtual == 1:
        return two_bw.drain(rank, depth, microbatches, last_step)
    if placement == "v":
        return two_bw.v_drain(rank, depth, microbatches, last_step)
    return two_bw.rank_drain(rank, depth, microbatches, last_step, virtual)


def two_bw_stage_window(
    stage: int,
    depth: int,
    microbatches: int,
    step: int,
    split: bool = False,
    early: bool = True,
    virtual: int = 1,
    placement: str = "loop",
) -> list[Action]:
    """Stage ``stage``'s full 2BW program for training step ``step`` (its list in
    :func:`two_bw_window`; a rank builds only its own each step); ``early``: stage 0 steps right
    after its all-reduce (see schedules/two_bw.py). With ``virtual > 1``, pipeline rank
    ``stage``'s interleaved 2BW program over the stages ``placement`` gives it (``"loop"`` or
    ``"v"``, schedules/layout.py)."""
    window = partial(_rank_window, stage, depth, microbatches, early=early, virtual=virtual, placement=placement)
    before = window(step - 1) if split and step else []
    part = _split_2bw(window(step), before, microbatches, max(step - 2, 0), split)
    return add_communication(part, depth * virtual, stage_ranks(depth, virtual, placement))


def two_bw_window(
    depth: int,
    microbatches: int,
    step: int,
    split: bool = False,
    early: bool = True,
    virtual: int = 1,
    placement: str = "loop",
) -> Schedule:
    """Full 2BW program of every rank for training step ``step`` (:func:`two_bw_stage_window`)."""
    return [two_bw_stage_window(s, depth, microbatches, step, split, early, virtual, placement) for s in range(depth)]


def two_bw_stage_drain(
    stage: int,
    depth: int,
    microbatches: int,
    last_step: int,
    split: bool = False,
    early: bool = True,
    virtual: int = 1,
    placement: str = "loop",
) -> list[Action]:
    """Stage ``stage``'s full 2BW program that finishes the stream after ``last_step`` (its list in
    :func:`two_bw_drain`); with ``virtual > 1``, pipeline rank ``stage``'s over the stages
    ``placement`` gives it."""
    before = _rank_window(stage, depth, microbatches, last_step, early, virtual, placement) if split else []
    drain = _rank_drain(stage, depth, microbatches, last_step, virtual, placement)
    part = _split_2bw(drain, before, microbatches, max(last_step - 1, 0), split)
    return add_communication(part, depth * virtual, stage_ranks(depth, virtual, placement))


def two_bw_drain(
    depth: int,
    microbatches: int,
    last_step: int,
    split: bool = False,
    early: bool = True,
    virtual: int = 1,
    placement: str = "loop",
) -> Schedule:
    """Full 2BW program of every rank that finishes the stream after ``last_step`` (:func:`two_bw_stage_drain`)."""
    return [
        two_bw_stage_drain(s, depth, microbatches, last_step, split, early, virtual, placement) for s in range(depth)
    ]


@lru_cache(maxsize=256)
def check_two_bw_split(depth: int, microbatches: int, virtual: int, placement: str) -> None:
    """Raise a clear ``ValueError`` unless interleaved 2BW with split backward runs ``(depth,
    microbatches)`` at ``virtual`` stages per rank placed by ``placement``: the carry placement
    holds a rank's all-reduce until no W of its batch waits, which can put it after a receive
    whose sender first steps, and that step waits for the global norm, which needs the all-reduce
    (:func:`~lightning_pipe.schedules.verify.check_global_norm`, over two windows and the drain)."""
    from lightning_pipe.schedules.verify import check_global_norm

    try:
        check_global_norm(two_bw_run(depth, microbatches, 2, True, True, virtual, placement))
    except ScheduleError as err:
        raise ValueError(
            f"2BW with split_backward=True at pipeline_depth={depth}, microbatches={microbatches}, "
            f"virtual_stages={virtual}, placement={placement!r} would deadlock ({err}): use "
            "split_backward=False, or another placement or number of microbatches"
        ) from None


def two_bw_run(
    depth: int,
    microbatches: int,
    steps: int,
    split: bool = False,
    early: bool = True,
    virtual: int = 1,
    placement: str = "loop",
) -> Schedule:
    """``steps`` consecutive 2BW windows and the drain, concatenated per rank (for checks)."""
    parts = [two_bw_window(depth, microbatches, t, split, early, virtual, placement) for t in range(steps)]
    parts.append(two_bw_drain(depth, microbatches, steps - 1, split, early, virtual, placement))
    return [[a for part in parts for a in part[s]] for s in range(depth)]


#: Windows on either side of a 2BW window whose sends may reach it: a neighbour's window runs at
#: most this many windows ahead of or behind this rank's (checked over whole runs in tests/test_two_bw.py).
_REACH = 2


def two_bw_arrivals(
    rank: int,
    depth: int,
    microbatches: int,
    step: int,
    drain: bool = False,
    early: bool = True,
    virtual: int = 1,
    placement: str = "loop",
) -> dict[int, list[Action]]:
    """Pipeline rank ``rank``'s receives in its 2BW window ``step`` (or, ``drain``, in the drain
    after it), per source rank in the order that rank sends them (:func:`receive_order` over the
    stream around the window). Interleaved 2BW at ``d = 2`` needs it: there two ranks send each
    other activations and gradients, which arrive in the sender's order, not the reader's.

    The stream repeats itself, shifted by ``m`` microbatches a window, from its second window on:
    the order is found once per ``(rank, window or drain)`` and shifted."""
    base = min(step, _REACH + 1)
    shift = (step - base) * microbatches
    order = _arrivals(rank, depth, microbatches, base, drain, early, virtual, placement)
    if not shift:
        return {src: list(keys) for src, keys in order.items()}
    return {src: [action(a.stage, a.kind, a.microbatch + shift) for a in keys] for src, keys in order.items()}


@lru_cache(maxsize=256)
def _arrivals(
    rank: int, depth: int, microbatches: int, step: int, drain: bool, early: bool, virtual: int, placement: str
) -> dict[int, tuple[Action, ...]]:
    first, last = max(step - _REACH, 0), step + (0 if drain else _REACH)
    parts = [two_bw_window(depth, microbatches, t, False, early, virtual, placement) for t in range(first, last + 1)]
    if drain:
        parts.append(two_bw_drain(depth, microbatches, step, False, early, virtual, placement))
    stream = [[a for part in parts for a in part[r]] for r in range(depth)]
    own = parts[-1][rank] if drain else parts[step - first][rank]
    mine = {a for a in own if a.kind in RECEIVE_KINDS}
    return {src: tuple(a for a in keys if a in mine) for src, keys in receive_order(stream, rank).items()}
