"""Peak tensor memory of one pipeline stage: what its program holds at each kind of moment, by term."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

from lightning_pipe.runtime.p2p import HEADER_LEN
from lightning_pipe.schedules.actions import Action, Kind

if TYPE_CHECKING:
    from lightning_pipe.planner import StageCosts

#: Bytes of one point-to-point message header (:mod:`lightning_pipe.runtime.p2p`).
HEADER_BYTES = HEADER_LEN * 8

#: ``(held, pending)``: microbatches held for their backward, and of those, how many have run
#: their input gradient (I) and wait for their weight gradient (W) with the gradients I captured.
Point = tuple[int, int]


def _dominant(points: Sequence[Point]) -> tuple[Point, ...]:
    """The points no other point dominates in both counts (the only ones that can be a peak):
    by held, most first, each kept if it waits for more W's than every point holding more."""
    kept: list[Point] = []
    for point in sorted(set(points), reverse=True):
        if not kept or point[1] > kept[-1][1]:
            kept.append(point)
    return tuple(sorted(kept))


@dataclass(frozen=True)
class HeldCounts:
    """Microbatches a stage holds at each kind of moment of its program, as ``(held, pending)``
    points (see :data:`Point`; empty: no such moment). Gradients exist from a step's first
    backward (or, under split backward, its first W) on; always under 2BW, whose gradients live
    across steps; a flushing step starts without them.

    Attributes:
        forward_cold: after a forward, before gradients exist.
        forward_warm: after a forward, once gradients exist.
        backward_first: at the backward that creates the gradients.
        backward_warm: at any later backward, input gradient or weight gradient, and at a W
            that creates the gradients.
        input_cold: at an input gradient (split backward) before any W created gradients.
    """

    forward_cold: tuple[Point, ...] = ()
    forward_warm: tuple[Point, ...] = ()
    backward_first: tuple[Point, ...] = ()
    backward_warm: tuple[Point, ...] = ()
    input_cold: tuple[Point, ...] = ()

    @property
    def peak(self) -> int:
        """Most microbatches held at any moment."""
        points = self.forward_cold + self.forward_warm + self.backward_first + self.backward_warm + self.input_cold
        return max((h for h, _ in points), default=0)


def held_counts(actions: Sequence[Action], warm: bool = False) -> HeldCounts:
    """Walk one rank's program: a forward takes a microbatch in, a backward (or, under split
    backward, its W) lets it go; an input gradient moves it to pending until its W."""
    held = pending = 0
    grads = warm
    seen: dict[str, list[Point]] = {name: [] for name in HeldCounts.__dataclass_fields__}
    for a in actions:
        if a.kind is Kind.FORWARD:
            held += 1
            seen["forward_warm" if grads else "forward_cold"].append((held, pending))
        elif a.kind is Kind.BACKWARD:
            seen["backward_warm" if grads else "backward_first"].append((held, pending))
            grads, held = True, held - 1
        elif a.kind is Kind.INPUT_GRAD:
            pending += 1
            seen["backward_warm" if grads else "input_cold"].append((held, pending))
        elif a.kind is Kind.WEIGHT_GRAD:
            seen["backward_warm"].append((held, pending))
            grads, held, pending = True, held - 1, pending - 1
    return HeldCounts(**{name: _dominant(points) for name, points in seen.items()})


def program_held_counts(program: Sequence[Sequence[Action]], warm: bool = False) -> list[HeldCounts]:
    """:func:`held_counts` of every rank of a program."""
    return [held_counts(actions, warm) for actions in program]


def stage_memory_terms(st: "StageCosts", held: HeldCounts, versions: int = 1, recompute: bool = False,
                       first: bool = True, last: bool = True, batch_bytes: int = 0,
                       gradient_sets: Optional[int] = None) -> dict[str, int]:  # fmt: skip
    """Peak tensor bytes of one stage, by term, at its worst moment (see :class:`HeldCounts`).

    - ``state``: weights times the versions the schedule keeps (2 under 2BW, seed 000 section
      3.1), optimizer state and, once they exist, gradients: ``gradient_sets`` batches' worth
      (default one per version; under 2BW the first stage holds one, as it steps right after
      its all-reduce, unless weights are tied across stages: schedules/two_bw.py).
    - ``activations``: per held microbatch what autograd saved plus the stage input (with
      recompute: the inputs only, plus one microbatch's activations during its backward, or
      under split backward every pending microbatch's, recomputed before its I); per
      pending microbatch (split backward) but the one whose I or W runs (its captured gradients
      take the place of a backward's temporaries, measured), also the gradients its I captured for its W. During
      the step's first backward the microbatch being run frees its saved tensors block by
      block while the gradients appear (``StageCosts.first_backward_bytes``).
    - ``outputs``: until its backward (or I) a microbatch's output is kept: by a stage that is
      not last, what autograd does not save anyway; with recompute autograd saves none of it,
      so all of it, and on the last stage what the loss saved of it.
    - ``buffers``: the receives posted ahead (an input from the previous stage, a gradient from
      the next), an input gradient sent upstream and kept until the peer acknowledges it, and
      two message headers per neighbour (a posted receive, a send in flight).
    - ``batch``: the replica's batch, which every rank of a pipeline holds during the step.
    - ``workspace``: the running block's temporaries (largest forward, or largest backward);
      during a backward of a stage that is not last, also the gradient it started from.
    """
    neighbours = (not first) + (not last)
    common = {
        "buffers": (0 if first else 2 * st.input_bytes) + (0 if last else st.output_bytes) + 2 * HEADER_BYTES * neighbours,
        "batch": batch_bytes,
    }
    weights = versions * st.weight_bytes + st.optimizer_bytes
    grads = (versions if gradient_sets is None else gradient_sets) * st.gradient_bytes
    per_held = st.input_bytes + (0 if recompute else st.stash_bytes)
    out = _kept_output_bytes(st, recompute, last)
    one = st.stash_bytes if recompute else 0  # recomputed for the backward that runs
    fws, bws = st.forward_workspace_bytes, st.backward_workspace_bytes + (0 if last else st.output_bytes)
    # Recomputed graphs: the one a backward runs on, and under split backward each pending
    # microbatch's (rebuilt before its I, kept for its W).
    moments = [
        (held.forward_cold, weights, lambda h, p: h * per_held + p * one, fws),
        (held.forward_warm, weights + grads, lambda h, p: h * per_held + p * one, fws),
        (held.backward_first, weights, lambda h, p: max(h - 1, 0) * per_held + st.input_bytes + st.first_backward_bytes,
         bws - st.backward_workspace_bytes),
        (held.backward_warm, weights + grads, lambda h, p: h * per_held + max(p, 1) * one, bws),
        (held.input_cold, weights, lambda h, p: h * per_held + max(p, 1) * one, bws),
    ]  # fmt: skip
    candidates = [
        {"state": state, "activations": act(h, p) + max(p - 1, 0) * st.captured_bytes, "outputs": (h - p) * out,
         "workspace": ws, **common}
        for points, state, act, ws in moments for h, p in points
    ]  # fmt: skip
    default = {"state": weights + grads, "activations": 0, "outputs": 0, "workspace": 0, **common}
    return max(candidates, key=lambda terms: sum(terms.values()), default=default)


def _kept_output_bytes(st: "StageCosts", recompute: bool, last: bool) -> int:
    """Bytes of one held microbatch's output kept beside what :attr:`StageCosts.stash_bytes` counts."""
    if not recompute:
        return 0 if last else st.unsaved_output_bytes
    return st.output_bytes - st.unsaved_output_bytes if last else st.output_bytes


def stage_peak_bytes(st: "StageCosts", held: HeldCounts, versions: int = 1, recompute: bool = False, first: bool = True,
                     last: bool = True, batch_bytes: int = 0, gradient_sets: Optional[int] = None) -> int:  # fmt: skip
    """Peak tensor bytes of one stage: the sum of :func:`stage_memory_terms`."""
    return int(sum(stage_memory_terms(st, held, versions, recompute, first, last, batch_bytes, gradient_sets).values()))
