"""Peak tensor memory of one pipeline stage: what its program holds at each kind of moment, by term."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Optional, Sequence

from lightning_pipe.runtime.p2p import HEADER_LEN
from lightning_pipe.schedules.actions import Action, Kind

if TYPE_CHECKING:
    from lightning_pipe.planner import StageCosts

#: Bytes of one point-to-point message header (:mod:`lightning_pipe.runtime.p2p`).
HEADER_BYTES = HEADER_LEN * 8

#: ``(headers, gradients)``: a stage's sends not yet acknowledged by their peer (see
#: :func:`send_events`), by what they keep alive: every one its header, and an input gradient
#: sent upstream is kept by the message alone. A sent output needs nothing more: the stage keeps
#: it until its backward, which needs the peer's gradient for it, and that message acknowledges it.
Sent = tuple[int, int]
NOTHING_SENT: Sent = (0, 0)

#: ``(held, pending, sent)``: microbatches held for their backward, of those how many have run
#: their input gradient (I) and wait for their weight gradient (W) with the gradients I
#: captured, and the stage's unacknowledged sends (:data:`Sent`).
Point = tuple[int, int, Sent]

#: One moment of a rank that runs several stages (interleaved 1F1B): the running stage's index
#: among the rank's stages, the kind of moment (a :class:`HeldCounts` field), and per stage of
#: the rank its :data:`Point` and whether its gradients exist.
Moment = tuple[int, str, tuple[Point, ...], tuple[bool, ...]]

#: A change to a rank's unacknowledged sends after one action of its program: ``(stage, headers,
#: gradients)`` added (a send posted) or, negative, taken off (sends the peer acknowledged).
SendEvent = tuple[int, int, int]


def send_events(program: Sequence[Sequence[Action]]) -> list[dict[int, list[SendEvent]]]:
    """Per rank of ``program``, by the index of the action after which they happen, the changes
    to its unacknowledged sends (:data:`SendEvent`).

    The executor keeps every message it posted, header and tensors, until it knows the peer has
    it (runtime/executor.py, ``Outbox``): each message carries how many messages its sender had
    taken in from the destination, and a rank reads that count when a receive action takes the
    message in, together with every earlier message from that peer (messages between two ranks
    arrive in send order). A flushing step's end waits for all of them.
    """
    # Integer keys, plain loops: the planner walks every candidate's program.
    depth, comms = len(program), [_messages(actions) for actions in program]
    span = 1 + max((c[2] for mine in comms for c in mine), default=0)  # microbatches, for integer message keys
    sent: dict[int, list[SendEvent]] = {}  # sender * depth + receiver: each message's acknowledgement, in send order
    sender: dict[int, int] = {}  # a message's key (receiving stage, microbatch, gradient?) -> its link and number
    for r, mine in enumerate(comms):
        for _, stage, microbatch, grad, sends in mine:
            if sends:
                to = stage - 1 if grad else stage + 1
                box = sent.setdefault(r * depth + to % depth, [])
                sender[(to * span + microbatch) * 2 + grad] = len(box) * depth + r
                box.append((stage, -1, -int(grad)))
    acks: dict[int, list[int]] = {link: [] for link in sent}  # what each message acknowledges, per link in send order
    for r, mine in enumerate(comms):
        taken = [0] * depth
        for _, stage, microbatch, grad, sends in mine:
            if sends:
                q = (stage - 1 if grad else stage + 1) % depth
                acks[r * depth + q].append(taken[q])
            else:
                n, q = divmod(sender[(stage * span + microbatch) * 2 + grad], depth)
                if n >= taken[q]:
                    taken[q] = n + 1
    return [_rank_send_events(r, mine, sender, sent, acks, depth, span) for r, mine in enumerate(comms)]


def _messages(actions: Sequence[Action]) -> list[tuple[int, int, int, bool, bool]]:
    """A rank's sends and receives: (action index, stage, microbatch, gradient?, send?)."""
    sa, sg, ra, rg = Kind.SEND_ACT, Kind.SEND_GRAD, Kind.RECV_ACT, Kind.RECV_GRAD
    return [(i, a.stage, a.microbatch, k is sg or k is rg, k is sa or k is sg)  # type: ignore[misc]
            for i, a in enumerate(actions) for k in (a.kind,) if k is sa or k is sg or k is ra or k is rg]  # fmt: skip


def _rank_send_events(r: int, comms: Sequence[tuple[int, int, int, bool, bool]], sender: dict[int, int], sent: dict[int, list[SendEvent]],
                      acks: dict[int, list[int]], depth: int, span: int) -> dict[int, list[SendEvent]]:  # fmt: skip
    """:func:`send_events` of rank ``r`` from its sends and receives (:func:`_messages`)."""
    taken, acked, events = [0] * depth, [0] * depth, {}
    for i, stage, microbatch, grad, sends in comms:
        if sends:
            events[i] = [(stage, 1, int(grad))]
            continue
        n, q = divmod(sender[(stage * span + microbatch) * 2 + grad], depth)
        if n >= taken[q]:
            theirs = acks[q * depth + r]
            newest = theirs[n] if n == taken[q] else max(theirs[taken[q] : n + 1])
            if newest > acked[q]:
                events[i] = sent[r * depth + q][acked[q] : newest]
                acked[q] = newest
            taken[q] = n + 1
    return events


def _dominant(points: Iterable[Point]) -> tuple[Point, ...]:
    """The points that can be a peak: among those with the same unacknowledged sends, those no
    other point holding at least as many microbatches beats on pending in either direction (the
    two Pareto frontiers). A moment's bytes are a nondecreasing function of held plus a convex
    one of pending (pending microbatches add captured gradients but no longer keep their
    outputs), so a point between two kept ones in pending, holding no more than either, is
    never above both. Points on a segment between two others go first (:func:`_ends_of_segments`)."""
    groups: dict[Sent, set[Point]] = {}
    for point in _ends_of_segments(points):
        groups.setdefault(point[2], set()).add(point)
    kept: list[Point] = []
    for unique in groups.values():
        most: list[Point] = []
        for point in sorted(unique, reverse=True):  # held, then pending, most first
            if not most or point[1] > most[-1][1]:
                most.append(point)
        fewest: list[Point] = []
        for point in sorted(unique, key=lambda q: (-q[0], q[1])):  # held most first, pending fewest first
            if not fewest or point[1] < fewest[-1][1]:
                fewest.append(point)
        kept += most + fewest
    return tuple(sorted(set(kept)))


def _ends_of_segments(points: Iterable[Point]) -> list[Point]:
    """``points`` without those that lie between two others of the same pending count on a
    straight line through (held, headers, gradients): at one kind of moment and pending count a
    stage's bytes are affine in those three (every held microbatch is at least at its backward,
    see :func:`stage_memory_terms`), so such a point is never above both ends. A pipeline's
    drain walks such lines (each backward frees a microbatch and sends its input gradient)."""
    by_pending: dict[int, set[tuple[int, int, int]]] = {}
    for h, p, (hd, g) in points:
        by_pending.setdefault(p, set()).add((h, hd, g))
    kept: list[Point] = []
    for pending, triples in by_pending.items():
        stack: list[tuple[int, int, int]] = []
        for h, hd, g in sorted(triples):
            while len(stack) >= 2 and _between(stack[-2], stack[-1], (h, hd, g)):
                stack.pop()
            stack.append((h, hd, g))
        kept += [(h, pending, (hd, g)) for h, hd, g in stack]
    return kept


def _between(a: tuple[int, ...], b: tuple[int, ...], c: tuple[int, ...]) -> bool:
    """Whether ``b`` lies on the segment from ``a`` to ``c``, strictly inside (integer vectors)."""
    u, v = [y - x for x, y in zip(a, b)], [y - x for x, y in zip(a, c)]
    cross = (u[1] * v[2] - u[2] * v[1], u[2] * v[0] - u[0] * v[2], u[0] * v[1] - u[1] * v[0])
    dot, length = sum(x * y for x, y in zip(u, v)), sum(y * y for y in v)
    return cross == (0, 0, 0) and 0 < dot < length


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
        return max((point[0] for point in points), default=0)


#: The kind of moment an action makes of its stage, before and after the stage's gradients exist.
_MOMENT_KINDS = {
    Kind.FORWARD: ("forward_cold", "forward_warm"),
    Kind.BACKWARD: ("backward_first", "backward_warm"),
    Kind.INPUT_GRAD: ("input_cold", "backward_warm"),
    Kind.WEIGHT_GRAD: ("backward_warm", "backward_warm"),
}


def _walk(actions: Sequence[Action], position: Callable[[int], int], count: int, warm: bool = False,
          sends: Optional[dict[int, list[SendEvent]]] = None) -> Iterator[Moment]:  # fmt: skip
    """Every moment of a rank's program over ``count`` stages (``position``: a stage's index among
    them): a forward takes a microbatch in, a backward (or, under split backward, its W) lets it
    go; an input gradient moves it to pending until its W. Gradients exist from a stage's
    first backward or W on (from the start if ``warm``). ``sends``: the rank's
    :func:`send_events` (``None``: none counted)."""
    held, pending, grads = [0] * count, [0] * count, [warm] * count
    sent: list[Sent] = [NOTHING_SENT] * count
    f, b, ig, w = Kind.FORWARD, Kind.BACKWARD, Kind.INPUT_GRAD, Kind.WEIGHT_GRAD  # compared by identity: Enum hashing is slow
    for i, a in enumerate(actions):
        k = a.kind
        if k is f or k is b or k is ig or k is w:
            c = position(a.stage)
            if k is f:
                held[c] += 1
            elif k is ig:
                pending[c] += 1
            if count == 1:  # the planner walks every candidate's one-stage ranks: skip zip
                yield c, _MOMENT_KINDS[k][grads[0]], ((held[0], pending[0], sent[0]),), (grads[0],)
            else:
                yield c, _MOMENT_KINDS[k][grads[c]], tuple(zip(held, pending, sent)), tuple(grads)
            if k is b or k is w:
                grads[c], held[c], pending[c] = True, held[c] - 1, pending[c] - (k is w)
        if sends and i in sends:
            for stage, headers, gradients in sends[i]:
                o = position(stage)
                sent[o] = (sent[o][0] + headers, sent[o][1] + gradients)


def held_counts(actions: Sequence[Action], warm: bool = False, sends: Optional[dict[int, list[SendEvent]]] = None) -> HeldCounts:
    """The points of each kind of moment of a one-stage rank's program (see :func:`_walk`)."""
    seen: dict[str, set[Point]] = {name: set() for name in HeldCounts.__dataclass_fields__}
    for _, kind, points, _ in _walk(actions, lambda stage: 0, 1, warm, sends):
        seen[kind].add(points[0])
    return HeldCounts(**{name: _dominant(points) for name, points in seen.items()})


def program_held_counts(program: Sequence[Sequence[Action]], warm: bool = False) -> list[HeldCounts]:
    """:func:`held_counts` of every rank of a program, with its sends (:func:`send_events`)."""
    return [held_counts(actions, warm, sends) for actions, sends in zip(program, send_events(program))]


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
      the next, each with its header) and the sends not yet acknowledged at that moment (the
      point's :data:`Sent`: their headers and input gradients).
    - ``batch``: the replica's batch, which every rank of a pipeline holds during the step.
    - ``workspace``: the running block's temporaries (largest forward, or largest backward);
      during a backward of a stage that is not last, also the gradient it started from.
    """
    posted = _posted_bytes(st, first, last)
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

    best, most = (weights + grads, 0, 0, 0, 0), -1  # totals first, one dict at the end: MadPipe asks millions of times
    for points, state, act, ws in moments:
        for h, p, sent in points:
            parts = (state, act(h, p) + max(p - 1, 0) * st.captured_bytes, (h - p) * out, ws, sent_bytes(st, sent))
            if sum(parts) > most:
                best, most = parts, sum(parts)
    state, activations, outputs, workspace, sending = best
    return {"state": state, "activations": activations, "outputs": outputs, "workspace": workspace,
            "buffers": posted + sending, "batch": batch_bytes}  # fmt: skip


def _posted_bytes(st: "StageCosts", first: bool, last: bool) -> int:
    """Receives posted ahead: an input from the previous stage, a gradient from the next, each with its header."""
    neighbours = (not first) + (not last)
    return (0 if first else st.input_bytes) + (0 if last else st.output_bytes) + HEADER_BYTES * neighbours


def sent_bytes(st: "StageCosts", sent: Sent) -> int:
    """Bytes a stage's unacknowledged sends keep alive (see :data:`Sent`)."""
    headers, gradients = sent
    return headers * HEADER_BYTES + gradients * st.input_bytes


def _kept_output_bytes(st: "StageCosts", recompute: bool, last: bool) -> int:
    """Bytes of one held microbatch's output kept beside what :attr:`StageCosts.stash_bytes` counts."""
    if not recompute:
        return 0 if last else st.unsaved_output_bytes
    return st.output_bytes - st.unsaved_output_bytes if last else st.output_bytes


def stage_peak_bytes(st: "StageCosts", held: HeldCounts, versions: int = 1, recompute: bool = False, first: bool = True,
                     last: bool = True, batch_bytes: int = 0, gradient_sets: Optional[int] = None) -> int:  # fmt: skip
    """Peak tensor bytes of one stage: the sum of :func:`stage_memory_terms`."""
    return int(sum(stage_memory_terms(st, held, versions, recompute, first, last, batch_bytes, gradient_sets).values()))


def rank_moments(actions: Sequence[Action], stages: Sequence[int], sends: Optional[dict[int, list[SendEvent]]] = None) -> tuple[Moment, ...]:
    """The distinct moments of one rank's program over its ``stages``, in program order (see
    :func:`_walk`; every stage's counts at each, where :func:`held_counts` keeps one stage's)."""
    index = {s: c for c, s in enumerate(stages)}
    return tuple(dict.fromkeys(_walk(actions, index.__getitem__, len(stages), sends=sends)))


def resting_bytes(st: "StageCosts", point: Point, grads: bool, recompute: bool, last: bool) -> int:
    """Tensor bytes of a stage whose rank runs another of its stages: its weights, optimizer
    state and (once they exist) gradients, its held microbatches' saved tensors, inputs and kept
    outputs, and its pending microbatches' captured gradients (and, with recompute, their
    rebuilt graphs). Buffers belong to the rank (:func:`rank_buffer_bytes`, :func:`sent_bytes`)."""
    h, p, _ = point
    one = st.stash_bytes if recompute else 0
    state = st.weight_bytes + st.optimizer_bytes + (st.gradient_bytes if grads else 0)
    activations = h * (st.input_bytes + (0 if recompute else st.stash_bytes)) + p * (one + st.captured_bytes)
    return state + activations + (h - p) * _kept_output_bytes(st, recompute, last)


def rank_buffer_bytes(stages: Sequence["StageCosts"], first: Sequence[bool], last: Sequence[bool], one_peer: bool) -> int:
    """Receives a rank that runs several stages posts ahead: one per neighbour rank, not per stage
    (the largest input its stages receive from the previous rank, the largest gradient from the
    next; ``one_peer``: both neighbours are one rank, at depth 2), each with its header. Its
    unacknowledged sends depend on the moment (:func:`sent_bytes`)."""
    inputs = [st.input_bytes for st, f in zip(stages, first) if not f]
    outputs = [st.output_bytes for st, lst in zip(stages, last) if not lst]
    posted = [max(inputs + outputs)] if one_peer else [max(inputs, default=0), max(outputs, default=0)]
    neighbours = 1 if one_peer else bool(inputs) + bool(outputs)
    return sum(posted) + HEADER_BYTES * neighbours


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
    buffers, plus every other stage's :func:`resting_bytes`, plus every stage's unacknowledged
    sends (:func:`sent_bytes`), plus the rank's :func:`rank_buffer_bytes` and the batch.

    ``buckets``: the rank's gradients are averaged over replicas in buckets shared by its
    stages, each whole from its first gradient (runtime/buckets.py), so from the rank's first
    backward (or W) on every stage's gradients are counted (exact while they fit one bucket, an
    upper bound beyond)."""
    running: dict[tuple[int, str, tuple[int, int]], int] = {}
    resting: dict[tuple[int, tuple[int, int], bool], int] = {}
    best = 0
    for c, kind, points, grads in moments:
        if buckets:
            kind, grads = _bucketed_moment(kind, grads)
        key = (c, kind, points[c][:2])
        if key not in running:
            point = (*points[c][:2], NOTHING_SENT)
            terms = stage_memory_terms(stages[c], HeldCounts(**{kind: (point,)}), 1, recompute[c], first[c], last[c])
            running[key] = int(sum(terms.values())) - terms["buffers"]
        total = running[key] + sum(sent_bytes(st, point[2]) for st, point in zip(stages, points))
        for o, (point, g) in enumerate(zip(points, grads)):
            if o != c:
                if (o, point[:2], g) not in resting:
                    resting[o, point[:2], g] = resting_bytes(stages[o], point, g, recompute[o], last[o])
                total += resting[o, point[:2], g]
        best = max(best, total)
    return best + rank_buffer_bytes(stages, first, last, one_peer) + batch_bytes
