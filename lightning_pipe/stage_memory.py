"""Peak tensor memory of one pipeline stage: what its program holds at each kind of moment, by term."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Sequence

from lightning_pipe.runtime.p2p import HEADER_LEN
from lightning_pipe.schedules.actions import Action, Kind

if TYPE_CHECKING:
    from lightning_pipe.planner import StageCosts

#: Bytes of one point-to-point message header (:mod:`lightning_pipe.runtime.p2p`).
HEADER_BYTES = HEADER_LEN * 8

#: ``(held, pending)``: microbatches held for their backward, and of those, how many have run
#: their input gradient (I) and wait for their weight gradient (W) with the gradients I captured.
Point = tuple[int, int]

#: One moment of a rank that runs several stages (interleaved 1F1B): the running stage's index
#: among the rank's stages, the kind of moment (a :class:`HeldCounts` field), and per stage of
#: the rank its ``(held, pending)`` point and whether its gradients exist.
Moment = tuple[int, str, tuple[Point, ...], tuple[bool, ...]]


def _dominant(points: Sequence[Point]) -> tuple[Point, ...]:
    """The points that can be a peak: those no other point holding at least as many microbatches
    beats on pending in either direction (the two Pareto frontiers). A moment's bytes are a
    nondecreasing function of held plus a convex one of pending (pending microbatches add
    captured gradients but no longer keep their outputs), so a point between two kept ones in
    pending, holding no more than either, is never above both."""
    unique = set(points)
    most: list[Point] = []
    for point in sorted(unique, reverse=True):  # held, then pending, most first
        if not most or point[1] > most[-1][1]:
            most.append(point)
    fewest: list[Point] = []
    for point in sorted(unique, key=lambda q: (-q[0], q[1])):  # held most first, pending fewest first
        if not fewest or point[1] < fewest[-1][1]:
            fewest.append(point)
    return tuple(sorted(set(most + fewest)))


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


#: The kind of moment an action makes of its stage, before and after the stage's gradients exist.
_MOMENT_KINDS = {
    Kind.FORWARD: ("forward_cold", "forward_warm"),
    Kind.BACKWARD: ("backward_first", "backward_warm"),
    Kind.INPUT_GRAD: ("input_cold", "backward_warm"),
    Kind.WEIGHT_GRAD: ("backward_warm", "backward_warm"),
}


def _walk(actions: Sequence[Action], position: Callable[[int], int], count: int, warm: bool = False) -> Iterator[Moment]:
    """Every moment of a rank's program over ``count`` stages (``position``: a stage's index among
    them): a forward takes a microbatch in, a backward (or, under split backward, its W) lets it
    go; an input gradient moves it to pending until its W. Gradients exist from a stage's
    first backward or W on (from the start if ``warm``)."""
    held, pending, grads = [0] * count, [0] * count, [warm] * count
    for a in actions:
        if a.kind not in _MOMENT_KINDS:
            continue
        c = position(a.stage)
        if a.kind is Kind.FORWARD:
            held[c] += 1
        elif a.kind is Kind.INPUT_GRAD:
            pending[c] += 1
        yield c, _MOMENT_KINDS[a.kind][grads[c]], tuple(zip(held, pending)), tuple(grads)
        if a.kind in (Kind.BACKWARD, Kind.WEIGHT_GRAD):
            grads[c], held[c], pending[c] = True, held[c] - 1, pending[c] - (a.kind is Kind.WEIGHT_GRAD)


def held_counts(actions: Sequence[Action], warm: bool = False) -> HeldCounts:
    """The (held, pending) points of each kind of moment of a one-stage rank's program (see :func:`_walk`)."""
    seen: dict[str, list[Point]] = {name: [] for name in HeldCounts.__dataclass_fields__}
    for _, kind, points, _ in _walk(actions, lambda stage: 0, 1, warm):
        seen[kind].append(points[0])
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
    common = {"buffers": _buffer_bytes(st, first, last), "batch": batch_bytes}
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


def _buffer_bytes(st: "StageCosts", first: bool, last: bool) -> int:
    """Receive buffers posted ahead, an input gradient kept until acknowledged, message headers."""
    neighbours = (not first) + (not last)
    return (0 if first else 2 * st.input_bytes) + (0 if last else st.output_bytes) + 2 * HEADER_BYTES * neighbours


def _kept_output_bytes(st: "StageCosts", recompute: bool, last: bool) -> int:
    """Bytes of one held microbatch's output kept beside what :attr:`StageCosts.stash_bytes` counts."""
    if not recompute:
        return 0 if last else st.unsaved_output_bytes
    return st.output_bytes - st.unsaved_output_bytes if last else st.output_bytes


def stage_peak_bytes(st: "StageCosts", held: HeldCounts, versions: int = 1, recompute: bool = False, first: bool = True,
                     last: bool = True, batch_bytes: int = 0, gradient_sets: Optional[int] = None) -> int:  # fmt: skip
    """Peak tensor bytes of one stage: the sum of :func:`stage_memory_terms`."""
    return int(sum(stage_memory_terms(st, held, versions, recompute, first, last, batch_bytes, gradient_sets).values()))


def rank_moments(actions: Sequence[Action], stages: Sequence[int]) -> tuple[Moment, ...]:
    """The distinct moments of one rank's program over its ``stages``, in program order (see
    :func:`_walk`; every stage's counts at each, where :func:`held_counts` keeps one stage's)."""
    index = {s: c for c, s in enumerate(stages)}
    return tuple(dict.fromkeys(_walk(actions, index.__getitem__, len(stages))))


def resting_bytes(st: "StageCosts", point: Point, grads: bool, recompute: bool, last: bool) -> int:
    """Tensor bytes of a stage whose rank runs another of its stages: its weights, optimizer
    state and (once they exist) gradients, its held microbatches' saved tensors, inputs and kept
    outputs, and its pending microbatches' captured gradients (and, with recompute, their
    rebuilt graphs). Buffers belong to the rank (:func:`rank_buffer_bytes`)."""
    h, p = point
    one = st.stash_bytes if recompute else 0
    state = st.weight_bytes + st.optimizer_bytes + (st.gradient_bytes if grads else 0)
    activations = h * (st.input_bytes + (0 if recompute else st.stash_bytes)) + p * (one + st.captured_bytes)
    return state + activations + (h - p) * _kept_output_bytes(st, recompute, last)


def rank_buffer_bytes(stages: Sequence["StageCosts"], first: Sequence[bool], last: Sequence[bool], one_peer: bool) -> int:
    """Buffers of a rank that runs several stages: a receive is posted one ahead per neighbour
    rank, not per stage (the largest input its stages receive from the previous rank, the
    largest gradient from the next; ``one_peer``: both neighbours are one rank, at depth 2);
    per stage that receives an input, the input gradient it sent back, kept until the previous
    rank acknowledges it; two headers per neighbour."""
    inputs = [st.input_bytes for st, f in zip(stages, first) if not f]
    outputs = [st.output_bytes for st, lst in zip(stages, last) if not lst]
    posted = [max(inputs + outputs)] if one_peer else [max(inputs, default=0), max(outputs, default=0)]
    neighbours = 1 if one_peer else bool(inputs) + bool(outputs)
    return sum(posted) + sum(inputs) + 2 * HEADER_BYTES * neighbours


#: The kind a moment of a stage takes once its gradients exist (the rank's shared buckets made them).
_WARM = {"forward_cold": "forward_warm", "backward_first": "backward_warm", "input_cold": "backward_warm"}


def _bucketed_moment(kind: str, grads: tuple[bool, ...]) -> tuple[str, tuple[bool, ...]]:
    """A rank moment when its stages share gradient buckets: once any stage has gradients every
    stage has them, the running one's moment turning warm; a backward (or W) makes them all."""
    if any(grads):
        return _WARM.get(kind, kind), (True,) * len(grads)
    return kind, (True,) * len(grads) if kind.startswith("backward") else grads


def rank_peak_bytes(stages: Sequence["StageCosts"], moments: Sequence[Moment], recompute: Sequence[bool],
                    first: Sequence[bool], last: Sequence[bool], batch_bytes: int = 0, one_peer: bool = False,
                    buckets: bool = False) -> int:  # fmt: skip
    """Peak tensor bytes of a rank that runs several stages (one weight version): at each of its
    :func:`rank_moments`, the running stage's :func:`stage_memory_terms` at that moment but its
    buffers, plus every other stage's :func:`resting_bytes`, plus the rank's
    :func:`rank_buffer_bytes` and the batch.

    ``buckets``: the rank's gradients are averaged over replicas in buckets shared by its
    stages, each whole from its first gradient (runtime/buckets.py), so from the rank's first
    backward (or W) on every stage's gradients are counted (exact while they fit one bucket, an
    upper bound beyond)."""
    running: dict[tuple[int, str, Point], int] = {}
    resting: dict[tuple[int, Point, bool], int] = {}
    best = 0
    for c, kind, points, grads in moments:
        if buckets:
            kind, grads = _bucketed_moment(kind, grads)
        key = (c, kind, points[c])
        if key not in running:
            terms = stage_memory_terms(stages[c], HeldCounts(**{kind: (points[c],)}), 1, recompute[c], first[c], last[c])
            running[key] = int(sum(terms.values())) - terms["buffers"]
        total = running[key]
        for o, (point, g) in enumerate(zip(points, grads)):
            if o != c:
                if (o, point, g) not in resting:
                    resting[o, point, g] = resting_bytes(stages[o], point, g, recompute[o], last[o])
                total += resting[o, point, g]
        best = max(best, total)
    return best + rank_buffer_bytes(stages, first, last, one_peer) + batch_bytes
