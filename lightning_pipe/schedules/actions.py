"""Pipeline actions: what one rank does next, with a text form that round-trips."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Optional


class Kind(str, Enum):
    """The kinds of action a rank can run; the value is the code used in the text form."""

    FORWARD = "F"
    BACKWARD = "B"
    SEND_ACT = "SF"
    RECV_ACT = "RF"
    SEND_GRAD = "SB"
    RECV_GRAD = "RB"
    ALL_REDUCE = "AR"
    OPTIMIZER_STEP = "OPT"
    VERSION = "V"
    INPUT_GRAD = "I"
    WEIGHT_GRAD = "W"


#: Kinds that do model compute (the simulator charges them a cost).
COMPUTE_KINDS = frozenset({Kind.FORWARD, Kind.BACKWARD, Kind.INPUT_GRAD, Kind.WEIGHT_GRAD})
#: Kinds that post a message to another rank.
SEND_KINDS = frozenset({Kind.SEND_ACT, Kind.SEND_GRAD})
#: Kinds that take a message in from another rank.
RECEIVE_KINDS = frozenset({Kind.RECV_ACT, Kind.RECV_GRAD})
#: Kinds that move a message between ranks.
MESSAGE_KINDS = SEND_KINDS | RECEIVE_KINDS
#: Kinds that act on the whole batch rather than on one microbatch.
BATCH_KINDS = frozenset({Kind.ALL_REDUCE, Kind.OPTIMIZER_STEP})

#: Each kind's number in :attr:`Action.packed`.
KIND_NUMBERS: dict[Kind, int] = {kind: n for n, kind in enumerate(Kind)}
#: Microbatch numbers (plus one: 0 stands for none) a packed action has room for.
MICROBATCH_SPAN = 1 << 32

_CODES = "|".join(sorted((k.value for k in Kind), key=len, reverse=True))
_PATTERN = re.compile(rf"^(\d+)({_CODES})(\d*)$")


class ScheduleError(ValueError):
    """A schedule that cannot run: deadlock, missing or duplicated work, wrong order."""


@dataclass(frozen=True, slots=True)  # slots: a planner's search holds most of a million
class Action:
    """One step of a rank's schedule, e.g. ``1F3``: stage 1 runs the forward of microbatch 3.

    Args:
        stage: pipeline stage index that runs the action.
        kind: what the action does.
        microbatch: microbatch index, or ``None`` for whole-batch actions (all-reduce, step).
            ``VERSION`` (2BW's weight-version switch) names the first microbatch of the batch
            whose forwards follow it.

    Attributes:
        packed: the action as one integer, ``(stage * len(Kind) + kind number) * MICROBATCH_SPAN
            + microbatch + 1`` (0 for none): long programs are read as arrays of it
            (:mod:`lightning_pipe.schedules.flat`).
    """

    stage: int
    kind: Kind
    microbatch: Optional[int] = None
    packed: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if (self.microbatch is None) != (self.kind in BATCH_KINDS):
            raise ValueError(f"{self.kind.name} {'takes no' if self.kind in BATCH_KINDS else 'needs a'} microbatch")
        if not 0 <= (self.microbatch or 0) < MICROBATCH_SPAN - 1:
            raise ValueError(f"microbatch {self.microbatch} out of range")
        number = (self.stage * len(KIND_NUMBERS) + KIND_NUMBERS[self.kind]) * MICROBATCH_SPAN
        object.__setattr__(self, "packed", number + (0 if self.microbatch is None else self.microbatch + 1))

    def __str__(self) -> str:
        mb = "" if self.microbatch is None else str(self.microbatch)
        return f"{self.stage}{self.kind.value}{mb}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        """Parse the text form written by ``str(action)``."""
        match = _PATTERN.match(text.strip())
        if match is None:
            raise ValueError(f"not an action: {text!r} (expected e.g. '1F3', '0SB2', '2OPT')")
        stage, code, mb = match.groups()
        return cls(int(stage), Kind(code), int(mb) if mb else None)


#: Every action :func:`action` made, shared: schedules for long pipelines repeat the same few
#: hundred thousand actions millions of times, and building one costs four lookups of a shared one.
_MADE: dict[tuple[int, Kind, Optional[int]], Action] = {}
_MADE_LIMIT = 1 << 20


def action(stage: int, kind: Kind, microbatch: Optional[int] = None) -> Action:
    """``Action(stage, kind, microbatch)``, the same object as every equal one made before
    (actions are frozen values; the table is cleared past a million entries)."""
    key = (stage, kind, microbatch)
    made = _MADE.get(key)
    if made is None:
        if len(_MADE) >= _MADE_LIMIT:
            _MADE.clear()
        made = _MADE[key] = Action(stage, kind, microbatch)
    return made


def format_actions(actions: list[Action]) -> str:
    """Write a rank's action list as space-separated text."""
    return " ".join(str(a) for a in actions)


def parse_actions(text: str) -> list[Action]:
    """Parse the text written by :func:`format_actions`."""
    return [Action.parse(tok) for tok in text.split()]
