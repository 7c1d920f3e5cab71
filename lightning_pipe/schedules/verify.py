"""Checks that a schedule is complete, ordered and deadlock-free before any process runs it."""

from __future__ import annotations

from collections import Counter

from lightning_pipe.schedules.actions import COMPUTE_KINDS, Action, Kind
from lightning_pipe.schedules.layout import rank_stages
from lightning_pipe.schedules.simulate import ScheduleError, grid, simulate, unit_costs


def _kinds(counts: Counter, microbatch: int, train: bool) -> tuple[Kind, ...]:
    """What a stage must run for ``microbatch``: F, then B or (split backward) I and W. A
    program may split some backwards and not others (split_backward's "drain" placement)."""
    if not train:
        return (Kind.FORWARD,)
    split = counts[(Kind.INPUT_GRAD, microbatch)] or counts[(Kind.WEIGHT_GRAD, microbatch)]
    return (Kind.FORWARD, Kind.INPUT_GRAD, Kind.WEIGHT_GRAD) if split else (Kind.FORWARD, Kind.BACKWARD)


def _check_rank(
    rank: int, actions: list[Action], microbatches: int, train: bool, depth: int, virtual: int, placement: str
) -> None:
    mine = rank_stages(rank, depth, virtual, placement)
    wrong = [str(a) for a in actions if a.stage not in mine]
    if wrong:
        raise ScheduleError(f"rank {rank} holds actions of stages it does not run: {wrong}")
    for stage in mine:
        _check_stage(stage, [a for a in actions if a.stage == stage], microbatches, train)
    for stage in (s for s in mine if s + 1 in mine):
        _check_handoff(stage, actions, microbatches, train)


def _check_handoff(stage: int, actions: list[Action], microbatches: int, train: bool) -> None:
    """Two neighbouring stages on one rank exchange no message (passes.add_communication): the
    later stage's F must follow the earlier's, and the earlier's backward the later's."""
    position = {(a.stage, a.kind, a.microbatch): i for i, a in enumerate(actions)}

    def backward(s: int, k: int) -> int:
        return position.get((s, Kind.BACKWARD, k), position.get((s, Kind.INPUT_GRAD, k), -1))

    for k in range(microbatches):
        if position[(stage + 1, Kind.FORWARD, k)] < position[(stage, Kind.FORWARD, k)]:
            raise ScheduleError(f"stage {stage + 1} runs F{k} before stage {stage}, on the same rank")
        if train and backward(stage, k) < backward(stage + 1, k):
            raise ScheduleError(f"stage {stage} runs the backward of {k} before stage {stage + 1}, on the same rank")


def _check_stage(stage: int, actions: list[Action], microbatches: int, train: bool) -> None:
    counts = Counter((a.kind, a.microbatch) for a in actions if a.kind in COMPUTE_KINDS)
    position = {(a.kind, a.microbatch): i for i, a in enumerate(actions)}
    for k in range(microbatches):
        kinds = _kinds(counts, k, train)
        for kind in COMPUTE_KINDS:
            expected = int(kind in kinds)
            if counts[(kind, k)] != expected:
                raise ScheduleError(f"stage {stage} runs {kind.name} of microbatch {k} {counts[(kind, k)]} times")
        for before, after in zip(kinds, kinds[1:]):
            if position[(after, k)] < position[(before, k)]:
                raise ScheduleError(f"stage {stage} runs {after.value} before {before.value} for microbatches {[k]}")


def verify(
    schedule: list[list[Action]], microbatches: int, train: bool = True, virtual: int = 1, placement: str = "loop"
) -> None:
    """Raise :class:`ScheduleError` unless every stage runs each F (and B, or I and W) once,
    in that order, and the whole program runs to completion without deadlock.

    ``schedule[r]`` is pipeline rank ``r``'s program; with ``virtual`` stages per rank it runs
    the stages ``placement`` gives it (``schedules/layout.py``: ``r, r + d, ...`` under
    ``"loop"``, ``r`` and ``2d - 1 - r`` under ``"v"``; ``d = len(schedule)``)."""
    try:
        for rank, actions in enumerate(schedule):
            _check_rank(rank, actions, microbatches, train, len(schedule), virtual, placement)
    except ScheduleError as err:
        raise ScheduleError(f"{err}\n{grid(schedule)}") from None
    simulate(schedule, unit_costs())


def check_global_norm(schedule: list[list[Action]]) -> None:
    """Raise :class:`ScheduleError` if the ranks deadlock once each optimizer step waits for the
    global gradient norm: a rank's ``j``-th OPT reads every rank's ``j``-th ALL_REDUCE (the
    clipping norm joins every stage, ``runtime/update.py``), beside the pipeline's own waits (a
    stage's forward of a microbatch needs the previous stage's, its backward or I the next
    stage's). The simulator leaves that collective out: this walk adds it."""
    last = max((a.stage for actions in schedule for a in actions if a.stage is not None), default=0)
    done: set[tuple[int, str, int]] = set()
    ptr, reduced, stepped = [0] * len(schedule), [0] * len(schedule), [0] * len(schedule)

    def ready(r: int, a: Action) -> bool:
        if a.kind is Kind.FORWARD:
            return a.stage == 0 or (a.stage - 1, "F", a.microbatch) in done
        if a.kind in (Kind.BACKWARD, Kind.INPUT_GRAD):
            return a.stage == last or (a.stage + 1, "B", a.microbatch) in done
        if a.kind is Kind.OPTIMIZER_STEP:
            return all(n > stepped[r] for n in reduced)
        return True

    moved = True
    while moved:
        moved = False
        for r, actions in enumerate(schedule):
            while ptr[r] < len(actions) and ready(r, actions[ptr[r]]):
                a = actions[ptr[r]]
                if a.kind is Kind.FORWARD:
                    done.add((a.stage, "F", a.microbatch))
                elif a.kind in (Kind.BACKWARD, Kind.INPUT_GRAD):
                    done.add((a.stage, "B", a.microbatch))
                reduced[r] += a.kind is Kind.ALL_REDUCE
                stepped[r] += a.kind is Kind.OPTIMIZER_STEP
                ptr[r], moved = ptr[r] + 1, True
    stuck = {r: str(actions[p]) for r, (p, actions) in enumerate(zip(ptr, schedule)) if p < len(actions)}
    if stuck:
        raise ScheduleError(f"deadlock at the global gradient norm: ranks wait at {stuck}")
