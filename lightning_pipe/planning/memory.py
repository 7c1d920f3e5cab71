"""Peak tensor memory of one pipeline stage, term by term, at each kind of moment its program holds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Optional, Sequence

from lightning_pipe.planning.costs import STEP_LOSS_BYTES
from lightning_pipe.planning.held import (
    NOTHING_SENT,
    HeldCounts,
    Moment,
    Point,
    Sent,
    by_size,
)
from lightning_pipe.runtime.comm.p2p import HEADER_BYTES

if TYPE_CHECKING:
    from lightning_pipe.planning.costs import StageCosts


#: A point with no microbatch held or pending and nothing in flight.
NO_MICROBATCHES: Point = (0, 0, NOTHING_SENT)


@dataclass(frozen=True)
class Sharding:
    """A stage sharded over its ``width`` replicas (``data_parallel="fsdp"``, runtime/sharding.py).

    Attributes:
        width: replicas the stage's weights, optimizer state and reduced gradients are split over.
        gathered_bytes: the weights gathered beside the shards under ZeRO-3: the largest block's,
            while it runs (each block's unsharded parameters, from its gather to its reshard);
            under split backward every block's (a stage stays gathered from an I until its W).
            Each gather also holds the block's flat all-gather output until its copy-out ends
            (FSDP2's ``foreach_all_gather`` and ``foreach_all_gather_copy_out``; the runtime
            frees it then): :func:`~lightning_pipe.planning.costs.range_costs` counts it with
            each block's gather, :func:`stage_memory_terms` at the moments that gather.
        kept_gathered: ZeRO-2 (``reshard_after_forward=False``): every block's weights stay
            gathered from its first forward to the reduce-scatter.
        largest_bytes: the largest block's weights: at the reduce-scatter, each block's
            gradients are copied into one flat input and scattered into its ``1/w`` shard before
            its whole gradients go (FSDP2's ``foreach_reduce``); the largest block's flat input
            and shard are its worst (0: ``gathered_bytes`` instead).
        held_for_w: split backward: the stage's blocks stay gathered from an I to its W
            (``ShardedStage``), ``gathered_bytes`` every block's.
        gather_all_bytes: split backward under ZeRO-3: the most a W's gather of the stage holds
            beyond every block's weights (negative where it stays below): it gathers the blocks
            first to last, block ``j``'s flat output beside the weights of blocks ``0..j``
            (``ShardedStage.gather``); ``None`` where no W of the program gathers (each finds
            its stage gathered by an I since the last forward: ``costs.gathers``).
        gathering_pending: split backward under ZeRO-3: the most microbatches pending (the
            running one included) at an I that gathers the stage (``costs.gathering_pending``;
            at an I with more pending the stage is gathered already).
        recomputed: ZeRO-3 on a recomputed stage without split backward: its backward reruns
            the forward inside autograd's backward, where FSDP does not reshard after a block's
            forward (``post_forward``), so the rerun gathers the blocks first to last and keeps
            them for their backwards, each resharding after its own
            (``costs._recomputed_gather_peak``; ``gathered_bytes`` every block's; its forwards,
            outside a backward, one block at a time).
    """

    width: int
    gathered_bytes: int
    kept_gathered: bool = False
    largest_bytes: int = 0
    held_for_w: bool = False
    gather_all_bytes: Optional[int] = None
    gathering_pending: int = 0
    recomputed: bool = False


def earlier_batch_bytes(batch_bytes: int) -> int:
    """Bytes of one batch before the newest that a 2BW rank still holds (:func:`~.held.earlier_batches`):
    its samples, without the step's losses ``batch_bytes`` counts beside them."""
    return max(batch_bytes - STEP_LOSS_BYTES, 0)


#: The global gradient norm's square, a float32 scalar each rank keeps from its all-reduce to the
#: optimizer step that reads it (runtime/update.py).
GRADIENT_NORM_BYTES = 4


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
    handed: bool = False,
    hands: bool = False,
    sharding: Optional[Sharding] = None,
    buckets: bool = False,
    sends_apart: bool = False,
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
      step's loss and the last step's (and on the last stage the step's running loss sum); in a
      2BW stream also each batch before it still alive at the point (its :data:`Sent`'s third count).
    - ``workspace``: the optimizer step's temporaries at the step; else the running block's
      temporaries (largest forward, or on a stage that is not
      last its output's send, header and a copy of the output, if larger; largest backward; a
      full backward's blocks free their saved tensors as it goes, so there the most it holds
      beyond them, ``StageCosts.backward_excess_bytes``); during a backward of a stage that is
      not last, also the gradient it started from, with its message's header.

    ``split``: every backward of the program is split (I and W). ``handed``/``hands``: the
    previous/next stage runs on the same rank (the V placement's turn): the input is that stage's
    output, the gradient that stage's input gradient, neither a message.

    ``buckets``: the stage's gradients are averaged over its replicas in buckets, each whole from
    its first gradient (runtime/buckets.py; DDP replicas, ``sharding`` ``None``).
    ``sends_apart``: the sends of input gradients after their I's have moments of their own
    (``input_sent_cold``/``input_sent_warm``, an interleaved rank's, :func:`rank_peak_bytes`).

    ``sharding`` (FSDP replicas, runtime/sharding.py): weights and optimizer state are ``1/w``
    shards; beside them the weights FSDP gathers: under ZeRO-3 the largest block's (under split
    backward every block's), and at each gather, until its copy-out ends, the block's flat
    all-gather output (:class:`Sharding`), under ZeRO-2 every block's; the
    batch's gradients accumulate whole, unsharded, until the reduce-scatter, where they meet
    the largest block's flat copy and its ``1/w`` result (and under ZeRO-2 the other blocks'
    gathered weights); the optimizer step holds shards only
    (its temporaries ``1/w`` too). Checked against a tracked step in ``tests/test_fsdp.py``.
    """
    weights = versions * st.weight_bytes + st.optimizer_bytes
    grads = (versions if gradient_sets is None else gradient_sets) * st.gradient_bytes
    step_state, step_workspace = weights + grads, st.optimizer_step_bytes + GRADIENT_NORM_BYTES
    reduce_scatter: Optional[int] = None  # FSDP: the state at the reduce-scatter
    if sharding is not None:
        w, block = sharding.width, sharding.gathered_bytes
        shards = -(-(st.weight_bytes + st.optimizer_bytes) // w)
        weights = shards + (st.weight_bytes if sharding.kept_gathered else block)
        step_state = shards + -(-st.gradient_bytes // w)
        step_workspace = -(-st.optimizer_step_bytes // w) + GRADIENT_NORM_BYTES
        # Each block reshards (ZeRO-2) before its gradients go into the flat input, the gradients
        # of the blocks before it already shards: the whole gradients, the largest block's flat
        # input and shard, and under ZeRO-2 the other blocks' gathered weights at most.
        largest = sharding.largest_bytes or block
        gathered = st.weight_bytes if sharding.kept_gathered else largest
        reduce_scatter = shards + st.gradient_bytes + gathered + -(-largest // w)
    if grads > st.gradient_bytes:  # 2BW: the batch before's squared norm waits for its deferred step
        weights, step_state = weights + GRADIENT_NORM_BYTES, step_state + GRADIENT_NORM_BYTES
    # Before a moment's own batch has gradients (its "cold" and "first" moments), the other
    # batches' sets: under 2BW the batch before, until its deferred step (none when flushed).
    carried = weights + grads - st.gradient_bytes
    loss_graph = _loss_graph_bytes(st, recompute, last, split)
    received = received_input_bytes(st, first, handed)
    per_held = received + (0 if recompute else st.stash_bytes) + st.loss_bytes + loss_graph
    out = _kept_output_bytes(st, recompute, last)
    one = st.stash_bytes - loss_graph if recompute else 0  # recomputed for the backward that runs
    cap = _after_input_grad_bytes(st, per_held + one, first, last, handed)
    # What a pending microbatch (its I done, its W not) drops of a held one's: its output, once I
    # has consumed it; on the first stage I is empty and the output is W's root (backward_split.py).
    dropped = 0 if first else out
    # A forward's output goes out right after it, its temporaries gone, packed with a header into
    # a new message kept until acknowledged (its moment is the send's).
    # To the next stage on the same rank (``hands``, the V's turn) it goes as it is: no message.
    fws = max(st.forward_workspace_bytes, 0 if last or hands else HEADER_BYTES + st.output_bytes)
    # A backward's gradient it started from, kept to its end: received, with its message's header,
    # or on the last stage the loss's (a scalar autograd makes; a block's own workspace has it
    # only while that block runs: up to its bytes over).
    # From the next stage on the same rank, the gradient is that stage's input gradient, no message.
    header = 0 if hands else HEADER_BYTES
    bws = st.backward_workspace_bytes + (st.loss_bytes if last else header + st.output_bytes)
    # Per kind of moment: its points, state, workspace, and activations as
    # a0 + ah h + am max(h - 1, 0) + ap p + a1 max(p, 1) (recomputed graphs: the one a backward
    # runs on, and under split backward each pending microbatch's, rebuilt before its I, kept for its W).
    # A full backward (pending 0) frees each block's saved tensors as it goes (its peak is
    # ``backward_excess_bytes`` over them); I and W (pending >= 1) free nothing before W.
    excess = st.backward_workspace_bytes if st.backward_excess_bytes is None else st.backward_excess_bytes
    full_ws = bws - st.backward_workspace_bytes + excess  # a full backward's workspace beside its freeing blocks
    # A deferring I frees the graph block by block as it keeps their inputs and output gradients
    # for W (``input_grad_workspace_bytes``: its peak over the whole graph, which can be below
    # it); at its end it holds what it kept, ``cap`` over a held microbatch, and the gradients of
    # the stage's other weights, which its autograd call returns together, and the input gradient
    # (none on the first stage), which its send then packs into a message beside it (to the
    # previous stage on the same rank, the V's turn, it goes as it is). Until an I ends, its
    # microbatch keeps the output it runs from (the executor's roots), which a pending one has dropped.
    sent_gradient = 0 if first else st.input_bytes + (0 if handed else HEADER_BYTES + st.input_bytes)
    root = bws - st.backward_workspace_bytes  # the gradient a backward starts from
    # At an I's end its send packs the input gradient beside everything the I kept, with the send's
    # own temporaries; where the microbatch keeps its whole input message for W, those are bounded
    # by one input more (tracked 0.9 KB above the rest on ZB-V's stages at 2 samples a microbatch).
    # Where the send has moments of its own (``input_sent_*``, an interleaved rank's: the receive
    # it posts in their buffers), it holds what the I kept and the message, and the I its peak.
    keeps_input = st.frees_graph_at_input_grad and not (first or st.captured_input_bytes or sends_apart)
    send_bound = st.input_bytes if keeps_input else 0
    kept_at_input_grad = cap + st.undeferred_gradient_bytes + sent_gradient + send_bound
    split_ws = dropped + (
        root + max(st.input_grad_workspace_bytes, kept_at_input_grad) if st.frees_graph_at_input_grad else bws
    )
    # The send's moments (a stage whose I keeps the graph for W has none: its I's moment counts it):
    # the I has ended, and with it the output it ran from and that output's gradient.
    sent_ws = kept_at_input_grad
    sent_points = (held.input_sent_warm, held.input_sent_cold) if st.frees_graph_at_input_grad else ((), ())
    # Split backward under ZeRO-3: the most pending (the running one included) at an I that
    # gathers, and what a W's gather holds beyond the stage's weights (None: no W gathers).
    gathering_input_grads, gather_all = 0, None
    released: Optional[tuple[int, int]] = None  # (weights not gathered, workspace) of a forward with no W pending
    if sharding is not None and not sharding.kept_gathered:
        # ZeRO-3: a block's gather holds its flat all-gather output beside its unsharded weights
        # until the copy-out ends, before the block runs (costs._gather_peaks). Without split
        # backward the state holds the largest block's weights: in a forward and a full backward
        # the flat output comes beside the block's own. Under split backward it holds every
        # block's, gathered from an I to its W, or none since a forward resharded them
        # (runtime/sharding.py, ``ShardedStage``): a forward gathers one block beside no other,
        # and with no W pending finds none gathered; an I that finds the stage resharded gathers
        # the blocks last to first (``input_grad_gather_bytes``); a W that does gathers them
        # first to last before it runs (``Sharding.gather_all_bytes``), beside the running
        # microbatch's captured gradients or, on the first stage, whose W is the whole
        # backward, beside all it saved.
        whole = sharding.held_for_w or sharding.recomputed  # every block's weights in the state
        others = st.weight_bytes - sharding.largest_bytes if whole else 0
        if others:
            released = (others, max(fws, st.forward_gather_bytes))
        fws = max(fws, st.forward_gather_bytes - others)
        if not split:  # full backwards run (every one, or under "drain" those before the last forward)
            full_ws = max(full_ws, root + st.backward_gather_bytes)
        if sharding.recomputed:  # the rerun's gathers, and the blocks resharding as the backward goes
            full_ws = root + st.recomputed_gather_bytes
        if sharding.held_for_w:
            gathering_input_grads, gather_all = sharding.gathering_pending, sharding.gather_all_bytes
            if first and gather_all is not None:
                full_ws = max(full_ws, root + gather_all)
    if gathering_input_grads:  # an I that keeps the graph for W gathers as a full backward does
        gathering_ws = dropped + (
            root + max(st.input_grad_workspace_bytes, st.input_grad_gather_bytes, kept_at_input_grad)
            if st.frees_graph_at_input_grad
            else max(bws, root + st.backward_gather_bytes)
        )
    # Its W adds the products into the gradients (in place where they exist or sit in a bucket;
    # else they become the gradients, counted as state): the running microbatch holds what its I
    # kept, ``cap`` over a held one, and W's temporaries beside the gradients (a bias's summed
    # gradient before its add, ``weight_grad_workspace_bytes``; Zero Bubble's WeightGradStore).
    # Counting an I's workspace for W instead over-predicts (2% on tests/models.py's NonUniformChain).
    weight_ws = cap + st.weight_grad_workspace_bytes if st.frees_graph_at_input_grad else bws
    if gather_all is not None:
        weight_ws = max(weight_ws, (cap if st.frees_graph_at_input_grad else root) + gather_all)
    # At a cold moment with a microbatch pending beside the running one, that microbatch's I
    # already wrote the gradients of the weights W does not defer (W creates the rest): the state
    # holds them beside the batches' sets it carries (:func:`_cold`).
    early = st.undeferred_gradient_bytes
    # With replica buckets the stage's first W makes its bucket whole (zeros) before it adds the
    # gradients the running microbatch's I wrote of the weights W does not defer, which its work
    # holds until W copies them in: they stand beside the bucket (without one W adopts them as
    # the gradients, counted in the state).
    first_weight_state = weights + grads + (early if buckets else 0)
    # The last number of each: whether one of the pending microbatches is the one running (its I
    # or W; its captured gradients are in the workspace), else every pending one waits with them
    # (a forward or the optimizer step between a microbatch's I and its W: Zero Bubble, 2BW).
    forwards = _cold(held.forward_cold, carried, early, fws, (0, per_held, 0, one, 0), 0)
    forwards.append((held.forward_warm, weights + grads, fws, (0, per_held, 0, one, 0), 0))
    if released is not None:  # the points with no W pending, apart
        less, released_ws = released
        forwards = [
            entry
            for points, state, workspace, parts, runs in forwards
            for entry in (
                (tuple(pt for pt in points if pt[1]), state, workspace, parts, runs),
                (tuple(pt for pt in points if not pt[1]), state - less, released_ws, parts, runs),
            )
        ]
    input_grads = [
        (held.split_backwards, weights + grads, full_ws if first else split_ws, (0, per_held, 0, 0, one), 1),
        *_cold(held.input_cold, carried, early, split_ws, (0, per_held, 0, 0, one), 1),
    ]
    input_grads += [
        (sent_points[0], weights + grads, sent_ws, (0, per_held, 0, 0, one), 1),
        *_cold(sent_points[1], carried, early, sent_ws, (0, per_held, 0, 0, one), 1),
    ]
    if gathering_input_grads and not first:  # the points of an I that gathers, apart
        input_grads = [
            entry
            for points, state, workspace, parts, runs in input_grads
            for entry in (
                (tuple(pt for pt in points if pt[1] > gathering_input_grads), state, workspace, parts, runs),
                (tuple(pt for pt in points if pt[1] <= gathering_input_grads), state, gathering_ws, parts, runs),
            )
        ]
    moments = [
        *forwards,
        (
            held.backward_first,
            carried,
            bws - st.backward_workspace_bytes,
            (received + st.first_backward_bytes + st.loss_bytes, 0, per_held, one, 0),
            0,
        ),
        (held.full_backwards, weights + grads, full_ws, (-loss_graph, per_held, 0, 0, one), 0),
        # An I (on the first stage empty: the received gradient waits in the workspace).
        *input_grads,
        # A W: on the first stage a whole backward (no input gradient), freeing as it goes like one;
        # where I froze the graph, the running microbatch's captured tensors in place of a held one's.
        (held.weight_warm, weights + grads, full_ws if first else weight_ws, (0, per_held, 0, 0, one), 1),
        # The W that creates the gradients: on the first stage the step's first backward (above),
        # beside the pending microbatches (each a held one, its output and the gradient received
        # for it, and with recompute its rebuilt graph); elsewhere a W whose products become the gradients.
        (
            held.weight_first,
            carried if first else first_weight_state,
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
            step_state,
            step_workspace,
            (0, per_held, 0, one, 0),
            0,
        ),
    ]
    if reduce_scatter is not None:  # after the batch's last backward: nothing held, no workspace
        moments.append(((NO_MICROBATCHES,), reduce_scatter, 0, (0, 0, 0, 0, 0), 0))
    # Totals first, on plain numbers, parts only for the worst point: MadPipe asks millions of times.
    per_output, per_gradient = HEADER_BYTES + st.output_bytes, HEADER_BYTES + st.input_bytes
    per_batch = earlier_batch_bytes(batch_bytes)
    worst, most = (weights + grads, 0, (0, 0, NOTHING_SENT), (0,) * 5, 0), -1
    for points, state, workspace, (a0, ah, am, ap, a1), runs in moments:
        base, per_h, per_p = state + workspace + a0, ah + out, ap - dropped
        for point in points:
            h, p, (o, g, *earlier) = point
            total = (
                base
                + per_h * h
                + am * (h - 1 if h > 1 else 0)
                + per_p * p
                + a1 * (p if p > 1 else 1)
                + cap * (p - runs if p > runs else 0)
            )
            total += per_output * o + per_gradient * g + (per_batch * earlier[0] if earlier else 0)
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
        "batch": batch_bytes + st.loss_bytes + per_batch * sum(sent[2:]),
    }


def _cold(
    points: tuple[Point, ...], carried: int, early: int, workspace: int, parts: tuple[int, ...], runs: int
) -> list[tuple[tuple[Point, ...], int, int, tuple[int, ...], int]]:
    """A cold moment's entries (its stage's own batch without gradients yet, the state ``carried``):
    its points with a microbatch pending beside the running one (more than ``runs``) hold the
    gradients their I's wrote of the weights W does not defer, ``early`` more; the others not."""
    waiting = tuple(pt for pt in points if pt[1] > runs)
    rest = tuple(pt for pt in points if pt[1] <= runs)
    return [(waiting, carried + early, workspace, parts, runs), (rest, carried, workspace, parts, runs)]


def _after_input_grad_bytes(
    st: "StageCosts", held: int, first: bool = False, last: bool = False, handed: bool = False
) -> int:
    """What a pending microbatch (its I done, its W not) holds beyond the ``held`` bytes of a held
    one: the gradients its I captured; on a stage whose I frees the graph (deferred linear and
    convolution weight gradients), those calls' inputs and output gradients in place of everything it held.
    On the first stage no input needs a gradient: I does nothing and leaves W the whole backward
    (runtime/autograd/backward_split.py), so a pending microbatch keeps its graph, its output
    (counted as a held one's) and, unless the stage is also last, the gradient received for its
    output, with its message's header (it did not wait in a gradient's place before its I: the
    receive is read just before the I).

    Where I frees the graph a pending microbatch keeps its input, as received, until its W, inside
    its message: a header more than the profile's captured bytes count where a deferred call of
    the first block keeps it for W, else the whole message (a stage input that only a weight whose
    gradient I computes reads: its LayerNorm's; tracked at one input per pending microbatch on
    NonUniformChain's stages and the user path's). Unless the stage is last, the gradient
    received for its output is kept likewise, inside its message, where the last block's deferred
    call takes it as its output gradient (a residual block's): a header more (an upper bound elsewhere).

    ``handed``: the previous stage runs on the same rank (the V's turn) and the input is its output,
    no message: that stage counts it until its I ends, then its kept outputs do
    (:func:`~lightning_pipe.planning.held.outputs_kept_for_weight_grads`), so a pending
    microbatch keeps nothing more for it, and where the captured bytes hold it they count it once too many."""
    if first:
        return 0 if last else HEADER_BYTES + st.output_bytes
    if st.frees_graph_at_input_grad:
        if handed:  # the previous stage's output, no message: counted there and in its kept outputs
            kept_input = -st.captured_input_bytes
        else:
            kept_input = HEADER_BYTES if st.captured_input_bytes else HEADER_BYTES + st.input_bytes
        kept_gradient = 0 if last else HEADER_BYTES
        return st.captured_bytes + kept_input + kept_gradient - held
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
    outputs, gradients = sent[0], sent[1]
    return outputs * (HEADER_BYTES + st.output_bytes) + gradients * (HEADER_BYTES + st.input_bytes)


def kind_bytes(st: "StageCosts", counts: Sequence[int]) -> int:
    """Bytes of the messages a stage keeps buffered, given ``counts`` by kind
    (:func:`~lightning_pipe.planning.held.buffered_by_kind`, each message one packed buffer of its
    own size, :func:`sent_bytes`), then, if there, the gradients of its outputs the next stage on
    the same rank handed over and that wait for its backward
    (:func:`~lightning_pipe.planning.held.handed_gradients`) and the outputs it let go of that the
    next stage keeps for its W (:func:`~lightning_pipe.planning.held.outputs_kept_for_weight_grads`),
    each its output's bytes, no message."""
    handed = sum(counts[4:])
    return sent_bytes(st, by_size(counts)) + handed * st.output_bytes


def received_input_bytes(st: "StageCosts", first: bool, handed: bool = False) -> int:
    """Bytes a held stage input keeps alive: received from the previous stage it is a view of one
    message, its header included (runtime/comm/p2p.py); the first stage's comes from the batch.
    ``handed``: the previous stage runs on the same rank (the V's turn) and its output, which that
    stage keeps until its own backward (after this one's), is the input: nothing more."""
    if handed:
        return 0
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
    sharding: Optional[Sharding] = None,
    buckets: bool = False,
) -> int:
    """Peak tensor bytes of one stage: the sum of :func:`stage_memory_terms`."""
    terms = stage_memory_terms(
        st,
        held,
        versions,
        recompute,
        first,
        last,
        batch_bytes,
        gradient_sets,
        split,
        sharding=sharding,
        buckets=buckets,
    )
    return int(sum(terms.values()))


def resting_bytes(
    st: "StageCosts",
    point: Point,
    grads: bool,
    recompute: bool,
    first: bool,
    last: bool,
    split: bool = False,
    handed: bool = False,
    versions: int = 1,
    gradient_sets: int = 1,
) -> int:
    """Tensor bytes of a stage whose rank runs another of its stages: its weights (``versions``
    of them, 2 under 2BW), optimizer state and (once they exist) gradients (``gradient_sets``
    batches' worth), its held microbatches' saved tensors, inputs and kept outputs, and its
    pending microbatches' captured gradients (and, with recompute, their rebuilt graphs). Its
    buffers are counted per moment (:func:`sent_bytes`). A stage with pending microbatches holds
    the gradients their I's wrote, of the weights W does not defer (``undeferred_gradient_bytes``),
    which may belong to a batch whose gradients ``gradient_sets`` does not count yet: under
    interleaved 2BW a stage runs the next batch's first I before its rank's deferred step."""
    h, p, _ = point
    one = st.stash_bytes if recompute else 0
    state = versions * st.weight_bytes + st.optimizer_bytes + (gradient_sets * st.gradient_bytes if grads else 0)
    state += st.undeferred_gradient_bytes if p else 0
    kept = (
        received_input_bytes(st, first, handed)
        + (0 if recompute else st.stash_bytes)
        + st.loss_bytes
        + _loss_graph_bytes(st, recompute, last, split)
    )
    activations = h * kept + p * (one + _after_input_grad_bytes(st, kept + one, first, last, handed))
    out = _kept_output_bytes(st, recompute, last)
    return state + activations + h * out - (0 if first else p * out)


#: The kind a moment of a stage takes once its gradients exist (the rank's shared buckets made them).
_WARM = {
    "forward_cold": "forward_warm",
    "backward_first": "backward_warm",
    "input_cold": "backward_warm",
    "weight_first": "weight_warm",
    "input_sent_cold": "input_sent_warm",
}


def _bucketed_moment(kind: str, grads: tuple[bool, ...]) -> tuple[str, tuple[bool, ...]]:
    """A rank moment when its stages share gradient buckets: once any stage has gradients every
    stage has them, the running one's moment turning warm; a backward (or W) makes them all."""
    if any(grads):
        return _WARM.get(kind, kind), (True,) * len(grads)
    return kind, (True,) * len(grads) if kind.startswith(("backward", "weight")) else grads


def _sets_now(running: int, kind: str, live: Sequence[int], buckets: bool = False) -> list[int]:
    """Per stage, the gradient sets a moment's state counts from the batches whose gradients live
    there (``live``): at a cold moment of the running stage (its own batch without gradients yet)
    one more, for the set its backward or W makes (:func:`stage_memory_terms` carries the others).
    With ``buckets`` (shared by the rank's stages) the backward or W that makes its batch's bucket
    makes every stage's part of it: one more on each."""
    makes = buckets and kind in ("backward_first", "weight_first")
    return [n + ((o == running or makes) and kind in _WARM) for o, n in enumerate(live)]


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
    handed: Optional[Sequence[bool]] = None,
    hands: Optional[Sequence[bool]] = None,
    versions: int = 1,
    gradient_sets: Optional[Sequence[int]] = None,
    walked_sets: bool = False,
) -> int:
    """Peak tensor bytes of a rank that runs several stages: at each of its
    :func:`rank_moments`, the running stage's :func:`stage_memory_terms` at that moment but its
    buffers, plus every other stage's :func:`resting_bytes`, plus every stage's buffers at that
    moment (its unacknowledged sends and the receives posted for it, :func:`sent_bytes`), plus the batch.

    ``buckets``: the rank's gradients are averaged over replicas in buckets shared by its
    stages, each whole from its first gradient (runtime/buckets.py), so from the rank's first
    backward (or W) on every stage's gradients are counted (exact while they fit one bucket, an
    upper bound beyond). ``step_bytes``: the temporaries of the rank's optimizer step over all
    its stages (default: their stages' sum). ``handed`` (``hands``): per stage, whether its input
    is handed over by the previous stage on this rank (its output to the next), the V placement's
    turn (:func:`stage_memory_terms`). ``versions``: weight versions of every stage (2 under
    interleaved 2BW, PipeDream-2BW paper, section 3.1); ``gradient_sets``: per stage, the
    batches' gradients it holds at once (default one each), or with ``walked_sets`` (2BW, each
    rank stepping where its program does) as each moment counts them: per stage the batches whose
    gradients live there (:func:`~lightning_pipe.planning.held.live_sets`), so a stage whose rank
    stepped the batch before holds its own batch's alone; with ``buckets`` the moments were walked
    with the rank's shared buckets (``rank_moments``' ``shared``), which they count already.

    Each moment's buffers come by stage and by kind
    (:func:`~lightning_pipe.planning.held.buffered_by_kind`, counted by :func:`kind_bytes`), or
    by stage alone (:data:`Sent`, each at its stage's sizes); the former end with the rank's
    batches before the newest still alive (2BW, :func:`~lightning_pipe.planning.held.earlier_batches`)."""
    handed, hands = handed or [False] * len(stages), hands or [False] * len(stages)
    sets = list(gradient_sets) if gradient_sets is not None else [1] * len(stages)
    running: dict[tuple[int, str, tuple[int, int], int], int] = {}
    resting: dict[tuple[int, tuple[int, int], bool, int], int] = {}
    best = 0
    per_batch = earlier_batch_bytes(batch_bytes)
    apart = any(kind.startswith("input_sent") for _, kind, _, _ in moments)

    def buffers(o: int, sent: tuple[int, ...]) -> int:
        if len(sent) <= 3:  # output-sized and input-sized (:data:`Sent`)
            return sent_bytes(stages[o], sent) + per_batch * sum(sent[2:])
        return kind_bytes(stages[o], sent[:-1]) + per_batch * sent[-1]

    for c, kind, points, grads in moments:
        if buckets and not walked_sets:  # walked: the moments count the rank's buckets already
            kind, grads = _bucketed_moment(kind, grads)
        now = _sets_now(c, kind, grads, buckets) if walked_sets else sets
        key = (c, kind, points[c][:2], now[c])
        if key not in running:
            point = (*points[c][:2], NOTHING_SENT)
            terms = stage_memory_terms(
                stages[c],
                HeldCounts(**{kind: (point,)}),
                versions,
                recompute[c],
                first[c],
                last[c],
                gradient_sets=now[c],
                split=split,
                handed=handed[c],
                hands=hands[c],
                buckets=buckets,
                sends_apart=apart,
            )
            running[key] = int(sum(terms.values())) - terms["buffers"] - terms["batch"]
        total = running[key] + sum(buffers(o, point[2]) for o, point in enumerate(points))
        if kind == "optimizer_step":  # one optimizer over all the rank's stages
            whole = sum(st.optimizer_step_bytes for st in stages) if step_bytes is None else step_bytes
            total += whole - stages[c].optimizer_step_bytes
        for o, (point, g) in enumerate(zip(points, grads)):
            g = now[o] if walked_sets else g  # walked: the sets the moment counts there
            if o != c:
                if (o, point[:2], g, now[o]) not in resting:
                    resting[o, point[:2], g, now[o]] = resting_bytes(
                        stages[o], point, bool(g), recompute[o], first[o], last[o], split, handed[o], versions, now[o]
                    )
                total += resting[o, point[:2], g, now[o]]
        best = max(best, total)
    templates = message_templates(zip(stages, first, last))
    return best + batch_bytes + sum(st.loss_bytes for st in stages) + templates
