"""Pure schedule generators: each returns one stage's compute actions (F and B) in order.

With ``d`` stages and ``m`` microbatches (GPipe, Huang et al., 2019; PipeDream-Flush, from the PipeDream-2BW paper):

GPipe, d=2, m=3 (all forwards, then all backwards)::

    stage 0: 0F0 0F1 0F2 0B0 0B1 0B2
    stage 1: 1F0 1F1 1F2 1B0 1B1 1B2

1F1B / PipeDream-Flush, d=2, m=3 (warm-up of d-1-s forwards, then alternate)::

    stage 0: 0F0 0F1 0B0 0F2 0B1 0B2
    stage 1: 1F0 1B0 1F1 1B1 1F2 1B2
"""

from __future__ import annotations

from typing import Callable

from lightning_pipe.schedules.actions import Action, Kind, action

Generator = Callable[[int, int, int], list[Action]]


def _forwards(stage: int, mbs: range) -> list[Action]:
    return [action(stage, Kind.FORWARD, k) for k in mbs]


def _backwards(stage: int, mbs: range) -> list[Action]:
    return [action(stage, Kind.BACKWARD, k) for k in mbs]


def gpipe(stage: int, depth: int, microbatches: int) -> list[Action]:
    """GPipe: all ``m`` forwards, then all ``m`` backwards (GPipe, Huang et al., 2019)."""
    del depth
    return _forwards(stage, range(microbatches)) + _backwards(stage, range(microbatches))


def one_f_one_b(stage: int, depth: int, microbatches: int) -> list[Action]:
    """PipeDream-Flush (1F1B): ``d-1-s`` warm-up forwards, steady 1F1B pairs, cool-down backwards.

    At most ``d - s`` microbatches are in flight on stage ``s`` (PipeDream-Flush, PipeDream-2BW paper, section 2).
    """
    warmup = min(depth - stage - 1, microbatches)
    steady = [
        a
        for k in range(microbatches - warmup)
        for a in (action(stage, Kind.FORWARD, warmup + k), action(stage, Kind.BACKWARD, k))
    ]
    cooldown = _backwards(stage, range(microbatches - warmup, microbatches))
    return _forwards(stage, range(warmup)) + steady + cooldown


def forward_only(stage: int, depth: int, microbatches: int) -> list[Action]:
    """Inference: forwards only, for validation, test and predict."""
    del depth
    return _forwards(stage, range(microbatches))
