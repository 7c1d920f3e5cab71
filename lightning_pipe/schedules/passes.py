"""Pure lowering passes that turn compute actions into a full per-rank program."""

from __future__ import annotations

from lightning_pipe.schedules.actions import Action, Kind
from lightning_pipe.schedules.generators import TRAINING_SCHEDULES, Generator, forward_only

Schedule = list[list[Action]]

# For each compute kind: (kind to insert before it, kind to insert after it), and whether the
# "before" half needs a previous stage (True) or a next stage (False).
_COMM: dict[Kind, tuple[Kind, Kind, bool]] = {
    Kind.FORWARD: (Kind.RECV_ACT, Kind.SEND_ACT, True),
    Kind.BACKWARD: (Kind.RECV_GRAD, Kind.SEND_GRAD, False),
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


def resolve(name: str) -> Generator:
    """Look up a training schedule generator by name, with a clear error for unknown names."""
    if name not in TRAINING_SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {sorted(TRAINING_SCHEDULES)}")
    return TRAINING_SCHEDULES[name]


def build_schedule(name: str, depth: int, microbatches: int) -> Schedule:
    """Full training program of every stage: compute, communication and the optimizer flush."""
    generator = resolve(name)
    return [
        add_optimizer(add_communication(generator(s, depth, microbatches), depth), s) for s in range(depth)
    ]


def build_inference(depth: int, microbatches: int) -> Schedule:
    """Forward-only program of every stage (validation, test, predict)."""
    return [add_communication(forward_only(s, depth, microbatches), depth) for s in range(depth)]
