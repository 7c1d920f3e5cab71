"""Pipeline actions: what one rank does next, with a text form that round-trips."""

from __future__ import annotations

import re
from dataclasses import dataclass
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
#: Kinds that act on the whole batch rather than on one microbatch.
BATCH_KINDS = frozenset({Kind.ALL_REDUCE, Kind.OPTIMIZER_STEP})

_CODES = "|".join(sorted((k.value for k in Kind), key=len, reverse=True))
_PATTERN = re.compile(rf"^(\d+)({_CODES})(\d*)$")


@dataclass(frozen=True)
class Action:
    """One step of a rank's schedule, e.g. ``1F3``: stage 1 runs the forward of microbatch 3.

    Args:
        stage: pipeline stage index that runs the action.
        kind: what the action does.
        microbatch: microbatch index, or ``None`` for whole-batch actions (all-reduce, step).
            ``VERSION`` (2BW's weight-version switch) names the first microbatch of the batch
            whose forwards follow it.
    """

    stage: int
    kind: Kind
    microbatch: Optional[int] = None

    def __post_init__(self) -> None:
        if (self.microbatch is None) != (self.kind in BATCH_KINDS):
            raise ValueError(f"{self.kind.name} {'takes no' if self.kind in BATCH_KINDS else 'needs a'} microbatch")

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


def format_actions(actions: list[Action]) -> str:
    """Write a rank's action list as space-separated text."""
    return " ".join(str(a) for a in actions)


def parse_actions(text: str) -> list[Action]:
    """Parse the text written by :func:`format_actions`."""
    return [Action.parse(tok) for tok in text.split()]
