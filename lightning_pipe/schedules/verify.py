"""Checks that a schedule is complete, ordered and deadlock-free before any process runs it."""

from __future__ import annotations

from collections import Counter

from lightning_pipe.schedules.actions import Action, Kind
from lightning_pipe.simulate import ScheduleError, grid, simulate, unit_costs


def _check_stage(stage: int, actions: list[Action], microbatches: int, train: bool) -> None:
    wrong = [str(a) for a in actions if a.stage != stage]
    if wrong:
        raise ScheduleError(f"rank {stage} holds actions of other stages: {wrong}")
    counts = Counter((a.kind, a.microbatch) for a in actions if a.kind in (Kind.FORWARD, Kind.BACKWARD))
    kinds = (Kind.FORWARD, Kind.BACKWARD) if train else (Kind.FORWARD,)
    for kind in kinds:
        for k in range(microbatches):
            if counts[(kind, k)] != 1:
                raise ScheduleError(f"stage {stage} runs {kind.name} of microbatch {k} {counts[(kind, k)]} times")
    position = {(a.kind, a.microbatch): i for i, a in enumerate(actions)}
    late = [k for k in range(microbatches) if train and position[(Kind.BACKWARD, k)] < position[(Kind.FORWARD, k)]]
    if late:
        raise ScheduleError(f"stage {stage} runs B before F for microbatches {late}")


def verify(schedule: list[list[Action]], microbatches: int, train: bool = True) -> None:
    """Raise :class:`ScheduleError` unless every stage runs each F (and B) once, F before B,
    and the whole program runs to completion without deadlock."""
    try:
        for stage, actions in enumerate(schedule):
            _check_stage(stage, actions, microbatches, train)
    except ScheduleError as err:
        raise ScheduleError(f"{err}\n{grid(schedule)}") from None
    simulate(schedule, unit_costs())
