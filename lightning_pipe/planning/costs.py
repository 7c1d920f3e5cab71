"""Per-stage costs of a plan from a profile: seconds and bytes of each stage and action, batches and gradients held."""

from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

from lightning_pipe.core.partition import balanced
from lightning_pipe.core.pipeline_plan import PipelinePlan
from lightning_pipe.planning.profile import BlockProfile, BlockSample, Profile
from lightning_pipe.planning.programs import _program, program_key
from lightning_pipe.runtime.buckets import DEFAULT_BUCKET_BYTES
from lightning_pipe.schedules import Action, Kind
from lightning_pipe.schedules.actions import COMPUTE_KINDS, MESSAGE_KINDS, SEND_KINDS


@dataclass(frozen=True)
class StageCosts:
    """One stage's per-microbatch costs at one microbatch size (seconds, bytes)."""

    forward: float
    backward: float
    input_grad: float
    weight_grad: float
    stash_bytes: int  # what autograd saves for one microbatch's backward
    input_bytes: int  # the stage input kept for that backward (and received from the previous stage)
    output_bytes: int  # what the stage sends to the next one
    weight_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    unsaved_output_bytes: int = 0  # of the output, what autograd does not save anyway
    forward_workspace_bytes: int = 0  # the largest block's temporaries during its forward
    backward_workspace_bytes: int = 0  # the largest block's temporaries during its backward
    # one microbatch's saved tensors and the gradients during the step's first backward (a recomputed
    # last stage: after the loss's backward)
    first_backward_bytes: int = 0
    captured_bytes: int = 0  # split backward: the gradients one microbatch's I captures for its W
    # a full backward's peak over the microbatch's saved tensors, blocks freeing theirs as it goes
    # (None: the largest block's temporaries)
    backward_excess_bytes: Optional[int] = None
    loss_bytes: int = 0  # the last stage: one microbatch's loss, kept until its backward (and the step's running sum)
    loss_saved_bytes: int = (
        0  # the last stage: what the loss saves for backward (part of stash_bytes; kept outside a recomputed stage)
    )
    optimizer_step_bytes: int = 0  # the temporaries of the stage's optimizer step
    # split backward defers its linear and convolution weight gradients: I frees the graph
    # (runtime/autograd/deferred_weights.py)
    frees_graph_at_input_grad: bool = False
    # a deferring I's peak over the stage's graph: its temporaries, the later blocks' kept tensors
    # and other weights' gradients, and its incoming gradient, beside the blocks not yet run (_input_grad_peak)
    input_grad_workspace_bytes: int = 0
    # a deferring I's other weights' gradients (norms, biases), all held at the end of its autograd call
    undeferred_gradient_bytes: int = 0
    # a deferring W's temporaries beside the gradients it adds its products into: the largest block's
    # (it runs the blocks' calls one after another)
    weight_grad_workspace_bytes: int = 0
    # the stage's input and output hold a tensor that is not floating point: their gradients
    # travel in a message layout of their own (memory.message_templates)
    mixed_input: bool = False
    # split backward: of ``captured_bytes``, the stage's input (its first block's deferred call keeps it for W)
    captured_input_bytes: int = 0
    mixed_output: bool = False
    # ZeRO-3 (runtime/sharding.py): the most one microbatch holds beyond its saved tensors while a
    # block's flat all-gather output is alive, in its forward and in a full backward (_gather_peaks),
    # and, beyond them and the stage's whole weights, in a deferring I (_input_grad_peak)
    forward_gather_bytes: int = 0
    backward_gather_bytes: int = 0
    input_grad_gather_bytes: int = 0
    # ZeRO-3 with recompute: a full backward's peak beyond the stage's whole weights and one
    # microbatch's saved tensors (_recomputed_gather_peak)
    recomputed_gather_bytes: int = 0


def _gather_peaks(
    forward_samples: Sequence[BlockSample],
    samples: Sequence[BlockSample],
    weights: Sequence[int],
    last_incoming: int = 0,
    kept_output: int = 0,
) -> tuple[int, int]:
    """The most one microbatch holds beyond its saved tensors (negative where it stays below
    them) while a block's flat all-gather output is alive under ZeRO-3, in a forward and in a
    full backward: the output, the block's weights (``weights``, per block), until its copy-out
    into the unsharded parameters ends (runtime/sharding.py frees it then, before the block
    computes; the unsharded parameters are the stage's to count). Before block ``j``'s forward:
    the saved tensors of blocks ``0..j-1`` and its input, the previous block's output (the
    stage's input is counted with the stage). Before its backward: the saved tensors of blocks
    ``0..j`` (the blocks after it have freed theirs), the stage output's part the last block
    saved (kept by the executor, ``kept_output``), and the gradient it starts from, the next
    block's input gradient (the stage's last block's is counted with the stage, or
    ``last_incoming``), as in :func:`_backward_peaks`, whose blocks ``samples`` are (with
    recompute on the last stage, as the loss's backward leaves them; ``forward_samples`` as profiled)."""

    def saved_before(blocks: Sequence[BlockSample]) -> list[int]:  # [j]: blocks 0..j-1, inner inputs once
        inner = [0] + [max(b.saved_input_bytes - a.saved_output_bytes, 0) for a, b in zip(blocks, blocks[1:])]
        return [0] + list(itertools.accumulate(x.saved_bytes + i for x, i in zip(blocks, inner)))

    saved = saved_before(forward_samples)
    inputs = [0] + [x.output_bytes for x in forward_samples[:-1]]
    forward = max(saved[j] + inputs[j] + w for j, w in enumerate(weights)) - saved[-1]
    saved = saved_before(samples)
    incoming = [x.output_bytes for x in samples[:-1]] + [last_incoming]
    last = len(samples) - 1
    kept = [kept_output if j < last else 0 for j in range(len(samples))]  # the root, once its block freed it
    backward = max(saved[j + 1] + kept[j] + incoming[j] + w for j, w in enumerate(weights)) - saved[-1]
    return forward, backward


def _recomputed_gather_peak(
    samples: Sequence[BlockSample], weights: Sequence[int], last_incoming: int = 0, kept_output: int = 0
) -> int:
    """A recomputed stage's full backward under ZeRO-3: the most it holds beyond its whole
    weights gathered and one microbatch's saved tensors (negative where it stays below them),
    the gradient it starts from left out, as in :func:`_backward_peaks`, whose blocks ``samples``
    are (``weights``: each block's weights).

    The last block's pre-backward gathers it; its first saved tensor reruns the stage's forward
    inside autograd's backward, where FSDP does not reshard after a block's forward: the rerun
    gathers blocks ``0..j`` first to last, block ``j``'s flat output beside them, the last
    block, what the rerun saved so far (the saved tensors of blocks ``0..j-1`` and block
    ``j``'s input) and the gradient the last block starts from; then block ``j``'s backward
    runs beside the weights of blocks ``0..j`` (each block reshards after its backward), the
    saved tensors of blocks ``0..j``, the gradient it starts from and its temporaries."""
    inner = [0] + [max(b.saved_input_bytes - a.saved_output_bytes, 0) for a, b in zip(samples, samples[1:])]
    saved = [0] + list(itertools.accumulate(x.saved_bytes + i for x, i in zip(samples, inner)))
    whole, last = sum(weights), len(samples) - 1
    prefix = list(itertools.accumulate(weights))  # [j]: blocks 0..j
    inputs = [0] + [x.output_bytes for x in samples[:-1]]
    incoming = inputs[1:] + [last_incoming]
    kept = [kept_output if j < last else 0 for j in range(len(samples))]
    rerun = [saved[j] + inputs[j] + prefix[j] + weights[j] + weights[last] + last_incoming for j in range(last)]
    backward = [
        saved[j + 1] + kept[j] + incoming[j] + x.backward_workspace_bytes + prefix[j] for j, x in enumerate(samples)
    ]
    return max(rerun + backward + [2 * weights[last] + last_incoming]) - saved[-1] - whole


def _backward_peaks(
    samples: Sequence[BlockSample],
    grads: Sequence[int],
    bucket_cap: int = 0,
    last_incoming: int = 0,
    kept_output: int = 0,
) -> tuple[int, int]:
    """Peaks of one microbatch's backward through the blocks, last to first: the step's first
    backward, while the gradients appear, and a later one beyond the microbatch's saved tensors.

    While block ``j``'s backward runs: the saved tensors of blocks ``0..j`` (the blocks after it
    have freed theirs), the gradient it starts from, and its temporaries; in the first backward
    also the gradients of the blocks after it and its own as they appear. With replicas
    (``bucket_cap`` > 0) a gradient moves into its all-reduce bucket's flat buffer, made whole at
    the bucket's first gradient (runtime/buckets.py, :func:`bucketed_bytes`): until block ``j``
    accumulates its first weight gradient the buckets are those of the blocks after it; from then
    on they hold its gradients too, beside what the block still holds then
    (``after_gradient_bytes``, profiled: autograd frees a node's saved tensors before
    accumulating its gradients) and the saved tensors of blocks ``0..j-1``. A later backward
    finds every gradient there: a block with large temporaries early in the stage adds less
    than the same block last.

    ``kept_output``: what the last block saved of the stage's output, which the executor keeps
    (the backward's root) until the backward ends: it stays beside the earlier blocks' backwards
    (:func:`_kept_stage_output`)."""
    inner = [0] + [max(b.saved_input_bytes - a.saved_output_bytes, 0) for a, b in zip(samples, samples[1:])]
    saved = [0] + list(
        itertools.accumulate(x.saved_bytes + i for x, i in zip(samples, inner))
    )  # saved[j + 1]: blocks 0..j
    last = len(samples) - 1
    saved = [b + (kept_output if j <= last else 0) for j, b in enumerate(saved)]  # the root stays
    after = list(itertools.accumulate(reversed(grads)))[::-1] + [0]  # after[j]: gradients of blocks j..
    # The gradient a block's backward starts from, until it is consumed: the next block's input gradient
    # (the stage's last block starts from the loss, or from a received gradient counted with the stage,
    # or ``last_incoming``: the gradient the loss's backward gave it).
    incoming = [x.output_bytes for x in samples[:-1]] + [last_incoming]
    excess = max(saved[j + 1] + incoming[j] + x.backward_workspace_bytes for j, x in enumerate(samples)) - saved[-1]
    if bucket_cap <= 0:  # each block's gradients appear as it runs and stay (profiled cold), or all at once, at most
        cold = [x.cold_backward_bytes or grads[j] + x.backward_workspace_bytes for j, x in enumerate(samples)]
        return max(saved[j + 1] + after[j + 1] + incoming[j] + cold[j] for j in range(len(samples))), excess
    held = [bucketed_bytes(c, after[0], bucket_cap) for c in after]
    peaks = []
    for j, x in enumerate(samples):
        peaks.append(
            saved[j + 1] + held[j + 1] + incoming[j] + x.backward_workspace_bytes
        )  # before its first weight gradient
        if grads[j] and x.after_gradient_bytes:
            peaks.append(saved[j] + inner[j] + held[j] + x.after_gradient_bytes)
        elif grads[j]:  # not profiled: everything the block holds beside its gradients' buckets
            peaks.append(saved[j + 1] + held[j] + incoming[j] + x.backward_workspace_bytes)
    return max(peaks), excess


def _recomputed(samples: Sequence[BlockSample]) -> tuple[list[BlockSample], int]:
    """A recomputed last stage's blocks as its backward finds them, and the gradient its last
    block starts from: the loss runs outside the recomputation, so its backward has run, freed
    what it saved and left the gradient of the stage output before the blocks are recomputed."""
    x = samples[-1]
    alone = dataclasses.replace(
        x,
        saved_bytes=x.saved_bytes - x.loss_saved_bytes,
        backward_workspace_bytes=x.block_backward_workspace_bytes,
        after_gradient_bytes=x.block_after_gradient_bytes,
        cold_backward_bytes=x.block_cold_backward_bytes,
    )
    return [*samples[:-1], alone], x.output_bytes


def bucketed_bytes(computed: int, total: int, bucket_cap: int) -> int:
    """Gradient bytes a stage holds once ``computed`` of its ``total`` exist, in buckets of at most
    ``bucket_cap`` bytes, each made whole at its first gradient. Buckets fill whole parameters
    from the last one back, so the ones begun are every one passed plus the current one, whose
    rest is under ``bucket_cap``: an upper bound, exact while the stage's gradients fit one bucket."""
    return min(total, computed + bucket_cap) if computed > 0 else 0


def step_bytes(profile: Profile, blocks: Iterable[BlockProfile]) -> int:
    """Temporaries of one optimizer step over ``blocks``' parameters (see ``Profile.step_bytes_add_up``)."""
    sizes = [b.optimizer_step_bytes for b in blocks]
    if not sizes:
        return 0
    return sum(sizes) if profile.step_bytes_add_up else max(sizes)


def _inner_inputs(samples: Sequence[BlockSample]) -> int:
    """Saved bytes of the inputs of a stage's inner blocks, each boundary tensor counted once
    (the previous block may have saved its output, the same tensor, already)."""
    return sum(max(b.saved_input_bytes - a.saved_output_bytes, 0) for a, b in zip(samples, samples[1:]))


def _input_grad_peak(
    samples: Sequence[BlockSample],
    returned: Sequence[int],
    kept_output: int = 0,
    workspaces: Optional[Sequence[int]] = None,
) -> int:
    """A deferring I's peak over the stage's whole graph (negative where it stays below it). It
    runs the blocks last to first, freeing each block's saved tensors as it goes (no
    ``retain_graph``), so while block ``j`` runs the stage holds the saved tensors of blocks
    ``0..j`` (each inner boundary tensor once, as in :func:`_backward_peaks`), what each later
    block kept for W, the gradients of the later blocks' other weights (``returned``, per block:
    norms, biases; the autograd call returns them all at its end), the gradient of block ``j``'s
    output unless the block is the stage's last (the stage's model counts that one), and block
    ``j``'s I temporaries (profiled beside its whole graph; ``workspaces``: per block, bytes in
    their place, as a ZeRO-3 block's flat all-gather output before it runs); beside the blocks
    before the last, also ``kept_output`` (:func:`_kept_stage_output`)."""
    inner = [0] + [max(b.saved_input_bytes - a.saved_output_bytes, 0) for a, b in zip(samples, samples[1:])]
    saved = [0] + list(itertools.accumulate(x.saved_bytes + i for x, i in zip(samples, inner)))
    kept_after, peak = 0, None
    for i in reversed(range(len(samples))):
        incoming = samples[i].output_bytes if i < len(samples) - 1 else 0  # as in _backward_peaks
        root = kept_output if i < len(samples) - 1 else 0  # the last block's own saved tensors hold it
        workspace = samples[i].input_grad_workspace_bytes if workspaces is None else workspaces[i]
        here = saved[i + 1] + root + kept_after + incoming + workspace
        peak = here if peak is None else max(peak, here)
        kept_after += samples[i].captured_bytes + returned[i]
    return (peak or 0) - saved[-1]


def _kept_stage_output(samples: Sequence[BlockSample], recompute: bool, last: bool) -> int:
    """What a stage's last block saved of the stage's output, which outlives that block's saved
    tensors during the stage's backward (or I): the executor keeps the output it sent, the
    backward's root, until the backward ends (runtime/executor.py), so the saved tensor autograd
    frees with the last block's node stays beside the earlier blocks' backwards. Not on the last
    stage (its output goes to the loss, modelled with it), nor with recompute (the recomputed
    graph saves its own copy, freed as it goes; the kept output is counted whole per held
    microbatch, ``memory._kept_output_bytes``)."""
    return 0 if recompute or last or len(samples) < 1 else samples[-1].saved_output_bytes


def range_costs(
    profile: Profile,
    blocks: range,
    microbatch_size: int,
    recompute: bool = False,
    samples: Optional[Sequence[BlockSample]] = None,
    bucket_cap: int = 0,
) -> StageCosts:
    """The profiled costs of blocks ``blocks`` run as one stage at ``microbatch_size`` (``samples``:
    every block already at that size, to save the interpolation; ``bucket_cap``: the most bytes
    of one replica all-reduce bucket, 0 without replicas)."""
    mine = [samples[i] if samples is not None else profile.blocks[i].at(microbatch_size) for i in blocks]
    states = [profile.blocks[i] for i in blocks]
    first = blocks.start
    # A full backward's blocks (with recompute on the last stage, as the loss's backward leaves them;
    # profiled since loss_bytes).
    backward, incoming = _recomputed(mine) if recompute and mine[-1].loss_bytes else (mine, 0)
    kept = _kept_stage_output(mine, recompute, blocks.stop == len(profile.blocks))
    first_backward, excess = _backward_peaks(backward, [b.gradient_bytes for b in states], bucket_cap, incoming, kept)
    weights = [b.parameter_bytes for b in states]
    forward_gather, backward_gather = _gather_peaks(mine, backward, weights, incoming, kept)
    returned = [b.undeferred_gradient_bytes for b in states]
    recomputing = sum(x.recompute for x in mine) if recompute else 0.0
    # Split backward: stage 0's input needs no gradient, so its I only recomputes (if it does) and
    # its W runs the whole backward (the executor's I finds no input to differentiate).
    input_grad, weight_grad = (
        (sum(x.input_grad for x in mine), sum(x.weight_grad for x in mine))
        if first > 0
        else (0.0, sum(x.backward for x in mine))
    )
    return StageCosts(
        forward=sum(x.forward for x in mine),
        backward=sum(x.backward for x in mine) + recomputing,
        input_grad=input_grad + recomputing,
        weight_grad=weight_grad,
        stash_bytes=sum(x.saved_bytes for x in mine) + _inner_inputs(mine),
        input_bytes=(
            (samples[first - 1] if samples is not None else profile.blocks[first - 1].at(microbatch_size)).output_bytes
            if first > 0
            else int(profile.input_bytes_per_sample * microbatch_size)
        ),
        output_bytes=mine[-1].output_bytes,
        unsaved_output_bytes=mine[-1].output_bytes - mine[-1].saved_output_bytes,
        weight_bytes=sum(b.parameter_bytes for b in states),
        gradient_bytes=sum(b.gradient_bytes for b in states),
        optimizer_bytes=sum(b.optimizer_bytes for b in states),
        forward_workspace_bytes=max(x.forward_workspace_bytes for x in mine),
        backward_workspace_bytes=max(x.backward_workspace_bytes for x in mine),
        first_backward_bytes=first_backward,
        captured_bytes=sum(x.captured_bytes for x in mine),
        backward_excess_bytes=excess,
        loss_bytes=mine[-1].loss_bytes,
        loss_saved_bytes=mine[-1].loss_saved_bytes,
        optimizer_step_bytes=step_bytes(profile, states),
        input_grad_workspace_bytes=_input_grad_peak(mine, returned, kept),
        undeferred_gradient_bytes=sum(b.undeferred_gradient_bytes for b in states),
        weight_grad_workspace_bytes=max(x.weight_grad_workspace_bytes for x in mine),
        mixed_input=first > 0 and profile.blocks[first - 1].mixed_output,
        captured_input_bytes=mine[0].captured_input_bytes,
        mixed_output=states[-1].mixed_output,
        forward_gather_bytes=forward_gather,
        backward_gather_bytes=backward_gather,
        recomputed_gather_bytes=_recomputed_gather_peak(backward, weights, incoming, kept) if recompute else 0,
        # An I gathers its stage's blocks last to first (FSDP's pre-backward hooks), block j's flat
        # output and weights beside the later blocks' weights, the earlier ones not gathered yet:
        # beside the stage's whole weights, its own less the earlier blocks'.
        input_grad_gather_bytes=_input_grad_peak(
            mine, returned, kept, [w - before for w, before in zip(weights, itertools.accumulate([0, *weights]))]
        ),
        # As the executor decides: a stage with an input gradient whose matrices are all linear,
        # convolution or embedding weights.
        frees_graph_at_input_grad=first > 0
        and any(b.deferred_weights for b in states)
        and not any(b.other_matrices for b in states),
    )


def stage_costs(
    profile: Profile, plan: PipelinePlan, microbatch_size: int, samples: Optional[Sequence[BlockSample]] = None
) -> list[StageCosts]:
    """Sum the profiled blocks of every stage of ``plan`` (partition resolved) at ``microbatch_size``
    (``samples``: every block already at that size, as :meth:`RangeCosts.samples` keeps them)."""
    cap = bucket_cap(plan)
    return [
        range_costs(profile, rng, microbatch_size, plan.recompute[s], samples, cap)
        for s, rng in enumerate(plan.stage_ranges())
    ]


def bucket_cap(plan: PipelinePlan) -> int:
    """Most bytes of a bucket a stage's gradients are averaged in over its replicas, 0 without
    replicas. The engine's default, DDP's 25 MiB: the model does not see ``bucket_cap_mb``; a
    larger cap can hold more than predicted at a first backward, ``0`` (one all-reduce after
    the backward) holds less."""
    return DEFAULT_BUCKET_BYTES if plan.width > 1 else 0


def _transfer(profile: Profile, nbytes: int) -> float:
    return profile.link_latency + nbytes / profile.link_bandwidth


def sharded(plan: PipelinePlan) -> bool:
    """Whether ``plan``'s stages are sharded over their replicas (``data_parallel="fsdp"``, ``w > 1``)."""
    return plan.data_parallel == "fsdp" and plan.width > 1


def gathers(plan: PipelinePlan, a: Action) -> float:
    """All-gathers of its stage's weights that action ``a`` runs under FSDP, on average over the
    step's actions of its kind (0 without sharding).

    As the runtime issues them (runtime/sharding.py): each block is its own FSDP unit, gathered
    by its pre-forward and pre-backward hooks. With ``reshard_after_forward=True`` (ZeRO-3) the
    weights are freed after each forward and after each backward (``set_reshard_after_backward``),
    so every forward and every full backward gathers every block of the stage once. A recomputed
    stage's backward gathers once too: its recomputed forward gathers, and FSDP keeps the
    weights for the backward that follows. With ``False`` (ZeRO-2) they stay gathered from the
    block's first forward to the AR action's reduce-scatter: one all-gather per block and step,
    which the runtime runs in the stage's first forward; the simulator prices an action by its
    stage and kind, not by its microbatch, so the model spreads it over the step's ``m``
    forwards (the same seconds per step on each rank).

    Split backward under ZeRO-3: what each action gathers depends on what ran before it on its
    stage (:func:`_split_gathers` walks the plan's program)."""
    if not sharded(plan):
        return 0.0
    if plan.reshard_after_forward:
        if plan.split_backward:
            return _split_gathers(program_key(plan, 1), tuple(plan.recompute))[0].get((a.stage, a.kind), 0.0)
        return 1.0 if a.kind in (Kind.FORWARD, Kind.BACKWARD) else 0.0
    return 1 / plan.microbatches if a.kind is Kind.FORWARD else 0.0


def gathering_pending(plan: PipelinePlan, stage: int) -> int:
    """Split backward under ZeRO-3: the most microbatches of ``stage`` pending (their I done,
    their W not; the running one included) at an I that gathers the stage, 0 where none does
    (:func:`_split_gathers`)."""
    if not (sharded(plan) and plan.reshard_after_forward and plan.split_backward):
        return 0
    return _split_gathers(program_key(plan, 1), tuple(plan.recompute))[1].get(stage, 0)


@functools.lru_cache(maxsize=256)
def _split_gathers(key: tuple, recompute: tuple[bool, ...]) -> tuple[dict[tuple[int, Kind], float], dict[int, int]]:
    """Per stage and kind of action, the all-gathers of the stage's weights one action runs on
    average, under split backward and ZeRO-3, for the program of :func:`program_key` ``key``;
    and per stage the most microbatches pending (the running one included) at an I that gathers.

    Each stage is gathered or not as the runtime leaves it (runtime/sharding.py,
    ``ShardedStage``, and runtime/executor.py), and an action gathers only a stage that is not:
    a forward gathers and reshards after it; an I gathers (its recomputed forward first gathers
    and reshards, so a recomputed stage's I gathers again) and keeps the stage gathered for its
    W; the first stage's I is empty (its W is the whole backward) and gathers only for its
    recomputed forward; a W gathers what a forward resharded since its I; a W or a full
    backward that leaves no W of the stage pending reshards it."""
    done: dict[tuple[int, Kind], list[int]] = {}
    pending_at: dict[int, int] = {}
    for actions in _program(*key):
        gathered: dict[int, bool] = {}
        pending: dict[int, int] = {}
        for a in actions:
            s, was = a.stage, gathered.get(a.stage, False)
            if a.kind is Kind.FORWARD:
                n, gathered[s] = int(not was), False
            elif a.kind is Kind.INPUT_GRAD:
                rerun = int(recompute[s] and not was)  # the recomputed forward gathers, then reshards
                if s == 0:
                    n, gathered[s] = rerun, was and not recompute[s]
                else:
                    n, gathered[s] = (1 + rerun if recompute[s] else int(not was)), True
                pending[s] = pending.get(s, 0) + 1
                if n:
                    pending_at[s] = max(pending_at.get(s, 0), pending[s])
            elif a.kind is Kind.WEIGHT_GRAD:
                pending[s] = pending.get(s, 1) - 1
                n, gathered[s] = int(not was), pending[s] > 0
            elif a.kind is Kind.BACKWARD:
                n, gathered[s] = int(not was), pending.get(s, 0) > 0
            else:
                continue
            done.setdefault((s, a.kind), []).append(n)
    return {k: sum(ns) / len(ns) for k, ns in done.items()}, pending_at


def sharded_seconds(profile: Profile, plan: PipelinePlan, st: StageCosts, a: Action) -> float:
    """Seconds of FSDP's collectives in action ``a`` of a sharded stage ``st`` (0 otherwise).

    Volumes as in the ZeRO paper (Rajbhandari et al., "ZeRO: Memory Optimizations Toward
    Training Trillion Parameter Models", section 7): a ring reduce-scatter of the gradients
    moves ``(w-1)/w`` of their bytes per rank, half of DDP's ring all-reduce, and an all-gather
    of the weights ``(w-1)/w`` of theirs; ZeRO-3 gathers the weights in the forward and again
    in the backward, 1.5x DDP's volume per microbatch pass. Here:

    - the AR action reduce-scatters the stage's gradients once per step:
      ``(w-1)/w * gradient_bytes / allreduce_bandwidth``;
    - a forward or backward that gathers (:func:`gathers`) adds
      ``(w-1)/w * weight_bytes / allreduce_bandwidth``.

    Assumptions: both run at the measured all-reduce's bus bandwidth
    (``profile.allreduce_bandwidth``) and scale by its fitted ``allreduce_scale``; no latency per
    collective; an all-gather does not overlap the block's compute (each block is its own FSDP
    root, so nothing prefetches it in the forward), which overstates a backward whose next
    block's gather FSDP prefetches. 0 where the bandwidth is unknown."""
    if not sharded(plan) or not profile.allreduce_bandwidth:
        return 0.0
    share = (plan.width - 1) / plan.width
    if a.kind is Kind.ALL_REDUCE:
        nbytes = share * st.gradient_bytes
    else:
        nbytes = gathers(plan, a) * share * st.weight_bytes
    return nbytes / profile.allreduce_bandwidth * profile.allreduce_scale


#: The actions the executor's measured overhead per action is charged to: its loop and
#: bookkeeping run around a message as around a block.
_PAYS_OVERHEAD = COMPUTE_KINDS | MESSAGE_KINDS


def action_cost(profile: Profile, plan: PipelinePlan, stages: Sequence[StageCosts]) -> Callable[[Action], float]:
    """Seconds of each action of ``plan``'s program: compute from the profile, sends the time to
    post them, receives from the link (latency + bytes / bandwidth), each of them plus the
    executor's measured overhead per action (its loop and bookkeeping run around every action it
    takes, a message's as a block's), and messages their fitted stall (:attr:`Profile.message_stall`);
    the all-reduce from the replicas' ring, the step by weight share; compute, all-reduce and step
    scaled as the profile's trial runs fitted them.

    FSDP replicas (``data_parallel="fsdp"``, :func:`sharded_seconds`): the AR action is a
    reduce-scatter, half the ring all-reduce; the forwards and backwards that gather a stage's
    weights (:func:`gathers`) add the all-gather; and the optimizer step updates ``1/w`` of the
    stage's weights (its shard), so takes ``1/w`` of the stage's share of the step."""
    total_weights = sum(s.weight_bytes for s in stages) or 1
    versions = weight_versions(plan)
    fsdp = sharded(plan)
    step_share = 1 / plan.width if fsdp else 1.0

    compute = {
        Kind.FORWARD: "forward",
        Kind.BACKWARD: "backward",
        Kind.INPUT_GRAD: "input_grad",
        Kind.WEIGHT_GRAD: "weight_grad",
    }

    def cost(a: Action) -> float:
        stall = profile.message_stall if a.kind in MESSAGE_KINDS else 0.0
        return own(a) + stall + (profile.action_overhead if a.kind in _PAYS_OVERHEAD else 0.0)

    def own(a: Action) -> float:
        st = stages[a.stage]
        if a.kind in compute:
            seconds = getattr(st, compute[a.kind]) * profile.compute_scale
            return seconds + sharded_seconds(profile, plan, st, a) if fsdp else seconds
        if a.kind in SEND_KINDS:
            payload = st.output_bytes if a.kind is Kind.SEND_ACT else st.input_bytes
            return profile.send_overhead + payload * profile.send_seconds_per_byte
        if a.kind is Kind.RECV_ACT:
            return _transfer(profile, st.input_bytes)
        if a.kind is Kind.RECV_GRAD:
            return _transfer(profile, st.output_bytes)
        if a.kind is Kind.ALL_REDUCE and fsdp:
            return sharded_seconds(profile, plan, st, a)
        if a.kind is Kind.ALL_REDUCE and plan.width > 1 and profile.allreduce_bandwidth:
            ring = 2 * (plan.width - 1) / plan.width * st.gradient_bytes / profile.allreduce_bandwidth
            return ring * profile.allreduce_scale + profile.allreduce_latency
        if a.kind is Kind.OPTIMIZER_STEP:
            copy = profile.version_copy if versions > 1 else 0.0  # 2BW copies the newest version first
            return (
                (profile.optimizer_step + copy) * profile.optimizer_scale * st.weight_bytes / total_weights * step_share
            )
        return 0.0

    return cost


def weight_versions(plan: PipelinePlan) -> int:
    """Weight versions the plan's schedule keeps alive."""
    return plan.spec.weight_versions


#: The step's loss every rank holds during a training step, and the last step's, which the
#: engine keeps for ``loss="previous"`` (float32 scalars, runtime/engine.py ``_previous``).
STEP_LOSS_BYTES = 8


def batch_bytes(profile: Profile, plan: PipelinePlan, microbatch_size: int) -> int:
    """Bytes of the batch a rank holds: its replica's (``m * b`` samples), or the whole global batch
    when every rank loads it (``profile.loads_global_batch``); and the step's loss."""
    replicas = plan.width if profile.loads_global_batch else 1
    return int(profile.batch_bytes_per_sample * plan.microbatches * microbatch_size * replicas) + STEP_LOSS_BYTES


def gradient_sets(profile: Profile, plan: PipelinePlan, stage: int) -> int:
    """Batches' gradients ``stage`` holds at once: 2 under 2BW, except on the first rank's stages,
    which step right after the rank's all-reduce unless weights are tied across stages
    (schedules/two_bw.py; unknown ties, ``profile.shared_blocks is None``, count as tied)."""
    if plan.spec.gradient_sets == 1:
        return 1
    if plan.rank_of_stage(stage) > 0 or plan.depth == 1 or profile.shared_blocks is None:
        return 2
    stage_of = {b: s for s, blocks in enumerate(plan.stage_ranges()) for b in blocks}
    tied = any(len({stage_of[b] for b in group}) > 1 for group in profile.shared_blocks)
    return 2 if tied else 1


def traffic(profile: Profile, plan: PipelinePlan, microbatch_size: int) -> tuple[float, float]:
    """Bytes one step moves (pipeline, replicas): activations forward and gradients backward
    across every stage boundary of a pipeline, and the ring all-reduce of every stage's gradients
    (FSDP: their reduce-scatter and the weights' all-gathers, :func:`gathers`)."""
    costs = stage_costs(profile, plan, microbatch_size)
    pipeline = sum(2 * plan.microbatches * st.output_bytes for st in costs[:-1])
    share = (plan.width - 1) / plan.width
    if not sharded(plan):
        return pipeline, sum(2 * share * st.gradient_bytes for st in costs)
    passes = step_gathers(plan)  # all-gathers of each stage's weights per step
    return pipeline, sum(share * (st.gradient_bytes + n * st.weight_bytes) for st, n in zip(costs, passes))


def step_gathers(plan: PipelinePlan) -> list[float]:
    """Per stage, the all-gathers of its weights one step of ``plan`` runs (:func:`gathers` over
    its program): ``2 m`` under ZeRO-3 without split backward, 1 under ZeRO-2, 0 unsharded."""
    per_stage = [0.0] * plan.stages
    for actions in _program(*program_key(plan, 1)):
        for a in actions:
            per_stage[a.stage] += gathers(plan, a)
    return per_stage


def time_balanced(profile: Profile, depth: int, microbatch_size: int) -> tuple[int, ...]:
    """Contiguous partition minimising the slowest stage's profiled F + B time."""
    samples = [b.at(microbatch_size) for b in profile.blocks]
    return tuple(balanced([s.forward + s.backward for s in samples], depth))
