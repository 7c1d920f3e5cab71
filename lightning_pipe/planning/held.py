"""What a stage's program holds at each kind of moment, walked from its actions: microbatches, W's, sends."""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Optional, Sequence

import numpy as np

from lightning_pipe.schedules.actions import Action, Kind
from lightning_pipe.schedules.flat import (
    BACKWARD,
    CODES,
    FORWARD,
    INPUT_GRAD,
    RECV_ACT,
    SEND_ACT,
    SEND_GRAD,
    WEIGHT_GRAD,
    FlatProgram,
    flatten,
)

OPTIMIZER_STEP = CODES[Kind.OPTIMIZER_STEP]
VERSION = CODES[Kind.VERSION]


#: ``(outputs, gradients)``: a stage's sends not yet acknowledged by their peer (see
#: :func:`unacknowledged`), outputs sent downstream and input gradients sent upstream. Once a
#: link's shapes are known each is one message, its header (:data:`HEADER_BYTES`) and a copy of
#: its tensors packed (runtime/comm/p2p.py), kept until acknowledged: the header and an output's
#: bytes, or the header and an input's. (The stage keeps a sent output itself too, until its
#: backward, which needs the peer's gradient for it, and that message acknowledges it.) Where
#: headers take a CPU side channel (NCCL) nothing is packed: there these terms, the headers kept
#: with received inputs and gradients, and a forward's packed copy, are an upper bound.
#: In a 2BW stream a third count follows: the batches before the newest still alive on the rank
#: (:func:`earlier_batches`).
Sent = tuple[int, ...]


NOTHING_SENT: Sent = (0, 0)


#: ``(held, pending, sent)``: microbatches held for their backward, of those how many have run
#: their input gradient (I) and wait for their weight gradient (W) with the gradients I
#: captured, and the stage's unacknowledged sends (:data:`Sent`).
Point = tuple[int, int, Sent]


#: One moment of a rank that runs several stages (interleaved 1F1B): the running stage's index
#: among the rank's stages, the kind of moment (a :class:`HeldCounts` field), and per stage of
#: the rank its :data:`Point` and whether its gradients exist. Walked with
#: :func:`buffered_by_kind` (:func:`rank_moments`), a point's sends are counts by kind,
#: then its output-sized tensors kept for the next stage on the rank (see there) and the earlier
#: batches alive (:func:`earlier_batches`), in place of a :data:`Sent`.
Moment = tuple[int, str, tuple[Point, ...], tuple[bool, ...]]


#: The kinds of message :func:`buffered_by_kind` tells apart, by where a rank keeps it: an output
#: sent, an input gradient sent, a gradient received for an output, an input received.
SENT_OUTPUT, SENT_GRADIENT, POSTED_GRADIENT, POSTED_INPUT = range(4)


def by_size(counts: Sequence[int]) -> Sent:
    """Counts by kind (:data:`SENT_OUTPUT`, ...; :func:`buffered_by_kind`) as a stage's
    :data:`Sent`: its output-sized messages (sent outputs, received gradients) and its input-sized
    ones (sent input gradients, received inputs)."""
    return (
        counts[SENT_OUTPUT] + counts[POSTED_GRADIENT],
        counts[SENT_GRADIENT] + counts[POSTED_INPUT],
    )


def _positions(flat: FlatProgram) -> int:
    """Stages per rank of a program: positions ``stage // ranks``."""
    return int(flat.stage.max(initial=0)) // flat.ranks + 1


def unacknowledged(flat: FlatProgram) -> np.ndarray:
    """After each action of a program, its rank's sends not yet acknowledged by their peer:
    ``[action, position, (outputs, gradients)]``, by the stage that sent them (its position among
    the rank's stages, ``stage // ranks``; see :data:`Sent`).

    The executor keeps every message it posted, header and tensors, until it knows the peer has
    it (runtime/executor.py, ``Outbox``): each message carries how many messages its sender had
    taken in from the destination, and a rank reads that count when a receive action takes the
    message in, together with every earlier message from that peer (messages between two ranks
    arrive in send order). A flushing step's end waits for all of them. Since what a rank has
    taken in from a peer only grows, so does the count its messages carry: after a receive, the
    sends acknowledged are the first ones the newest message taken in so far counts.
    """
    return _unacknowledged_by_kind(flat, _positions(flat))[..., [SENT_OUTPUT, SENT_GRADIENT]]


def posted_receives(flat: FlatProgram, begins: Optional[np.ndarray] = None) -> np.ndarray:
    """After each action of a program, the receives its rank has posted and not yet read:
    ``[action, position, (outputs, inputs)]``, by the stage that will read each (its position
    among the rank's stages, ``stage // ranks``): a gradient for a stage's output, an activation
    for its input, each one message with its header (see :data:`Sent`).

    The executor posts the receive of a neighbour's next message beside (just after on a rank of
    one stage, just before on an interleaved rank; the same after the action) the rank's first
    send to that neighbour after the previous message was read, where that send comes before
    the rank's next receive action from the neighbour; else as soon as the previous message was
    read (the first: when the program starts), and none beyond the program's last
    (runtime/comm/mailbox.py, ``Mailbox._post_ahead``). With each, the receives of the
    activations that follow it from that neighbour are posted too, up to the first gradient or
    the first read after the rank's next backward (B, I or W) (``Mailbox.post_next``). Messages
    from a neighbour are read in send order, each by the first receive action that needs it or a
    later message; one taken in for a later message stays, whole, until the receive action that
    needs it reads it. A receive is sized for the message of its name in the step before
    (runtime/comm/p2p.py, ``Links``), which in steady training is its own size.

    ``begins``: per action, whether the executor starts a new program there (2BW's windows and
    drain, :func:`~lightning_pipe.planning.programs.program_begins`). A program posts only the
    receives it reads (``Mailbox``), so a message read in a later program than the one before it
    is posted no earlier than its own program's start (as a rank's first message is)."""
    return _posted_receives_by_kind(flat, _positions(flat), begins)[..., [POSTED_GRADIENT, POSTED_INPUT]]


def buffered(flat: FlatProgram, begins: Optional[np.ndarray] = None) -> np.ndarray:
    """After each action of a program, what its rank's buffers keep, by stage position as
    :data:`Sent` ``(output-sized, input-sized)`` messages, each with its header: the
    unacknowledged sends (:func:`unacknowledged`) and the posted receives (:func:`posted_receives`,
    ``begins`` there)."""
    return unacknowledged(flat) + posted_receives(flat, begins)


def buffered_by_kind(flat: FlatProgram, begins: Optional[np.ndarray] = None) -> np.ndarray:
    """:func:`buffered` by kind of message: after each action, ``[action, position, kind]``,
    counts of the rank's unacknowledged sends and posted receives by the position of the stage
    that sends or reads each and its kind (:data:`SENT_OUTPUT`, :data:`SENT_GRADIENT`,
    :data:`POSTED_GRADIENT`, :data:`POSTED_INPUT`; ``begins``: see :func:`posted_receives`).
    Each buffer is its own message's size: a receive is posted for, and a send packed into, the
    size the message of its name had in the step before (runtime/comm/p2p.py ``Links``), which in
    steady training is its own."""
    positions = _positions(flat)
    return _unacknowledged_by_kind(flat, positions) + _posted_receives_by_kind(flat, positions, begins)


def _unacknowledged_by_kind(flat: FlatProgram, positions: int) -> np.ndarray:
    """:func:`unacknowledged` by ``[action, position, kind]`` (see :func:`buffered_by_kind`)."""
    ranks = flat.ranks
    comm, channel, is_send = _channels(flat)
    # What each send carries: how many messages its rank had taken in from the peer.
    carries = np.zeros(len(flat.kind), np.int64)
    carries[comm] = _grouped_cummax(np.where(is_send, 0, flat.message[comm] + 1), channel)
    issued = _grouped_cumsum(is_send, channel)
    acked = _grouped_cummax(np.where(is_send, 0, carries[flat.source[comm]]), channel)
    # Each link's sends in send order, counted per sending stage's position and kind: the
    # unacknowledged ones after a message are those numbered from acked to issued.
    link_sends = comm[is_send]
    link_start = np.searchsorted(channel[is_send], channel)  # where each message's link begins among link_sends
    sender_position = flat.stage[link_sends] // ranks
    gradient = flat.kind[link_sends] == SEND_GRAD
    state = np.zeros((len(comm), positions, 4), np.int64)
    for o in range(positions):
        for kind, is_gradient in ((SENT_OUTPUT, False), (SENT_GRADIENT, True)):
            counted = (sender_position == o) & (gradient == is_gradient)
            prefix = np.concatenate(([0], np.cumsum(counted)))
            state[:, o, kind] = prefix[link_start + issued] - prefix[link_start + acked]
    # As changes after each action, summed along each rank's program.
    change = np.zeros((len(flat.kind), positions, 4), np.int64)
    first = np.concatenate(([True], channel[1:] != channel[:-1]))
    change[comm] = state - np.where(first[:, None, None], 0, np.roll(state, 1, axis=0))
    return _cumsum_per_rank(change, flat.starts)


def _posted_receives_by_kind(flat: FlatProgram, positions: int, begins: Optional[np.ndarray] = None) -> np.ndarray:
    """:func:`posted_receives` by ``[action, position, kind]`` (see :func:`buffered_by_kind`)."""
    ranks = flat.ranks
    program_start = _program_starts(flat, begins)
    change = np.zeros((len(flat.kind), positions, 4), np.int64)
    receive, send = flat.source >= 0, (flat.kind == SEND_ACT) | (flat.kind == SEND_GRAD)
    for r in range(ranks):
        lo, hi = int(flat.starts[r]), int(flat.starts[r + 1])
        peers = flat.peer[lo:hi]
        backwards = np.append(lo + np.flatnonzero(np.isin(flat.kind[lo:hi], (BACKWARD, INPUT_GRAD, WEIGHT_GRAD))), hi)
        for peer in np.unique(peers[receive[lo:hi]]):
            reads = lo + np.flatnonzero(receive[lo:hi] & (peers == peer))
            numbers = flat.message[reads]
            read_at = np.full(int(numbers.max()) + 1, hi, np.int64)
            read_at[numbers] = reads
            reader = read_at.copy()  # the action that needs each message
            # Message k is read by the first action that needs it or a later one.
            read_at = np.minimum.accumulate(read_at[::-1])[::-1]
            after = np.concatenate(([lo - 1], read_at[:-1]))  # the previous message's read
            # A program posts no receive it does not read: none before the start of the reading one.
            start = program_start[np.minimum(read_at, hi - 1)]
            after = np.maximum(after, start - 1)
            sends = np.append(lo + np.flatnonzero(send[lo:hi] & (peers == peer)), hi)
            next_send = sends[np.searchsorted(sends, after, side="right")]
            next_read = np.append(reads, hi)[np.searchsorted(reads, after, side="right")]
            beside_send = next_send < next_read
            posted_at = np.where(beside_send, next_send, np.maximum(after, start))
            readers = np.where(reader < hi, reader, read_at)
            known = readers < hi  # every message the program reads
            is_input = np.where(known, flat.kind[np.minimum(readers, hi - 1)] == RECV_ACT, False)
            anchor = np.where(beside_send, next_send, after)  # where the runtime looks ahead from
            until = backwards[np.searchsorted(backwards, anchor, side="right")]
            posted_at = _posted_with_activations_ahead(posted_at, until, readers, is_input & known, program_start)
            own = np.where(known, flat.stage[np.minimum(readers, hi - 1)] // ranks, 0)
            # A message taken in before the action that needs it (a later one's read waited for it)
            # is kept whole, as received, until that action reads it (``Mailbox.receive``).
            early = (posted_at < readers) & known
            kind = np.where(is_input, POSTED_INPUT, POSTED_GRADIENT)
            index = (own[early], kind[early])
            np.add.at(change, (posted_at[early], *index), 1)
            np.add.at(change, (readers[early], *index), -1)
    return _cumsum_per_rank(change, flat.starts)


def _posted_with_activations_ahead(
    posted_at: np.ndarray,
    next_backward: np.ndarray,
    readers: np.ndarray,
    is_input: np.ndarray,
    program_start: np.ndarray,
) -> np.ndarray:
    """When each message from one peer (in send order) is posted, where a receive posted one at a
    time would be at ``posted_at``, with ``next_backward`` the rank's first backward (B, I or W)
    after that posting: the activations that follow a posted receive, read before that backward
    and in the same program, are posted with it (``Mailbox.post_next``)."""
    out = posted_at.copy()
    chain_at, chain_end = -1, -1
    for k in range(len(out)):
        if k and is_input[k] and readers[k] < chain_end and program_start[readers[k]] <= chain_at:
            out[k] = chain_at
        else:
            chain_at, chain_end = int(posted_at[k]), int(next_backward[k])
    return out


def _program_starts(flat: FlatProgram, begins: Optional[np.ndarray]) -> np.ndarray:
    """Per action, the index of the first action of the executor program it belongs to: its
    rank's first, or the latest one ``begins`` marks at or before it."""
    marks = np.zeros(len(flat.kind), bool) if begins is None else begins.astype(bool).copy()
    marks[flat.starts[:-1][np.diff(flat.starts) > 0]] = True
    return np.maximum.accumulate(np.where(marks, np.arange(len(marks)), 0))


def _channels(flat: FlatProgram) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every send and receive of ``flat`` by channel (a rank and one peer, ``rank * ranks +
    peer``), then program order: their indices, their channels, and which are sends."""
    sent = (flat.kind == SEND_ACT) | (flat.kind == SEND_GRAD)
    comm = np.flatnonzero(sent | (flat.source >= 0))
    channel = flat.owner[comm] * flat.ranks + flat.peer[comm]
    order = np.lexsort((comm, channel))
    return comm[order], channel[order], sent[comm[order]]


def _grouped_cummax(values: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """Running maximum of nonnegative ``values`` within each run of equal, sorted ``groups``."""
    if not len(values):
        return values
    offset = groups * (int(values.max()) + 1)
    return np.maximum.accumulate(values + offset) - offset


def _grouped_cumsum(flags: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """Running count of ``flags`` within each run of equal, sorted ``groups``."""
    total = np.cumsum(flags)
    first = np.searchsorted(groups, groups)
    return total - (total[first] - flags[first])


def _cumsum_per_rank(change: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Running sums of ``change`` along its first axis, restarted at each rank's first action."""
    total = np.cumsum(change, axis=0)
    before = np.concatenate((np.zeros_like(total[:1]), total))[starts[:-1]]  # the sum before each rank
    return total - np.repeat(before, np.diff(starts), axis=0)


def _dominant(points: Iterable[Point]) -> tuple[Point, ...]:
    """The points that can be a peak: among those with the same unacknowledged sends, those no
    other point holding at least as many microbatches beats on pending in either direction (the
    two Pareto frontiers). A moment's bytes are a nondecreasing function of held plus a convex
    one of pending (pending microbatches add captured gradients but no longer keep their
    outputs), so a point between two kept ones in pending, holding no more than either, is
    never above both. Points that another of the same pending count covers
    (:func:`_uncovered`), then points on a segment between two others
    (:func:`_ends_of_segments`) go first."""
    groups: dict[Sent, set[Point]] = {}
    for point in _ends_of_segments(_uncovered(points)):
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


def _uncovered(points: Iterable[Point]) -> list[Point]:
    """``points`` without those another point of the same pending count covers: as many held
    microbatches or more, and as many unacknowledged outputs and gradients or more. At one kind
    of moment and pending count a stage's bytes never fall as those grow."""
    by_pending: dict[tuple[int, ...], list[tuple[int, int, int]]] = {}
    for h, p, (o, g, *rest) in set(points):
        by_pending.setdefault((p, *rest), []).append((h, o, g))
    kept: list[Point] = []
    for (pending, *rest), triples in by_pending.items():
        # Held most first: a point can only be covered by one before it, if one of those has as
        # many outputs and gradients. Their (outputs, gradients) Pareto front answers that:
        # outputs ascending, gradients descending.
        front_outputs: list[int] = []
        front_gradients: list[int] = []
        for h, o, g in sorted(triples, reverse=True):
            i = bisect.bisect_left(front_outputs, o)
            if i < len(front_outputs) and front_gradients[i] >= g:
                continue
            kept.append((h, pending, (o, g, *rest)))
            j = bisect.bisect_right(front_outputs, o)
            k = i  # the front's points this one covers: outputs at most o, gradients at most g
            while k > 0 and front_gradients[k - 1] <= g:
                k -= 1
            front_outputs[k:j], front_gradients[k:j] = [o], [g]
    return kept


def _ends_of_segments(points: Iterable[Point]) -> list[Point]:
    """``points`` without those that lie between two others of the same pending count on a
    straight line through (held, outputs, gradients): at one kind of moment and pending count a
    stage's bytes are affine in those three (every held microbatch is at least at its backward,
    see :func:`stage_memory_terms`), so such a point is never above both ends. A pipeline's
    drain walks such lines (each backward frees a microbatch and sends its input gradient)."""
    by_pending: dict[tuple[int, ...], set[tuple[int, int, int]]] = {}
    for h, p, (o, g, *rest) in points:
        by_pending.setdefault((p, *rest), set()).add((h, o, g))
    kept: list[Point] = []
    for (pending, *rest), triples in by_pending.items():
        stack: list[tuple[int, int, int]] = []
        for h, o, g in sorted(triples):
            while len(stack) >= 2 and _between(stack[-2], stack[-1], (h, o, g)):
                stack.pop()
            stack.append((h, o, g))
        kept += [(h, pending, (o, g, *rest)) for h, o, g in stack]
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
    backward (or, under split backward, its first W) on; a flushing step starts without them.
    Under 2BW, whose batches' gradients live across windows, "cold" and "first" moments are those
    before the moment's own batch has gradients (another batch's may exist: the memory model
    counts those, :func:`~lightning_pipe.planning.costs.gradient_sets`).

    Attributes:
        forward_cold: after a forward, before gradients exist.
        forward_warm: after a forward, once gradients exist.
        backward_first: at the backward that creates the gradients.
        backward_warm: at any later backward or input gradient.
        input_cold: at an input gradient (split backward) before any W created gradients.
        optimizer_step: at the optimizer step.
        weight_first: at the W (split backward) that creates the gradients.
        weight_warm: at any later W.
        input_sent_cold: at the send of an input gradient that follows its I (an interleaved
            rank's moments, :func:`rank_moments`), before any W created gradients.
        input_sent_warm: at such a send once gradients exist.
    """

    forward_cold: tuple[Point, ...] = ()
    forward_warm: tuple[Point, ...] = ()
    backward_first: tuple[Point, ...] = ()
    backward_warm: tuple[Point, ...] = ()
    input_cold: tuple[Point, ...] = ()
    optimizer_step: tuple[Point, ...] = ()
    weight_first: tuple[Point, ...] = ()
    weight_warm: tuple[Point, ...] = ()
    input_sent_cold: tuple[Point, ...] = ()
    input_sent_warm: tuple[Point, ...] = ()

    def __hash__(self) -> int:
        return self._hash

    @functools.cached_property
    def _hash(self) -> int:  # computed once: the planner keys caches by counts
        return hash(tuple(getattr(self, name) for name in self.__dataclass_fields__))

    @functools.cached_property
    def full_backwards(self) -> tuple[Point, ...]:
        """The points of :attr:`backward_warm` at a full backward (none pending: an I has some)."""
        return tuple(point for point in self.backward_warm if point[1] == 0)

    @functools.cached_property
    def split_backwards(self) -> tuple[Point, ...]:
        """The points of :attr:`backward_warm` at an I."""
        return tuple(point for point in self.backward_warm if point[1] > 0)

    @property
    def peak(self) -> int:
        """Most microbatches held at any moment."""
        points = (
            self.forward_cold
            + self.forward_warm
            + self.backward_first
            + self.backward_warm
            + self.input_cold
            + self.optimizer_step
            + self.weight_first
            + self.weight_warm
        )
        return max((point[0] for point in points), default=0)


#: The kind of moment an action makes of its stage, before and after the stage's gradients exist.
_MOMENT_KINDS = {
    Kind.FORWARD: ("forward_cold", "forward_warm"),
    Kind.BACKWARD: ("backward_first", "backward_warm"),
    Kind.INPUT_GRAD: ("input_cold", "backward_warm"),
    Kind.WEIGHT_GRAD: ("weight_first", "weight_warm"),
    Kind.OPTIMIZER_STEP: ("optimizer_step", "optimizer_step"),
}


def _walk(
    actions: Sequence[Action],
    position: Callable[[int], int],
    count: int,
    streamed: int = 0,
    sent: Optional[np.ndarray] = None,
    lean: Optional[Sequence[bool]] = None,
    shared: bool = False,
    at_sends: Optional[dict[int, np.ndarray]] = None,
) -> Iterator[Moment]:
    """Every moment of a rank's program over ``count`` stages (``position``: a stage's index among
    them): a forward takes a microbatch in, a backward (or, under split backward, its W) lets it
    go; an input gradient moves it to pending until its W. Gradients exist from a stage's
    first backward or W on; with ``streamed`` (2BW's microbatches per batch), a moment is warm
    once its own batch's first backward or W has run (:func:`batch_has_gradients`). ``sent``:
    the rank's rows of :func:`unacknowledged` (``None``: none counted). ``lean``: per action,
    whether a warm forward or I finds its own batch's gradients alone (:func:`lone_gradients`):
    it is then counted as a cold one, which carries one batch's. With ``streamed`` each stage's
    entry of the moment's gradients counts the batches whose gradients live there (:func:`live_sets`).
    ``shared``: a batch's gradients live in replica buckets its rank's stages share, made whole by
    the batch's first backward or W on any of them (runtime/buckets.py; an I's gradients wait in
    its work for W): with ``streamed`` a moment is warm, and each stage's entry counts, as the rank's.
    ``at_sends``: per I followed by the send of its input gradient, the rank's row of ``sent`` at
    that send: a moment of its own follows the I's (``input_sent_cold``/``input_sent_warm``)."""
    held, pending, grads = [0] * count, [0] * count, [False] * count
    batches: list[set[int]] = [set()] * count if shared else [set() for _ in range(count)]
    live: list[set[int]] = [set()] * count if shared else [set() for _ in range(count)]
    stepped = 0
    rows = sent.tolist() if sent is not None else None
    f, b, ig, w, o = (
        Kind.FORWARD,
        Kind.BACKWARD,
        Kind.INPUT_GRAD,
        Kind.WEIGHT_GRAD,
        Kind.OPTIMIZER_STEP,
    )  # by identity: Enum hashing is slow
    for i, a in enumerate(actions):
        k = a.kind
        if k is f or k is b or k is ig or k is w or k is o:
            c = position(a.stage)
            if k is f:
                held[c] += 1
            elif k is ig:
                pending[c] += 1
            now = tuple(map(tuple, rows[i])) if rows else (NOTHING_SENT,) * count
            warm = grads[c] if not streamed or a.microbatch is None else a.microbatch // streamed in batches[c]
            warm = warm and not (lean is not None and lean[i])
            sets = tuple(map(len, live)) if streamed else tuple(grads)
            yield c, _MOMENT_KINDS[k][warm], tuple(zip(held, pending, now)), sets
            if at_sends is not None and i in at_sends:
                row = tuple(map(tuple, at_sends[i].tolist()))
                yield c, ("input_sent_warm" if warm else "input_sent_cold"), tuple(zip(held, pending, row)), sets
            if k is b or k is w:
                grads[c], held[c], pending[c] = True, held[c] - 1, pending[c] - (k is w)
                if streamed:
                    batches[c].add(a.microbatch // streamed)
                    live[c].add(a.microbatch // streamed)
            elif k is o and streamed:
                stepped = live_sets(live, stepped)


def live_sets(live: list[set[int]], stepped: int) -> int:
    """A 2BW rank's optimizer step: it steps the oldest batch's gradients (batch ``stepped``; the
    update of batch ``t - 1`` deferred to batch ``t``'s window, PipeDream-2BW paper, section 3.1),
    which then no longer live on any of its stages (``live``: per stage, the batches whose
    gradients live there). Returns the next batch to step."""
    for batches in live:
        batches.discard(stepped)
    return stepped + 1


def held_counts(actions: Sequence[Action], streamed: int = 0, sent: Optional[np.ndarray] = None) -> HeldCounts:
    """The points of each kind of moment of a one-stage rank's program (see :func:`_walk`)."""
    seen: dict[str, set[Point]] = {name: set() for name in HeldCounts.__dataclass_fields__}
    lean = _lean_actions(actions, streamed) if streamed else None
    if streamed:  # each point's sends followed by the batches before the newest still alive
        rows = np.zeros((len(actions), 1, 2), np.int64) if sent is None else sent
        sent = np.concatenate((rows, _earlier_batches_walk(actions, streamed)[:, None, None]), axis=2)
    for _, kind, points, _ in _walk(actions, lambda stage: 0, 1, streamed, sent, lean):
        seen[kind].add(points[0])
    return HeldCounts(**{name: _dominant(points) for name, points in seen.items()})


#: :class:`HeldCounts` fields by number, and the number of each compute kind's moment before and
#: after its stage's gradients exist (:data:`_MOMENT_KINDS`).
_FIELDS = tuple(HeldCounts.__dataclass_fields__)


_MOMENT_CODES = np.full((len(CODES), 2), -1)
for _kind, _names in _MOMENT_KINDS.items():
    _MOMENT_CODES[CODES[_kind]] = [_FIELDS.index(name) for name in _names]


def batch_has_gradients(flat: FlatProgram, release: np.ndarray, microbatches: int) -> np.ndarray:
    """Per action of a streamed (2BW) program, whether its batch (``microbatches`` a batch) already
    has gradients on its rank: a backward or W of that batch ran before it there (PipeDream-2BW
    paper, section 3.1: each batch accumulates into its own weight version's gradients)."""
    return _batch_releases(flat, release, microbatches) - release > 0


def _batch_releases(flat: FlatProgram, release: np.ndarray, microbatches: int) -> np.ndarray:
    """Per action, the ``release`` actions of its batch on its rank up to it (itself included)."""
    batch = np.where(flat.microbatch >= 0, flat.microbatch // microbatches, -1) + 1
    key = flat.owner * (int(batch.max(initial=0)) + 1) + batch
    order = np.lexsort((np.arange(len(key)), key))
    before = np.empty(len(key), dtype=np.int64)
    before[order] = _grouped_cumsum(release[order].astype(np.int64), key[order])
    return before


def earlier_batches(flat: FlatProgram, microbatches: int) -> np.ndarray:
    """Per action of a streamed (2BW) program, the batches before the newest its rank took in that
    are still alive there. Each window's step takes its batch in (the VERSION actions opening the
    window, one per stage of the rank); the executor keeps a batch's microbatches, views of it,
    until the rank's lowest stage has run each one's I or backward (runtime/executor.py
    ``_keep_input_grads``), and on the first stage its saved tensors (an embedding's indices) keep
    them until its W, there the whole backward. A window thus starts beside the batch before,
    alive until its last such action."""
    kind, starts = flat.kind, flat.starts
    opens = kind == VERSION
    admitted = _cumsum_per_rank(opens & (_batch_releases(flat, opens, microbatches) == 1), starts)
    lowest = np.repeat(np.minimum.reduceat(flat.stage, starts[:-1]), np.diff(starts))
    releases = np.where(lowest == 0, kind == WEIGHT_GRAD, kind == INPUT_GRAD)
    frees = (flat.stage == lowest) & ((kind == BACKWARD) | releases)
    last = frees & (_batch_releases(flat, frees, microbatches) == microbatches)
    freed = _cumsum_per_rank(last, starts) - last  # batches gone before each action
    return np.maximum(admitted - freed - 1, 0)


def _earlier_batches_walk(actions: Sequence[Action], streamed: int) -> np.ndarray:
    """:func:`earlier_batches` walked over one rank's actions (the reference for the arrays)."""
    lowest = min(a.stage for a in actions)
    freeing = (Kind.BACKWARD, Kind.WEIGHT_GRAD if lowest == 0 else Kind.INPUT_GRAD)
    admitted: set[int] = set()
    gone, out = 0, []
    left: dict[int, int] = {}  # per batch, its microbatches not yet let go
    for a in actions:
        if a.kind is Kind.VERSION:
            admitted.add(a.microbatch // streamed)
        out.append(max(len(admitted) - gone - 1, 0))
        if a.stage == lowest and a.kind in freeing:
            batch = a.microbatch // streamed
            left[batch] = left.get(batch, streamed) - 1
            gone += left[batch] == 0
    return np.array(out, np.int64)


def lone_gradients(flat: FlatProgram, release: np.ndarray, microbatches: int) -> np.ndarray:
    """Per action of a streamed (2BW) program, whether fewer batches' gradients live on its rank
    than the most its program ever holds: batches whose first backward or W ran before it there,
    less the optimizer steps before it (each steps the oldest: PipeDream-2BW paper, section 3.1,
    the update of batch ``t - 1`` deferred to batch ``t``'s window). At a warm moment where that
    count is short, the batch before has been stepped and its gradients are gone: only the
    moment's own batch's exist, as at a cold moment (which carries the other one's)."""
    starts = release & (_batch_releases(flat, release, microbatches) == 1)  # a batch's first backward or W on its rank
    steps = flat.kind == OPTIMIZER_STEP
    live = _cumsum_per_rank(starts, flat.starts) - _cumsum_per_rank(steps, flat.starts) + steps
    most = np.maximum.reduceat(live, flat.starts[:-1]) if len(live) else live
    return live - starts < np.repeat(most, np.diff(flat.starts))


def _lean(flat: FlatProgram, streamed: int) -> np.ndarray:
    """Per action of a streamed program of one stage per rank: a forward, or an I past the first
    stage, that finds only its own batch's gradients (:func:`lone_gradients`). Such a moment
    holds what a cold one does; a W or a first stage's I (its whole backward) keeps its kind."""
    kind = flat.kind
    release = (kind == BACKWARD) | (kind == WEIGHT_GRAD)
    at = (kind == FORWARD) | ((kind == INPUT_GRAD) & (flat.stage > 0))
    return lone_gradients(flat, release, streamed) & at


def _lean_actions(actions: Sequence[Action], streamed: int) -> list[bool]:
    """:func:`_lean` walked over one rank's actions (the reference for the arrays)."""
    started: set[int] = set()
    stepped, live = 0, []
    for a in actions:
        live.append(len(started) - stepped)
        if a.kind is Kind.BACKWARD or a.kind is Kind.WEIGHT_GRAD:
            started.add(a.microbatch // streamed)
        stepped += a.kind is Kind.OPTIMIZER_STEP
    most = max(live + [len(started) - stepped])
    return [
        n < most and (a.kind is Kind.FORWARD or (a.kind is Kind.INPUT_GRAD and a.stage > 0))
        for n, a in zip(live, actions)
    ]


def program_held_counts(
    program: Sequence[Sequence[Action]],
    streamed: int = 0,
    flat: Optional[FlatProgram] = None,
    begins: Optional[np.ndarray] = None,
) -> list[HeldCounts]:
    """:func:`held_counts` of every rank of a program of one stage per rank, with its
    :func:`buffered` sends and receives: the same walk on arrays (the planner walks millions of actions).
    ``streamed``: 2BW's microbatches per batch (see :func:`_walk`); ``begins``: where the executor
    starts each of its programs (see :func:`posted_receives`)."""
    flat = flat or flatten(program)
    kind, starts = flat.kind, flat.starts
    f, b, i, w, o = (kind == code for code in (FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD, OPTIMIZER_STEP))
    release = b | w  # after its moment, the microbatch lets go
    released = _cumsum_per_rank(release, starts)
    held = _cumsum_per_rank(f, starts) - released + release
    pending = _cumsum_per_rank(i, starts) - _cumsum_per_rank(w, starts) + w
    grads = batch_has_gradients(flat, release, streamed) if streamed else released - release > 0
    if streamed:
        grads = grads & ~_lean(flat, streamed)
    sent = buffered(flat, begins)[:, 0, :]
    at = np.flatnonzero(f | b | i | w | o)
    columns = [
        flat.owner[at],
        _MOMENT_CODES[kind[at], grads[at].astype(np.int64)],
        held[at],
        pending[at],
        sent[at, 0],
        sent[at, 1],
    ]
    if streamed:  # the batches before the newest still alive follow the sends (see :data:`Sent`)
        columns.append(earlier_batches(flat, streamed)[at])
    seen: list[dict[str, set[Point]]] = [{name: set() for name in _FIELDS} for _ in range(flat.ranks)]
    for r, moment, h, p, *sends in _unique_rows(columns):
        seen[r][_FIELDS[moment]].add((h, p, tuple(sends)))
    return [HeldCounts(**{name: _dominant(points) for name, points in mine.items()}) for mine in seen]


def _unique_rows(columns: Sequence[np.ndarray]) -> list[tuple[int, ...]]:
    """The distinct rows of nonnegative integer ``columns``, as tuples."""
    bases = [int(c.max(initial=0)) + 1 for c in columns]
    if math.prod(bases) >= 1 << 63:
        return [tuple(row) for row in np.unique(np.stack(columns, axis=1), axis=0).tolist()]
    key = np.zeros(len(columns[0]), np.int64)
    for c, base in zip(columns, bases):  # one integer per row, mixed radix
        key = key * base + c
    key, digits = np.unique(key), []
    for base in reversed(bases):
        key, digit = np.divmod(key, base)
        digits.append(digit.tolist())
    return list(zip(*reversed(digits)))


def rank_moments(
    actions: Sequence[Action],
    stages: Sequence[int],
    sent: Optional[np.ndarray] = None,
    streamed: int = 0,
    shared: bool = False,
) -> tuple[Moment, ...]:
    """The distinct moments of one rank's program over its ``stages``, in program order (see
    :func:`_walk`; every stage's counts at each, where :func:`held_counts` keeps one stage's).
    ``streamed``: a 2BW stream's microbatches per batch (a moment is warm once its own batch has
    gradients, see :func:`_walk`; ``shared``: in replica buckets the rank's stages share, see there).

    ``sent``: the rank's rows of :func:`buffered_by_kind` (or of :func:`buffered`); with the
    former each stage's counts end with its output-sized tensors kept for the next stage on the
    rank (its :func:`handed_gradients` and :func:`outputs_kept_for_weight_grads`), then (on the
    first position, in a 2BW stream) the rank's :func:`earlier_batches` alive."""
    index = {s: c for c, s in enumerate(stages)}
    at_sends = None
    if sent is not None and sent.ndim == 3 and sent.shape[2] == 4:  # by kind (buffered_by_kind)
        sent, sends = _posted_with_sends(actions, sent), _posted_at_input_grad_sends(actions, sent)
        earlier = np.zeros((len(actions), len(stages)), np.int64)
        if streamed:  # the rank's earlier batches alive, once: on its first position
            earlier[:, 0] = _earlier_batches_walk(actions, streamed)
        handed, (during, after) = handed_gradients(actions, index), outputs_kept_for_weight_grads(actions, index)
        sent = np.concatenate((sent, np.stack((handed + during, earlier), axis=2)), axis=2)
        # At the send after an I that I has ended: its stage keeps its output only for the next stage's W.
        tail = np.stack((handed + after, earlier), axis=2)
        at_sends = {i: np.concatenate((row, tail[i]), axis=1) for i, row in sends.items()}
    walk = _walk(actions, index.__getitem__, len(stages), streamed, sent, shared=shared, at_sends=at_sends)
    return tuple(dict.fromkeys(walk))


def _posted_at_input_grad_sends(actions: Sequence[Action], rows: np.ndarray) -> dict[int, np.ndarray]:
    """Per I followed by the send of its input gradient, a rank's :func:`buffered_by_kind` row at
    that send: an interleaved rank posts the receive of that neighbour's next message just before
    the send (:func:`posted_receives`), beside the message the send packs (counted with the I,
    ``memory.stage_memory_terms``), so the I's row gains what the send posts but the message."""
    out = {}
    kinds = np.arange(rows.shape[2])
    for i in range(len(actions) - 1):
        a, b = actions[i], actions[i + 1]
        same = (b.stage, b.microbatch) == (a.stage, a.microbatch)
        if a.kind is Kind.INPUT_GRAD and b.kind is Kind.SEND_GRAD and same:
            posted = np.maximum(rows[i + 1] - rows[i], 0)
            posted[:, kinds == SENT_GRADIENT] = 0
            out[i] = rows[i] + posted
    return out


def _posted_with_sends(actions: Sequence[Action], rows: np.ndarray) -> np.ndarray:
    """A rank's :func:`buffered_by_kind` rows, a forward's moment taken at the send of its output
    that follows it: there an interleaved rank posts the receive of that neighbour's next message
    just before the send (:func:`posted_receives`), beside the message the send packs (counted
    with the forward, ``memory.stage_memory_terms``), so the forward's row gains what the send
    posts but the output it sends."""
    out = rows.copy()
    kinds = np.arange(rows.shape[2])
    for i in range(len(actions) - 1):
        a, b = actions[i], actions[i + 1]
        if a.kind is Kind.FORWARD and b.kind is Kind.SEND_ACT and (b.stage, b.microbatch) == (a.stage, a.microbatch):
            posted = np.maximum(rows[i + 1] - rows[i], 0)
            posted[:, kinds == SENT_OUTPUT] = 0
            out[i] = rows[i] + posted
    return out


def handed_gradients(actions: Sequence[Action], index: dict[int, int]) -> np.ndarray:
    """During each action of a rank's program, per stage position (``index``: a stage's position
    among the rank's), the gradients of its outputs that the next stage, run by the same rank
    (the V placement's turn), handed over and that wait for the stage's backward (or I): each is
    that stage's input gradient, made by its backward (or I) and kept, no message, until the
    stage's own backward (or I) takes it as its root's gradient (runtime/executor.py,
    ``_roots``). The one a backward runs from is its workspace's, not counted here."""
    out = np.zeros((len(actions), len(index)), np.int64)
    waiting = [0] * len(index)
    for i, a in enumerate(actions):
        runs_backward = a.kind is Kind.BACKWARD or a.kind is Kind.INPUT_GRAD
        if runs_backward and a.stage + 1 in index:
            waiting[index[a.stage]] -= 1
        out[i] = waiting
        if runs_backward and a.stage - 1 in index:
            waiting[index[a.stage - 1]] += 1
    return out


def outputs_kept_for_weight_grads(actions: Sequence[Action], index: dict[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """During and after each action of a rank's program, per stage position (``index``: a stage's
    position among the rank's), the outputs of that stage that it no longer keeps but the next
    stage, run by the same rank (the V placement's turn), still does: that stage's input is the
    output itself, no message (runtime/executor.py, ``_roots``), and a microbatch whose I ran
    there keeps it for its W (the input of a deferred call, or of a weight whose gradient I
    computes: a LayerNorm's; an upper bound where its first block keeps none). The stage counts
    its output until its I ends (on the first stage, whose I is empty, until its W; until a full
    backward ends either way: ``memory.stage_memory_terms``); from then on the next stage's
    pending microbatch keeps it, until its W ends. So a microbatch counts here from the end of its
    stage's I (or W, or backward) to the end of the next stage's W, where that comes later."""
    during = np.zeros((len(actions), len(index)), np.int64)
    after = np.zeros_like(during)
    if not any(s + 1 in index for s in index):  # no turn on this rank
        return during, after
    released: list[set[int]] = [set() for _ in index]  # per position, microbatches whose output it let go
    waiting: list[set[int]] = [set() for _ in index]  # per position, microbatches the next stage's W still needs
    for i, a in enumerate(actions):
        during[i] = [len(r & w) for r, w in zip(released, waiting)]
        own = index.get(a.stage)
        if a.kind is Kind.INPUT_GRAD and a.stage - 1 in index:
            waiting[index[a.stage - 1]].add(a.microbatch)
        elif a.kind in (Kind.WEIGHT_GRAD, Kind.BACKWARD) and a.stage - 1 in index:
            waiting[index[a.stage - 1]].discard(a.microbatch)
        lets_go = Kind.WEIGHT_GRAD if a.stage == 0 else Kind.INPUT_GRAD
        if own is not None and a.stage + 1 in index and a.kind in (lets_go, Kind.BACKWARD):
            released[own].add(a.microbatch)
        after[i] = [len(r & w) for r, w in zip(released, waiting)]
    return during, after
