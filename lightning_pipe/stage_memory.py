"""Peak tensor memory of one pipeline stage: what its program holds at each kind of moment, by term."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from lightning_pipe.runtime.p2p import HEADER_LEN
from lightning_pipe.schedules.actions import Action, Kind

if TYPE_CHECKING:
    from lightning_pipe.planner import StageCosts

#: Bytes of one point-to-point message header (:mod:`lightning_pipe.runtime.p2p`).
HEADER_BYTES = HEADER_LEN * 8


@dataclass(frozen=True)
class HeldCounts:
    """Most microbatches a stage holds for their backward at each kind of moment of its program
    (0: no such moment). Gradients exist from a step's first backward on (always under 2BW,
    whose gradients live across steps); a flushing step starts without them.

    Attributes:
        forward_cold: after a forward, before the step's first backward.
        forward_warm: after a forward, once gradients exist.
        backward_first: at the step's first backward (its gradients are being created).
        backward_warm: at any later backward.
    """

    forward_cold: int = 0
    forward_warm: int = 0
    backward_first: int = 0
    backward_warm: int = 0

    @property
    def peak(self) -> int:
        """Most microbatches held at any moment."""
        return max(self.forward_cold, self.forward_warm, self.backward_first, self.backward_warm)


def held_counts(actions: Sequence[Action], warm: bool = False) -> HeldCounts:
    """Walk one rank's program: a forward takes a microbatch in, a backward (or, under split
    backward, the weight gradient) lets it go; an input gradient is the backward moment."""
    held, seen, most = 0, warm, [0, 0, 0, 0]
    for a in actions:
        if a.kind is Kind.FORWARD:
            held += 1
            most[1 if seen else 0] = max(most[1 if seen else 0], held)
        elif a.kind in (Kind.BACKWARD, Kind.INPUT_GRAD):
            most[3 if seen else 2] = max(most[3 if seen else 2], held)
            seen = True
        if a.kind in (Kind.BACKWARD, Kind.WEIGHT_GRAD):
            held -= 1
    return HeldCounts(*most)


def program_held_counts(program: Sequence[Sequence[Action]], warm: bool = False) -> list[HeldCounts]:
    """:func:`held_counts` of every rank of a program."""
    return [held_counts(actions, warm) for actions in program]


def stage_memory_terms(st: "StageCosts", held: HeldCounts, versions: int = 1, recompute: bool = False,
                       first: bool = True, last: bool = True, batch_bytes: int = 0) -> dict[str, int]:  # fmt: skip
    """Peak tensor bytes of one stage, by term, at its worst moment (see :class:`HeldCounts`).

    - ``state``: weights times the versions the schedule keeps (2 under 2BW, seed 000 section
      3.1), optimizer state and, once they exist, gradients (one per version).
    - ``activations``: per held microbatch what autograd saved plus the stage input (with
      recompute: the inputs only, plus one microbatch's activations during its backward).
      During the step's first backward the microbatch being run frees its saved tensors block
      by block while the gradients appear (``StageCosts.first_backward_bytes``).
    - ``outputs``: a stage that is not last keeps each held microbatch's output until its
      backward (what autograd does not save anyway).
    - ``buffers``: the receives posted ahead (an input from the previous stage, a gradient from
      the next), and two message headers per neighbour (a posted receive, a send in flight).
    - ``batch``: the replica's batch, which every rank of a pipeline holds during the step.
    - ``workspace``: the running block's temporaries (largest forward, or largest backward).
    """
    neighbours = (not first) + (not last)
    common = {
        "buffers": (0 if first else st.input_bytes) + (0 if last else st.output_bytes) + 2 * HEADER_BYTES * neighbours,
        "batch": batch_bytes,
    }
    weights = versions * st.weight_bytes + st.optimizer_bytes
    grads = versions * st.gradient_bytes
    per_held = st.input_bytes + (0 if recompute else st.stash_bytes)
    out = 0 if last else st.unsaved_output_bytes
    one = st.stash_bytes if recompute else 0  # recomputed for the backward that runs
    moments = [
        (held.forward_cold, weights, held.forward_cold * per_held, st.forward_workspace_bytes),
        (held.forward_warm, weights + grads, held.forward_warm * per_held, st.forward_workspace_bytes),
        (held.backward_first, weights,
         max(held.backward_first - 1, 0) * per_held + st.input_bytes + st.first_backward_bytes, 0),
        (held.backward_warm, weights + grads, held.backward_warm * per_held + one, st.backward_workspace_bytes),
    ]  # fmt: skip
    worst = max(
        ({"state": state, "activations": act, "outputs": h * out, "workspace": ws, **common} for h, state, act, ws in moments if h),
        key=lambda terms: sum(terms.values()),
        default={"state": weights + grads, "activations": 0, "outputs": 0, "workspace": 0, **common},
    )
    return worst


def stage_peak_bytes(st: "StageCosts", held: HeldCounts, versions: int = 1, recompute: bool = False, first: bool = True,
                     last: bool = True, batch_bytes: int = 0) -> int:  # fmt: skip
    """Peak tensor bytes of one stage: the sum of :func:`stage_memory_terms`."""
    return int(sum(stage_memory_terms(st, held, versions, recompute, first, last, batch_bytes).values()))
