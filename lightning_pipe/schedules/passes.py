"""Pure lowering passes that turn compute actions into a full per-rank program."""

from __future__ import annotations

from typing import Optional

from lightning_pipe.schedules.actions import Action, Kind
from lightning_pipe.schedules import two_bw
from lightning_pipe.schedules.generators import TRAINING_SCHEDULES, Generator, forward_only
from lightning_pipe.schedules.split import W_PLACEMENT, split_backward

Schedule = list[list[Action]]

# For each compute kind: (kind to insert before it, kind to insert after it), and whether the
# "before" half needs a previous stage (True) or a next stage (False).
_COMM: dict[Kind, tuple[Kind, Kind, bool]] = {
    Kind.FORWARD: (Kind.RECV_ACT, Kind.SEND_ACT, True),
    Kind.BACKWARD: (Kind.RECV_GRAD, Kind.SEND_GRAD, False),
    Kind.INPUT_GRAD: (Kind.RECV_GRAD, Kind.SEND_GRAD, False),
}


def _with_comm(action: Action, depth: int) -> list[Action]:
    if action.kind not in _COMM:
        return [action]
    before, after, before_needs_prev = _COMM[action.kind]
    has_prev, has_next = action.stage > 0, action.stage < depth - 1
    out = []
    if has_prev if before_needs_prev else has_next:
        out.append(Action(action.stage, before, action.microbatch))
    out.append(action)
    if has_next if before_needs_prev else has_prev:
        out.append(Action(action.stage, after, action.microbatch))
    return out


def add_communication(actions: list[Action], depth: int) -> list[Action]:
    """Insert receives before and (non-blocking) sends after each F and B."""
    return [c for a in actions for c in _with_comm(a, depth)]


def add_optimizer(actions: list[Action], stage: int) -> list[Action]:
    """Append the flush: gradient all-reduce across stage replicas, then the optimizer step."""
    return actions + [Action(stage, Kind.ALL_REDUCE), Action(stage, Kind.OPTIMIZER_STEP)]


#: Every schedule a user can name: the flushed ones plus PipeDream-2BW.
SCHEDULE_NAMES = (*TRAINING_SCHEDULES, "2bw")


def check_name(name: str) -> None:
    """Raise a clear error for a schedule name that does not exist."""
    if name not in SCHEDULE_NAMES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {sorted(SCHEDULE_NAMES)}")


def resolve(name: str) -> Generator:
    """Look up a flushed training schedule generator by name."""
    check_name(name)
    if name not in TRAINING_SCHEDULES:
        raise ValueError(f"schedule {name!r} is not flushed per batch; build it with two_bw_window()")
    return TRAINING_SCHEDULES[name]


def build_schedule(
    name: str, depth: int, microbatches: int, split: bool = False, max_pending: Optional[int] = None
) -> Schedule:
    """Full training program of every stage: compute, communication and the optimizer flush.

    Args:
        name: "gpipe" or "1f1b".
        depth: stages ``d``.
        microbatches: microbatches ``m``.
        split: split each backward into I and W (2BP, see schedules/split.py).
        max_pending: with ``split``, most microbatches that may wait for their W.
    """
    generator = resolve(name)
    programs = []
    for s in range(depth):
        compute = generator(s, depth, microbatches)
        if split:
            compute = split_backward(compute, W_PLACEMENT[name], max_pending)
        programs.append(add_optimizer(add_communication(compute, depth), s))
    return programs


def build_inference(depth: int, microbatches: int) -> Schedule:
    """Forward-only program of every stage (validation, test, predict)."""
    return [add_communication(forward_only(s, depth, microbatches), depth) for s in range(depth)]


def _split_2bw(actions: list[Action], split: bool) -> list[Action]:
    return split_backward(actions, W_PLACEMENT["2bw"]) if split else actions


def two_bw_window(depth: int, microbatches: int, step: int, split: bool = False) -> Schedule:
    """Full 2BW program of every stage for training step ``step`` (see schedules/two_bw.py)."""
    return [
        add_communication(_split_2bw(two_bw.window(s, depth, microbatches, step), split), depth) for s in range(depth)
    ]


def two_bw_drain(depth: int, microbatches: int, last_step: int, split: bool = False) -> Schedule:
    """Full 2BW program of every stage that finishes the stream after ``last_step``."""
    return [
        add_communication(_split_2bw(two_bw.drain(s, depth, microbatches, last_step), split), depth)
        for s in range(depth)
    ]


def two_bw_run(depth: int, microbatches: int, steps: int, split: bool = False) -> Schedule:
    """``steps`` consecutive 2BW windows and the drain, concatenated per stage (for checks)."""
    parts = [two_bw_window(depth, microbatches, t, split) for t in range(steps)]
    parts.append(two_bw_drain(depth, microbatches, steps - 1, split))
    return [[a for part in parts for a in part[s]] for s in range(depth)]
