"""Peak tensor memory of one pipeline stage: what its program holds at each kind of moment, by term."""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Optional, Sequence

import numpy as np

from lightning_pipe.runtime.comm.p2p import HEADER_BYTES
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

#: The global gradient norm's square, a float32 scalar each rank keeps from its all-reduce to the
#: optimizer step that reads it (runtime/update.py).
GRADIENT_NORM_BYTES = 4

if TYPE_CHECKING:
    from lightning_pipe.planning.costs import StageCosts

#: ``(outputs, gradients)``: a stage's sends not yet acknowledged by their peer (see
#: :func:`unacknowledged`), outputs sent downstream and input gradients sent upstream. Once a
#: link's shapes are known each is one message, its header (:data:`HEADER_BYTES`) and a copy of
#: its tensors packed (runtime/comm/p2p.py), kept until acknowledged: the header and an output's
#: bytes, or the header and an input's. (The stage keeps a sent output itself too, until its
#: backward, which needs the peer's gradient for it, and that message acknowledges it.) Where
#: headers take a CPU side channel (NCCL) nothing is packed: there these terms, the headers kept
#: with received inputs and gradients, and a forward's packed copy, are an upper bound.
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
    ranks = flat.ranks
    comm, channel, is_send = _channels(flat)
    # What each send carries: how many messages its rank had taken in from the peer.
    carries = np.zeros(len(flat.kind), np.int64)
    carries[comm] = _grouped_cummax(np.where(is_send, 0, flat.message[comm] + 1), channel)
    issued = _grouped_cumsum(is_send, channel)
    acked = _grouped_cummax(np.where(is_send, 0, carries[flat.source[comm]]), channel)
    # Each link's sends in send order, counted per sending stage's position: the unacknowledged
    # ones after a message are those numbered from acked to issued.
    link_sends = comm[is_send]
    link_start = np.searchsorted(channel[is_send], channel)  # where each message's link begins among link_sends
    sender_position = flat.stage[link_sends] // ranks
    gradient = flat.kind[link_sends] == SEND_GRAD
    state = np.zeros((len(comm), int(flat.stage.max(initial=0)) // ranks + 1, 2), np.int64)
    for o in range(state.shape[1]):
        for j, counted in enumerate(((sender_position == o) & ~gradient, (sender_position == o) & gradient)):
            prefix = np.concatenate(([0], np.cumsum(counted)))
            state[:, o, j] = prefix[link_start + issued] - prefix[link_start + acked]
    # As changes after each action, summed along each rank's program.
    change = np.zeros((len(flat.kind), *state.shape[1:]), np.int64)
    first = np.concatenate(([True], channel[1:] != channel[:-1]))
    change[comm] = state - np.where(first[:, None, None], 0, np.roll(state, 1, axis=0))
    return _cumsum_per_rank(change, flat.starts)


def posted_receives(flat: FlatProgram) -> np.ndarray:
    """After each action of a program, the receives its rank has posted and not yet read:
    ``[action, position, (outputs, inputs)]``, by the stage that will read each (its position
    among the rank's stages, ``stage // ranks``): a gradient for a stage's output, an activation
    for its input, each one message with its header (see :data:`Sent`).

    The executor posts the receive of a neighbour's next message beside (just after on a rank of
    one stage, just before on an interleaved rank; the same after the action) the rank's first
    send to that neighbour after the previous message was read, where that send comes before
    the rank's next receive action from the neighbour; else as soon as the previous message was
    read (the first: when the program starts), and none beyond the program's last
    (runtime/executor.py, ``Executor._post_ahead``). Messages from a neighbour are read in send
    order, each by the first receive action that needs it or a later message. A receive is
    sized for the link's last message of its kind; on a rank of several stages counting it at
    the size of the stage that reads it is exact when those stages' sizes agree. Over 2BW's windows,
    which the executor runs as separate programs,
    a receive posted by a send in the window before its own is an upper bound."""
    ranks = flat.ranks
    change = np.zeros((len(flat.kind), int(flat.stage.max(initial=0)) // ranks + 1, 2), np.int64)
    receive, send = flat.source >= 0, (flat.kind == SEND_ACT) | (flat.kind == SEND_GRAD)
    for r in range(ranks):
        lo, hi = int(flat.starts[r]), int(flat.starts[r + 1])
        peers = flat.peer[lo:hi]
        for peer in np.unique(peers[receive[lo:hi]]):
            reads = lo + np.flatnonzero(receive[lo:hi] & (peers == peer))
            numbers = flat.message[reads]
            read_at = np.full(int(numbers.max()) + 1, hi, np.int64)
            read_at[numbers] = reads
            reader = read_at.copy()  # the action that needs each message
            # Message k is read by the first action that needs it or a later one.
            read_at = np.minimum.accumulate(read_at[::-1])[::-1]
            after = np.concatenate(([lo - 1], read_at[:-1]))  # the previous message's read
            sends = np.append(lo + np.flatnonzero(send[lo:hi] & (peers == peer)), hi)
            next_send = sends[np.searchsorted(sends, after, side="right")]
            next_read = np.append(reads, hi)[np.searchsorted(reads, after, side="right")]
            posted_at = np.where(next_send < next_read, next_send, np.maximum(after, lo))
            early = posted_at < read_at
            readers = np.where(reader < hi, reader, read_at)[early]
            index = (flat.stage[readers] // ranks, np.where(flat.kind[readers] == RECV_ACT, 1, 0))
            np.add.at(change, (posted_at[early], *index), 1)
            np.add.at(change, (read_at[early], *index), -1)
    return _cumsum_per_rank(change, flat.starts)


def buffered(flat: FlatProgram) -> np.ndarray:
    """After each action of a program, what its rank's buffers keep, by stage position as
    :data:`Sent` ``(output-sized, input-sized)`` messages, each with its header: the
    unacknowledged sends (:func:`unacknowledged`) and the posted receives (:func:`posted_receives`)."""
    return unacknowledged(flat) + posted_receives(flat)


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
    by_pending: dict[int, list[tuple[int, int, int]]] = {}
    for h, p, (o, g) in set(points):
        by_pending.setdefault(p, []).append((h, o, g))
    kept: list[Point] = []
    for pending, triples in by_pending.items():
        # Held most first: a point can only be covered by one before it, if one of those has as
        # many outputs and gradients. Their (outputs, gradients) Pareto front answers that:
        # outputs ascending, gradients descending.
        front_outputs: list[int] = []
        front_gradients: list[int] = []
        for h, o, g in sorted(triples, reverse=True):
            i = bisect.bisect_left(front_outputs, o)
            if i < len(front_outputs) and front_gradients[i] >= g:
                continue
            kept.append((h, pending, (o, g)))
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
    by_pending: dict[int, set[tuple[int, int, int]]] = {}
    for h, p, (o, g) in points:
        by_pending.setdefault(p, set()).add((h, o, g))
    kept: list[Point] = []
    for pending, triples in by_pending.items():
        stack: list[tuple[int, int, int]] = []
        for h, o, g in sorted(triples):
            while len(stack) >= 2 and _between(stack[-2], stack[-1], (h, o, g)):
                stack.pop()
            stack.append((h, o, g))
        kept += [(h, pending, (o, g)) for h, o, g in stack]
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
        backward_warm: at any later backward or input gradient.
        input_cold: at an input gradient (split backward) before any W created gradients.
        optimizer_step: at the optimizer step.
        weight_first: at the W (split backward) that creates the gradients.
        weight_warm: at any later W.
    """

    forward_cold: tuple[Point, ...] = ()
    forward_warm: tuple[Point, ...] = ()
    backward_first: tuple[Point, ...] = ()
    backward_warm: tuple[Point, ...] = ()
    input_cold: tuple[Point, ...] = ()
    optimizer_step: tuple[Point, ...] = ()
    weight_first: tuple[Point, ...] = ()
    weight_warm: tuple[Point, ...] = ()

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
    warm: bool = False,
    sent: Optional[np.ndarray] = None,
) -> Iterator[Moment]:
    """Every moment of a rank's program over ``count`` stages (``position``: a stage's index among
    them): a forward takes a microbatch in, a backward (or, under split backward, its W) lets it
    go; an input gradient moves it to pending until its W. Gradients exist from a stage's
    first backward or W on (from the start if ``warm``). ``sent``: the rank's rows of
    :func:`unacknowledged` (``None``: none counted)."""
    held, pending, grads = [0] * count, [0] * count, [warm] * count
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
            yield c, _MOMENT_KINDS[k][grads[c]], tuple(zip(held, pending, now)), tuple(grads)
            if k is b or k is w:
                grads[c], held[c], pending[c] = True, held[c] - 1, pending[c] - (k is w)


def held_counts(actions: Sequence[Action], warm: bool = False, sent: Optional[np.ndarray] = None) -> HeldCounts:
    """The points of each kind of moment of a one-stage rank's program (see :func:`_walk`)."""
    seen: dict[str, set[Point]] = {name: set() for name in HeldCounts.__dataclass_fields__}
    for _, kind, points, _ in _walk(actions, lambda stage: 0, 1, warm, sent):
        seen[kind].add(points[0])
    return HeldCounts(**{name: _dominant(points) for name, points in seen.items()})


#: :class:`HeldCounts` fields by number, and the number of each compute kind's moment before and
#: after its stage's gradients exist (:data:`_MOMENT_KINDS`).
_FIELDS = tuple(HeldCounts.__dataclass_fields__)
_MOMENT_CODES = np.full((len(CODES), 2), -1)
for _kind, _names in _MOMENT_KINDS.items():
    _MOMENT_CODES[CODES[_kind]] = [_FIELDS.index(name) for name in _names]


def program_held_counts(
    program: Sequence[Sequence[Action]], warm: bool = False, flat: Optional[FlatProgram] = None
) -> list[HeldCounts]:
    """:func:`held_counts` of every rank of a program of one stage per rank, with its
    :func:`buffered` sends and receives: the same walk on arrays (the planner walks millions of actions)."""
    flat = flat or flatten(program)
    kind, starts = flat.kind, flat.starts
    f, b, i, w, o = (kind == code for code in (FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD, OPTIMIZER_STEP))
    release = b | w  # after its moment, the microbatch lets go
    released = _cumsum_per_rank(release, starts)
    held = _cumsum_per_rank(f, starts) - released + release
    pending = _cumsum_per_rank(i, starts) - _cumsum_per_rank(w, starts) + w
    grads = (released - release > 0) | warm
    sent = buffered(flat)[:, 0, :]
    at = np.flatnonzero(f | b | i | w | o)
    columns = [
        flat.owner[at],
        _MOMENT_CODES[kind[at], grads[at].astype(np.int64)],
        held[at],
        pending[at],
        sent[at, 0],
        sent[at, 1],
    ]
    seen: list[dict[str, set[Point]]] = [{name: set() for name in _FIELDS} for _ in range(flat.ranks)]
    for r, moment, h, p, outputs, gradients in _unique_rows(columns):
        seen[r][_FIELDS[moment]].add((h, p, (outputs, gradients)))
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


def stage_memory_terms(
    st: "StageCosts",
    held: HeldCounts,
    versions: int = 1,
    recompute: bool = False,
    first: bool = True,
    last: bool = True,
    batch_bytes: int = 0,
    gradient_sets: Optional[int] = None,
    split: bool = False,
) -> dict[str, int]:
    """Peak tensor bytes of one stage, by term, at its worst moment (see :class:`HeldCounts`).

    - ``state``: weights times the versions the schedule keeps (2 under 2BW, PipeDream-2BW paper, section
      3.1), optimizer state and, once they exist, gradients: ``gradient_sets`` batches' worth
      (default one per version; under 2BW the first stage holds one, as it steps right after
      its all-reduce, unless weights are tied across stages: schedules/two_bw.py).
    - ``activations``: per held microbatch what autograd saved plus the stage input (received
      from the previous stage: with its message's header, :func:`received_input_bytes`; with
      recompute: the inputs only, plus one microbatch's activations during its backward, or
      under split backward every pending microbatch's, recomputed before its I); per
      pending microbatch (split backward) but the one whose I or W runs (its captured gradients
      take the place of a backward's temporaries, measured), also the gradients its I captured for its W. During
      the step's first backward the microbatch being run frees its saved tensors block by
      block while the gradients appear (``StageCosts.first_backward_bytes``).
      On the last stage each held microbatch also keeps its loss; with recompute (and no split
      backward, whose first forward keeps no graph) also what the loss saved, since the loss
      runs outside the recomputed stage: a backward's loss node frees it before the stage is
      recomputed, and the recomputed graph holds the rest of the saved tensors.
    - ``outputs``: until its backward (or I) a microbatch's output is kept: by a stage that is
      not last, what autograd does not save anyway; with recompute autograd saves none of it,
      so all of it, and on the last stage nothing beyond what the loss saved (above).
    - ``buffers``: the receives posted and the sends not yet acknowledged at that moment (the
      point's :data:`Sent`, :func:`buffered`: outputs and input gradients sent, each packed with
      its header; a gradient and an input posted for, each with its header), and the header
      templates of the stage's message layouts (:func:`message_templates`).
    - ``batch``: the replica's batch, which every rank of a pipeline holds during the step, the
      step's loss and the last step's (and on the last stage the step's running loss sum).
    - ``workspace``: the optimizer step's temporaries at the step; else the running block's
      temporaries (largest forward, or on a stage that is not
      last its output's send, header and a copy of the output, if larger; largest backward; a
      full backward's blocks free their saved tensors as it goes, so there the most it holds
      beyond them, ``StageCosts.backward_excess_bytes``); during a backward of a stage that is
      not last, also the gradient it started from, with its message's header.

    ``split``: every backward of the program is split (I and W).
    """
    weights = versions * st.weight_bytes + st.optimizer_bytes
    grads = (versions if gradient_sets is None else gradient_sets) * st.gradient_bytes
    loss_graph = _loss_graph_bytes(st, recompute, last, split)
    received = received_input_bytes(st, first)
    per_held = received + (0 if recompute else st.stash_bytes) + st.loss_bytes + loss_graph
    out = _kept_output_bytes(st, recompute, last)
    one = st.stash_bytes - loss_graph if recompute else 0  # recomputed for the backward that runs
    cap = _after_input_grad_bytes(st, per_held + one, first, last)
    # What a pending microbatch (its I done, its W not) drops of a held one's: its output, once I
    # has consumed it; on the first stage I is empty and the output is W's root (backward_split.py).
    dropped = 0 if first else out
    # A forward's output goes out right after it, its temporaries gone, packed with a header into
    # a new message kept until acknowledged (its moment is the send's).
    fws = max(st.forward_workspace_bytes, 0 if last else HEADER_BYTES + st.output_bytes)
    # A backward's gradient it started from, kept to its end: received, with its message's header,
    # or on the last stage the loss's (a scalar autograd makes; a block's own workspace has it
    # only while that block runs: up to its bytes over).
    bws = st.backward_workspace_bytes + (st.loss_bytes if last else HEADER_BYTES + st.output_bytes)
    # Per kind of moment: its points, state, workspace, and activations as
    # a0 + ah h + am max(h - 1, 0) + ap p + a1 max(p, 1) (recomputed graphs: the one a backward
    # runs on, and under split backward each pending microbatch's, rebuilt before its I, kept for its W).
    # A full backward (pending 0) frees each block's saved tensors as it goes (its peak is
    # ``backward_excess_bytes`` over them); I and W (pending >= 1) free nothing before W.
    excess = st.backward_workspace_bytes if st.backward_excess_bytes is None else st.backward_excess_bytes
    full_ws = bws - st.backward_workspace_bytes + excess  # a full backward's workspace beside its freeing blocks
    # A deferring I frees the graph block by block as it keeps their inputs and output gradients
    # for W (``input_grad_workspace_bytes``: its peak beside the whole graph, an upper bound); at
    # its end it holds what it kept, ``cap`` over a held microbatch.
    split_ws = (
        bws - st.backward_workspace_bytes + max(st.input_grad_workspace_bytes, cap)
        if st.frees_graph_at_input_grad
        else bws
    )
    # Its W adds the products into the gradients (in place where they exist or sit in a bucket;
    # else they become the gradients, counted as state): the running microbatch holds what its I
    # kept, ``cap`` over a held one, and nothing else of note (Zero Bubble's WeightGradStore).
    # Counting an I's workspace for W instead over-predicts (2% on tests/models.py's NonUniformChain).
    weight_ws = cap if st.frees_graph_at_input_grad else bws
    # The last number of each: whether one of the pending microbatches is the one running (its I
    # or W; its captured gradients are in the workspace), else every pending one waits with them
    # (a forward or the optimizer step between a microbatch's I and its W: Zero Bubble, 2BW).
    moments = [
        (held.forward_cold, weights, fws, (0, per_held, 0, one, 0), 0),
        (held.forward_warm, weights + grads, fws, (0, per_held, 0, one, 0), 0),
        (
            held.backward_first,
            weights,
            bws - st.backward_workspace_bytes,
            (received + st.first_backward_bytes + st.loss_bytes, 0, per_held, one, 0),
            0,
        ),
        (held.full_backwards, weights + grads, full_ws, (-loss_graph, per_held, 0, 0, one), 0),
        # An I (on the first stage empty: the received gradient waits in the workspace).
        (held.split_backwards, weights + grads, full_ws if first else split_ws, (0, per_held, 0, 0, one), 1),
        (held.input_cold, weights, split_ws, (0, per_held, 0, 0, one), 1),
        # A W: on the first stage a whole backward (no input gradient), freeing as it goes like one;
        # where I froze the graph, the running microbatch's captured tensors in place of a held one's.
        (held.weight_warm, weights + grads, full_ws if first else weight_ws, (0, per_held, 0, 0, one), 1),
        # The W that creates the gradients: on the first stage the step's first backward (above),
        # beside the pending microbatches (each a held one, its output and the gradient received
        # for it, and with recompute its rebuilt graph); elsewhere a W whose products become the gradients.
        (
            held.weight_first,
            weights if first else weights + grads,
            bws - st.backward_workspace_bytes if first else weight_ws,
            (received + st.first_backward_bytes + st.loss_bytes - one, 0, per_held, one, 0)
            if first
            else (0, per_held, 0, 0, one),
            1,
        ),
        # 2BW's windows overlap: microbatches between their I and W wait through the step, each with
        # its captured gradients (counting one of them as held under-predicts a recomputed last stage).
        (
            held.optimizer_step,
            weights + grads,
            st.optimizer_step_bytes + GRADIENT_NORM_BYTES,
            (0, per_held, 0, one, 0),
            0,
        ),
    ]
    # Totals first, on plain numbers, parts only for the worst point: MadPipe asks millions of times.
    per_output, per_gradient = HEADER_BYTES + st.output_bytes, HEADER_BYTES + st.input_bytes
    worst, most = (weights + grads, 0, (0, 0, NOTHING_SENT), (0,) * 5, 0), -1
    for points, state, workspace, (a0, ah, am, ap, a1), runs in moments:
        base, per_h, per_p = state + workspace + a0, ah + out, ap - dropped
        for point in points:
            h, p, (o, g) = point
            total = (
                base
                + per_h * h
                + am * (h - 1 if h > 1 else 0)
                + per_p * p
                + a1 * (p if p > 1 else 1)
                + cap * (p - runs if p > runs else 0)
            )
            total += per_output * o + per_gradient * g
            if total > most:
                worst, most = (state, workspace, point, (a0, ah, am, ap, a1), runs), total
    state, workspace, (h, p, sent), (a0, ah, am, ap, a1), runs = worst
    activations = a0 + ah * h + am * max(h - 1, 0) + ap * p + a1 * max(p, 1) + cap * max(p - runs, 0)
    return {
        "state": state,
        "activations": activations,
        "outputs": h * out - p * dropped,
        "workspace": workspace,
        "buffers": sent_bytes(st, sent) + message_templates([(st, first, last)]),
        "batch": batch_bytes + st.loss_bytes,
    }


def _after_input_grad_bytes(st: "StageCosts", held: int, first: bool = False, last: bool = False) -> int:
    """What a pending microbatch (its I done, its W not) holds beyond the ``held`` bytes of a held
    one: the gradients its I captured; on a stage whose I frees the graph (deferred linear and
    convolution weight gradients), those calls' inputs and output gradients in place of everything it held.
    On the first stage no input needs a gradient: I does nothing and leaves W the whole backward
    (runtime/autograd/backward_split.py), so a pending microbatch keeps its graph, its output
    (counted as a held one's) and, unless the stage is also last, the gradient received for its
    output, with its message's header (it did not wait in a gradient's place before its I: the
    receive is read just before the I).

    Where I frees the graph a pending microbatch keeps its input, as received, until its W: inside
    its message (a header more than the profile's captured bytes count) where a deferred call of
    the first block keeps it for W; else, with its input gradient, held by no Python object
    (measured on NonUniformChain's attention and MLP stage at d=4: 13 to 17 KB under at every I and
    W without them; what holds them is not pinned down, so the bytes are counted as measured)."""
    if first:
        return 0 if last else HEADER_BYTES + st.output_bytes
    if st.frees_graph_at_input_grad:
        kept_input = HEADER_BYTES if st.captured_input_bytes else HEADER_BYTES + 2 * st.input_bytes
        return st.captured_bytes + kept_input - held
    return st.captured_bytes


def _loss_graph_bytes(st: "StageCosts", recompute: bool, last: bool, split: bool) -> int:
    """What the loss saved, kept per held microbatch beside a recomputed last stage's inputs (the
    loss runs outside the recomputation; under split backward the first forward keeps no graph)."""
    return st.loss_saved_bytes if recompute and last and not split else 0


def message_templates(stages: Iterable[tuple["StageCosts", bool, bool]]) -> int:
    """Bytes of the packed-message header templates a rank's stages (each with whether it is
    first and last) make: one header per distinct message layout (runtime/comm/p2p.py
    ``packing``, cached for the process): an activation's and its gradient's, which carries only
    its floating tensors (the same layout unless others travel: ``StageCosts.mixed_input`` and
    ``mixed_output``), told apart by size (two of one size but different shapes share one here,
    and hold a header more)."""
    layouts = set()
    for st, first, last in stages:
        if not first:  # the input received, its gradient sent
            layouts |= {
                ("activation", st.input_bytes),
                ("gradient" if st.mixed_input else "activation", st.input_bytes),
            }
        if not last:  # the output sent, its gradient received
            layouts |= {
                ("activation", st.output_bytes),
                ("gradient" if st.mixed_output else "activation", st.output_bytes),
            }
    return HEADER_BYTES * len(layouts)


def sent_bytes(st: "StageCosts", sent: Sent) -> int:
    """Bytes a stage's unacknowledged sends keep alive (see :data:`Sent`)."""
    outputs, gradients = sent
    return outputs * (HEADER_BYTES + st.output_bytes) + gradients * (HEADER_BYTES + st.input_bytes)


def received_input_bytes(st: "StageCosts", first: bool) -> int:
    """Bytes a held stage input keeps alive: received from the previous stage it is a view of one
    message, its header included (runtime/comm/p2p.py); the first stage's comes from the batch."""
    return st.input_bytes + (0 if first else HEADER_BYTES)


def _kept_output_bytes(st: "StageCosts", recompute: bool, last: bool) -> int:
    """Bytes of one held microbatch's output kept beside what :attr:`StageCosts.stash_bytes` counts."""
    if not recompute:
        return 0 if last else st.unsaved_output_bytes
    if last:  # what the loss saved of it: in the loss's saved bytes, once those are profiled
        return 0 if st.loss_bytes else st.output_bytes - st.unsaved_output_bytes
    return st.output_bytes


def stage_peak_bytes(
    st: "StageCosts",
    held: HeldCounts,
    versions: int = 1,
    recompute: bool = False,
    first: bool = True,
    last: bool = True,
    batch_bytes: int = 0,
    gradient_sets: Optional[int] = None,
    split: bool = False,
) -> int:
    """Peak tensor bytes of one stage: the sum of :func:`stage_memory_terms`."""
    return int(
        sum(stage_memory_terms(st, held, versions, recompute, first, last, batch_bytes, gradient_sets, split).values())
    )


def rank_moments(
    actions: Sequence[Action], stages: Sequence[int], sent: Optional[np.ndarray] = None
) -> tuple[Moment, ...]:
    """The distinct moments of one rank's program over its ``stages``, in program order (see
    :func:`_walk`; every stage's counts at each, where :func:`held_counts` keeps one stage's)."""
    index = {s: c for c, s in enumerate(stages)}
    return tuple(dict.fromkeys(_walk(actions, index.__getitem__, len(stages), sent=sent)))


def resting_bytes(
    st: "StageCosts", point: Point, grads: bool, recompute: bool, first: bool, last: bool, split: bool = False
) -> int:
    """Tensor bytes of a stage whose rank runs another of its stages: its weights, optimizer
    state and (once they exist) gradients, its held microbatches' saved tensors, inputs and kept
    outputs, and its pending microbatches' captured gradients (and, with recompute, their
    rebuilt graphs). Its buffers are counted per moment (:func:`sent_bytes`)."""
    h, p, _ = point
    one = st.stash_bytes if recompute else 0
    state = st.weight_bytes + st.optimizer_bytes + (st.gradient_bytes if grads else 0)
    kept = (
        received_input_bytes(st, first)
        + (0 if recompute else st.stash_bytes)
        + st.loss_bytes
        + _loss_graph_bytes(st, recompute, last, split)
    )
    activations = h * kept + p * (one + _after_input_grad_bytes(st, kept + one, first, last))
    out = _kept_output_bytes(st, recompute, last)
    return state + activations + h * out - (0 if first else p * out)


#: The kind a moment of a stage takes once its gradients exist (the rank's shared buckets made them).
_WARM = {
    "forward_cold": "forward_warm",
    "backward_first": "backward_warm",
    "input_cold": "backward_warm",
    "weight_first": "weight_warm",
}


def _bucketed_moment(kind: str, grads: tuple[bool, ...]) -> tuple[str, tuple[bool, ...]]:
    """A rank moment when its stages share gradient buckets: once any stage has gradients every
    stage has them, the running one's moment turning warm; a backward (or W) makes them all."""
    if any(grads):
        return _WARM.get(kind, kind), (True,) * len(grads)
    return kind, (True,) * len(grads) if kind.startswith(("backward", "weight")) else grads


def rank_peak_bytes(
    stages: Sequence["StageCosts"],
    moments: Sequence[Moment],
    recompute: Sequence[bool],
    first: Sequence[bool],
    last: Sequence[bool],
    batch_bytes: int = 0,
    buckets: bool = False,
    split: bool = False,
    step_bytes: Optional[int] = None,
) -> int:
    """Peak tensor bytes of a rank that runs several stages (one weight version): at each of its
    :func:`rank_moments`, the running stage's :func:`stage_memory_terms` at that moment but its
    buffers, plus every other stage's :func:`resting_bytes`, plus every stage's buffers at that
    moment (its unacknowledged sends and the receives posted for it, :func:`sent_bytes`), plus the batch.

    ``buckets``: the rank's gradients are averaged over replicas in buckets shared by its
    stages, each whole from its first gradient (runtime/buckets.py), so from the rank's first
    backward (or W) on every stage's gradients are counted (exact while they fit one bucket, an
    upper bound beyond). ``step_bytes``: the temporaries of the rank's optimizer step over all
    its stages (default: their stages' sum)."""
    running: dict[tuple[int, str, tuple[int, int]], int] = {}
    resting: dict[tuple[int, tuple[int, int], bool], int] = {}
    best = 0
    # Messages to one neighbour alternate between the stages' layouts where those differ: each
    # receive is posted for the link's last message of its kind (runtime/comm/p2p.py, Incoming),
    # so a message may meet a receive of the other layout and come as a header padded to that
    # message's size and its tensors apart, or wait in such a receive. Counted at its own size
    # plus the largest of the rank's layouts of its kind (an upper bound: at its own size alone it
    # under-predicts NonUniformChain, whose interleaved stages send 6 KiB and 18 KiB activations).
    outputs = {st.output_bytes for st, is_last in zip(stages, last) if not is_last}
    inputs = {st.input_bytes for st, is_first in zip(stages, first) if not is_first}
    other_output = max(outputs) if len(outputs) > 1 else 0
    other_input = max(inputs) if len(inputs) > 1 else 0

    def buffers(st: "StageCosts", sent: Sent) -> int:
        return sent_bytes(st, sent) + sent[0] * other_output + sent[1] * other_input

    for c, kind, points, grads in moments:
        if buckets:
            kind, grads = _bucketed_moment(kind, grads)
        key = (c, kind, points[c][:2])
        if key not in running:
            point = (*points[c][:2], NOTHING_SENT)
            terms = stage_memory_terms(
                stages[c], HeldCounts(**{kind: (point,)}), 1, recompute[c], first[c], last[c], split=split
            )
            running[key] = int(sum(terms.values())) - terms["buffers"] - terms["batch"]
        total = running[key] + sum(buffers(st, point[2]) for st, point in zip(stages, points))
        if kind == "optimizer_step":  # one optimizer over all the rank's stages
            whole = sum(st.optimizer_step_bytes for st in stages) if step_bytes is None else step_bytes
            total += whole - stages[c].optimizer_step_bytes
        for o, (point, g) in enumerate(zip(points, grads)):
            if o != c:
                if (o, point[:2], g) not in resting:
                    resting[o, point[:2], g] = resting_bytes(
                        stages[o], point, g, recompute[o], first[o], last[o], split
                    )
                total += resting[o, point[:2], g]
        best = max(best, total)
    templates = message_templates(zip(stages, first, last))
    return best + batch_bytes + sum(st.loss_bytes for st in stages) + templates
