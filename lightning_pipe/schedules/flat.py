"""A program as integer arrays, its messages matched: what the planner's analyses of long programs read."""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from operator import attrgetter
from typing import Sequence

import numpy as np

from lightning_pipe.schedules.actions import KIND_NUMBERS, MICROBATCH_SPAN, Action, Kind, ScheduleError

#: Each kind's integer code in :attr:`FlatProgram.kind`.
CODES = KIND_NUMBERS
SEND_ACT, SEND_GRAD, RECV_ACT, RECV_GRAD = (
    CODES[k] for k in (Kind.SEND_ACT, Kind.SEND_GRAD, Kind.RECV_ACT, Kind.RECV_GRAD)
)
FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD = (
    CODES[k] for k in (Kind.FORWARD, Kind.BACKWARD, Kind.INPUT_GRAD, Kind.WEIGHT_GRAD)
)


@dataclass(frozen=True)
class FlatProgram:
    """Every rank's actions one after another, as arrays of one entry per action.

    Attributes:
        actions: the actions, rank 0's first.
        starts: where each rank's actions begin in them, and (last) their total.
        kind: each action's :data:`CODES` entry.
        stage: each action's stage.
        microbatch: each action's microbatch, -1 for whole-batch actions.
        source: for a receive, the index of the send it takes in; -1 for any other action.
        peer: for a send or a receive, the other rank; -1 for any other action.
        message: for a send or a receive, the message's number among those its sender sends
            its receiver, in send order; -1 for any other action.
    """

    actions: list[Action]
    starts: np.ndarray
    kind: np.ndarray
    stage: np.ndarray
    microbatch: np.ndarray
    source: np.ndarray
    peer: np.ndarray
    message: np.ndarray

    @property
    def ranks(self) -> int:
        """How many ranks run the program."""
        return len(self.starts) - 1

    @functools.cached_property
    def owner(self) -> np.ndarray:
        """Each action's rank."""
        return np.repeat(np.arange(self.ranks), np.diff(self.starts))

    def rank(self, r: int) -> slice:
        """Where rank ``r``'s actions lie in the arrays."""
        return slice(int(self.starts[r]), int(self.starts[r + 1]))


def flatten(program: Sequence[Sequence[Action]]) -> FlatProgram:
    """``program`` (one action list per rank) as a :class:`FlatProgram`.

    Raises:
        ScheduleError: if a receive has no send, or a message is sent twice.
    """
    actions = list(itertools.chain.from_iterable(program))
    n, ranks = len(actions), len(program)
    starts = np.cumsum([0] + [len(a) for a in program])
    stage_kind, microbatch = np.divmod(np.fromiter(map(attrgetter("packed"), actions), np.int64, n), MICROBATCH_SPAN)
    stage, kind = np.divmod(stage_kind, len(CODES))
    microbatch -= 1
    rank = np.repeat(np.arange(ranks), np.diff(starts))
    sends = np.flatnonzero((kind == SEND_ACT) | (kind == SEND_GRAD))
    receives = np.flatnonzero((kind == RECV_ACT) | (kind == RECV_GRAD))
    # A message's key: the receiving stage, whether it is a gradient, its microbatch.
    span, grad = int(microbatch.max(initial=0)) + 1, kind[sends] == SEND_GRAD
    to_stage = stage[sends] + np.where(grad, -1, 1)
    sent_keys = (to_stage * 2 + grad) * span + microbatch[sends]
    received_keys = (stage[receives] * 2 + (kind[receives] == RECV_GRAD)) * span + microbatch[receives]
    by_key = np.argsort(sent_keys, kind="stable")
    if np.any(np.diff(sent_keys[by_key]) == 0):
        raise ScheduleError("a message is sent twice")
    found = (
        by_key[np.searchsorted(sent_keys[by_key], received_keys).clip(max=max(len(sends) - 1, 0))]
        if len(sends)
        else receives
    )
    missing = np.flatnonzero(sent_keys[found] != received_keys) if len(sends) else np.arange(len(receives))
    if len(missing):
        i = receives[missing[0]]
        raise ScheduleError(f"deadlock: rank {rank[i]} waits at {actions[i]}, which no rank sends")
    source, peer, message = np.full(n, -1), np.full(n, -1), np.full(n, -1)
    source[receives] = sends[found]
    owner = np.full(int(stage.max(initial=0)) + 2, -1)  # each stage's rank, read from the program
    owner[stage] = rank
    peer[sends], peer[receives] = owner[to_stage], rank[sends[found]]
    link = rank[sends] * ranks + peer[sends]
    in_order = np.lexsort((sends, link))  # by link, then send order
    first = np.searchsorted(link[in_order], link[in_order])  # each link's first send
    message[sends[in_order]] = np.arange(len(sends)) - first
    message[receives] = message[sends[found]]
    return FlatProgram(actions, starts, kind, stage, microbatch, source, peer, message)
