"""Cost model and search: predicted step time (the simulator over the plan's real program) and memory per stage.

The step time of a candidate plan is the simulator run over exactly the action lists the
executor would run, each action charged from a :class:`~lightning_pipe.profiler.Profile`.
Seed 000's closed forms (Appendix A, also seed 002) are kept as a cross-check.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import itertools
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

from lightning_pipe.partition import balanced
from lightning_pipe.layout import PipelinePlan
from lightning_pipe.profiler import BlockProfile, BlockSample, Profile
from lightning_pipe.runtime.buckets import DEFAULT_BUCKET_BYTES
from lightning_pipe.schedules import SCHEDULE_NAMES, Action, Kind, build_schedule, two_bw_drain, two_bw_window
from lightning_pipe.schedules.flat import FlatProgram, flatten
from lightning_pipe.schedules.split import drain_applies
from lightning_pipe.simulate import CompiledProgram, Exchange, compile_program
from lightning_pipe.stage_memory import (  # noqa: F401
    HeldCounts,
    Moment,
    buffered,
    program_held_counts,
    rank_moments,
    rank_peak_bytes,
    stage_memory_terms,
    stage_peak_bytes,
    unacknowledged,
)


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
    first_backward_bytes: int = 0  # one microbatch's saved tensors and the gradients during the step's first backward (a recomputed last stage: after the loss's backward)
    captured_bytes: int = 0  # split backward: the gradients one microbatch's I captures for its W
    backward_excess_bytes: Optional[int] = None  # a full backward's peak over the microbatch's saved tensors, blocks freeing theirs as it goes (None: the largest block's temporaries)
    loss_bytes: int = 0  # the last stage: one microbatch's loss, kept until its backward (and the step's running sum)
    loss_saved_bytes: int = 0  # the last stage: what the loss saves for backward (part of stash_bytes; kept outside a recomputed stage)
    optimizer_step_bytes: int = 0  # the temporaries of the stage's optimizer step
    frees_graph_at_input_grad: bool = False  # split backward defers its linear and convolution weight gradients: I frees the graph (runtime/deferred_weights.py)
    input_grad_workspace_bytes: int = 0  # a deferring I's peak temporaries, the later blocks' kept tensors and its incoming gradient with them (_input_grad_peak)


def _backward_peaks(samples: Sequence[BlockSample], grads: Sequence[int], bucket_cap: int = 0, last_incoming: int = 0) -> tuple[int, int]:
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
    than the same block last."""
    inner = [0] + [max(b.saved_input_bytes - a.saved_output_bytes, 0) for a, b in zip(samples, samples[1:])]
    saved = [0] + list(itertools.accumulate(x.saved_bytes + i for x, i in zip(samples, inner)))  # saved[j + 1]: blocks 0..j
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
        peaks.append(saved[j + 1] + held[j + 1] + incoming[j] + x.backward_workspace_bytes)  # before its first weight gradient
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
    alone = dataclasses.replace(x, saved_bytes=x.saved_bytes - x.loss_saved_bytes, backward_workspace_bytes=x.block_backward_workspace_bytes,
                                after_gradient_bytes=x.block_after_gradient_bytes, cold_backward_bytes=x.block_cold_backward_bytes)  # fmt: skip
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


def _input_grad_peak(samples: Sequence[BlockSample]) -> int:
    """A deferring I's peak beyond the stage's graph: it runs the blocks last to first, so while
    one runs, what each later block kept for W is already held, and so is the gradient of the
    block's output unless the block is the stage's last (the stage's model counts that one). The
    model still counts the later blocks' whole graph, so this errs high by what they saved."""
    kept_after, peak = 0, 0
    for i in reversed(range(len(samples))):
        incoming = samples[i].output_bytes if i < len(samples) - 1 else 0  # as in _backward_peaks
        peak = max(peak, samples[i].input_grad_workspace_bytes + kept_after + incoming)
        kept_after += samples[i].captured_bytes
    return peak


def range_costs(profile: Profile, blocks: range, microbatch_size: int, recompute: bool = False,
                samples: Optional[Sequence[BlockSample]] = None, bucket_cap: int = 0) -> StageCosts:  # fmt: skip
    """The profiled costs of blocks ``blocks`` run as one stage at ``microbatch_size`` (``samples``:
    every block already at that size, to save the interpolation; ``bucket_cap``: the most bytes
    of one replica all-reduce bucket, 0 without replicas)."""
    mine = [samples[i] if samples is not None else profile.blocks[i].at(microbatch_size) for i in blocks]
    states = [profile.blocks[i] for i in blocks]
    first = blocks.start
    # A full backward's blocks (with recompute on the last stage, as the loss's backward leaves them; profiled since loss_bytes).
    backward, incoming = _recomputed(mine) if recompute and mine[-1].loss_bytes else (mine, 0)
    first_backward, excess = _backward_peaks(backward, [b.gradient_bytes for b in states], bucket_cap, incoming)
    return StageCosts(
        forward=sum(x.forward for x in mine),
        backward=sum(x.backward + (x.recompute if recompute else 0.0) for x in mine),
        input_grad=sum(x.input_grad for x in mine),
        weight_grad=sum(x.weight_grad for x in mine),
        stash_bytes=sum(x.saved_bytes for x in mine) + _inner_inputs(mine),
        input_bytes=((samples[first - 1] if samples is not None else profile.blocks[first - 1].at(microbatch_size)).output_bytes if first > 0
                     else int(profile.input_bytes_per_sample * microbatch_size)),
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
        input_grad_workspace_bytes=_input_grad_peak(mine),
        # As the executor decides: a stage with an input gradient whose matrices are all linear, convolution or embedding weights.
        frees_graph_at_input_grad=first > 0 and any(b.deferred_weights for b in states) and not any(b.other_matrices for b in states),
    )  # fmt: skip


class RangeCosts:
    """:func:`range_costs` of one profile's block ranges (no recompute), and their peak memory
    as stages, each computed once: a search under a memory limit asks MadPipe's dynamic program
    for every range at every stage count, and many plans hold the same counts."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self._samples: dict[int, list[BlockSample]] = {}
        self._costs: dict[tuple[int, int, int, int], StageCosts] = {}
        self._peaks: dict[tuple[Any, ...], int] = {}
        self._balanced: dict[tuple[int, int], tuple[int, ...]] = {}

    def __call__(self, start: int, stop: int, microbatch_size: int, bucket_cap: int = 0) -> StageCosts:
        """The costs of blocks ``start .. stop-1`` run as one stage."""
        key = (start, stop, microbatch_size, bucket_cap)
        if key not in self._costs:
            samples = self.samples(microbatch_size)
            self._costs[key] = range_costs(self.profile, range(start, stop), microbatch_size, samples=samples, bucket_cap=bucket_cap)
        return self._costs[key]

    def peak(self, start: int, stop: int, microbatch_size: int, bucket_cap: int, held: HeldCounts, versions: int,
             first: bool, last: bool, batch_bytes: int) -> int:  # fmt: skip
        """:func:`stage_peak_bytes` of blocks ``start .. stop-1`` run as one stage (no recompute), each computed once."""
        key = (start, stop, microbatch_size, bucket_cap, held, versions, first, last, batch_bytes)
        if key not in self._peaks:
            costs = self(start, stop, microbatch_size, bucket_cap)
            self._peaks[key] = stage_peak_bytes(costs, held, versions, False, first, last, batch_bytes)
        return self._peaks[key]

    def balanced(self, depth: int, microbatch_size: int) -> tuple[int, ...]:
        """:func:`time_balanced`, each computed once."""
        key = (depth, microbatch_size)
        if key not in self._balanced:
            self._balanced[key] = time_balanced(self.profile, depth, microbatch_size)
        return self._balanced[key]

    @classmethod
    def of(cls, profile: Profile, ranges: Optional["RangeCosts"] = None) -> "RangeCosts":
        """``ranges``, checked to hold ``profile``'s costs, or new ones for it."""
        if ranges is not None and ranges.profile is not profile:
            raise ValueError("ranges must hold the costs of the profile given")
        return ranges or cls(profile)

    def samples(self, microbatch_size: int) -> list[BlockSample]:
        """Every block at ``microbatch_size``."""
        if microbatch_size not in self._samples:
            self._samples[microbatch_size] = [block.at(microbatch_size) for block in self.profile.blocks]
        return self._samples[microbatch_size]


def stage_costs(profile: Profile, plan: PipelinePlan, microbatch_size: int,
                samples: Optional[Sequence[BlockSample]] = None) -> list[StageCosts]:  # fmt: skip
    """Sum the profiled blocks of every stage of ``plan`` (partition resolved) at ``microbatch_size``
    (``samples``: every block already at that size, as :meth:`RangeCosts.samples` keeps them)."""
    cap = bucket_cap(plan)
    return [range_costs(profile, rng, microbatch_size, plan.recompute[s], samples, cap) for s, rng in enumerate(plan.stage_ranges())]


def bucket_cap(plan: PipelinePlan) -> int:
    """Most bytes of a bucket a stage's gradients are averaged in over its replicas, 0 without
    replicas. The engine's default, DDP's 25 MiB: the model does not see ``bucket_cap_mb``; a
    larger cap can hold more than predicted at a first backward, ``0`` (one all-reduce after
    the backward) holds less."""
    return DEFAULT_BUCKET_BYTES if plan.width > 1 else 0


def _transfer(profile: Profile, nbytes: int) -> float:
    return profile.link_latency + nbytes / profile.link_bandwidth


def action_cost(profile: Profile, plan: PipelinePlan, stages: Sequence[StageCosts]) -> Callable[[Action], float]:
    """Seconds of each action of ``plan``'s program: compute from the profile (plus the executor's
    measured overhead per action), sends the time to post them, receives from the link
    (latency + bytes / bandwidth), the all-reduce from the replicas' ring, the step by weight share."""
    total_weights = sum(s.weight_bytes for s in stages) or 1

    compute = {Kind.FORWARD: "forward", Kind.BACKWARD: "backward", Kind.INPUT_GRAD: "input_grad", Kind.WEIGHT_GRAD: "weight_grad"}

    def cost(a: Action) -> float:
        st = stages[a.stage]
        if a.kind in compute:
            return getattr(st, compute[a.kind]) + profile.action_overhead
        if a.kind in (Kind.SEND_ACT, Kind.SEND_GRAD):
            return profile.send_overhead
        if a.kind is Kind.RECV_ACT:
            return _transfer(profile, st.input_bytes)
        if a.kind is Kind.RECV_GRAD:
            return _transfer(profile, st.output_bytes)
        if a.kind is Kind.ALL_REDUCE and plan.width > 1 and profile.allreduce_bandwidth:
            return 2 * (plan.width - 1) / plan.width * st.gradient_bytes / profile.allreduce_bandwidth
        if a.kind is Kind.OPTIMIZER_STEP:
            return profile.optimizer_step * st.weight_bytes / total_weights
        return 0.0

    return cost


def program(plan: PipelinePlan, steps: int = 1) -> list[list[Action]]:
    """The action lists the executor runs for ``plan`` (``steps`` 2BW windows and the drain)."""
    return _program(*_program_key(plan, steps))


def _program_key(plan: PipelinePlan, steps: int) -> tuple:
    return (plan.schedule, plan.depth, plan.microbatches, plan.split_backward, plan.split_max_pending, plan.split_placement, steps,
            plan.virtual_stages)  # fmt: skip


@functools.lru_cache(maxsize=1024)
def _program(schedule: str, depth: int, m: int, split: bool, max_pending: Optional[int], placement: Optional[str], steps: int,
             virtual: int = 1) -> list[list[Action]]:  # fmt: skip
    if schedule == "2bw":  # two_bw_run, from windows shared between the runs of 2 and 3 windows
        parts = [_two_bw_part(depth, m, t, split, False) for t in range(steps)]
        parts.append(_two_bw_part(depth, m, steps - 1, split, True))
        return [list(itertools.chain.from_iterable(part[s] for part in parts)) for s in range(depth)]
    return build_schedule(schedule, depth, m, split, max_pending, virtual, placement)


@functools.lru_cache(maxsize=1024)
def _two_bw_part(depth: int, m: int, step: int, split: bool, drain: bool) -> list[list[Action]]:
    return (two_bw_drain if drain else two_bw_window)(depth, m, step, split)


@functools.lru_cache(maxsize=1024)
def _compiled(*key: Any) -> CompiledProgram:
    return compile_program(_program(*key), _flat(*key))


@functools.lru_cache(maxsize=4)  # a search asks for one program's arrays a few times in a row
def _flat(*key: Any) -> FlatProgram:
    return flatten(_program(*key))


#: One object per distinct :class:`HeldCounts`: programs of many lengths share them, and caches keyed by them hit at once.
_SHARED_COUNTS: "weakref.WeakValueDictionary[HeldCounts, HeldCounts]" = weakref.WeakValueDictionary()


@functools.lru_cache(maxsize=1024)
def _held(*key: Any) -> list[HeldCounts]:
    counts = program_held_counts(_program(*key), warm=key[0] == "2bw", flat=_flat(*key))
    return [_SHARED_COUNTS.setdefault(c, c) for c in counts]


def held(plan: PipelinePlan) -> list[HeldCounts]:
    """Microbatches each stage of ``plan``'s program holds at each kind of moment (cost-free, cached;
    one stage per rank: interleaved plans have :func:`moments`)."""
    if plan.virtual_stages > 1:
        raise ValueError(f"an interleaved rank runs several stages: use planner.moments ({plan.describe()})")
    return _held(*_program_key(plan, 3 if plan.schedule == "2bw" else 1))


@functools.lru_cache(maxsize=1024)
def _moments(*key: Any) -> list[tuple[Moment, ...]]:
    depth, virtual, program, flat = key[1], key[-1], _program(*key), _flat(*key)
    sent = buffered(flat)
    return [rank_moments(actions, range(r, depth * virtual, depth), sent[flat.rank(r)]) for r, actions in enumerate(program)]


def clear_caches() -> None:
    """Forget every program, compiled program and count cached by earlier searches: the next
    search builds them again (as the first search of a process does)."""
    for cached in (_program, _two_bw_part, _compiled, _flat, _held, _moments):
        cached.cache_clear()


def moments(plan: PipelinePlan) -> list[tuple[Moment, ...]]:
    """Every pipeline rank's distinct moments over all its stages (:func:`~lightning_pipe.stage_memory.rank_moments`; cached)."""
    return _moments(*_program_key(plan, 1))


#: What keeps a CPU core busy: compute and the optimizer step.
_CPU_KINDS = frozenset({Kind.FORWARD, Kind.BACKWARD, Kind.INPUT_GRAD, Kind.WEIGHT_GRAD, Kind.OPTIMIZER_STEP})


def exchange(profile: Profile) -> Optional[Exchange]:
    """What a message two ranks send each other at once costs beyond any other, from the
    profile's links (``None`` where its exchange latency is not above its link latency)."""
    extra = profile.exchange_latency - profile.link_latency
    return Exchange(profile.exchange_latency, extra) if extra > 0 else None


def step_time(plan: PipelinePlan, cost: Callable[[Action], float], cores: Optional[int] = None,
              exchange: Optional[Exchange] = None) -> float:  # fmt: skip
    """Seconds of one step of ``plan``'s program under ``cost`` (the simulator's makespan, on the
    program compiled once). 2BW never flushes: its step is one steady-state window, the
    difference of runs of 3 and 2 windows.

    ``cores``: the job's processes share this many CPU cores (one host, CPU device); a step then
    takes at least the compute of every rank of every replica divided by the cores (processes
    that all compute at once share the cores: 4 data-parallel ranks on 2 cores run at half speed).
    ``exchange``: charge the messages two ranks send each other at once more (:func:`exchange`)."""
    if plan.schedule == "2bw":
        longer, shorter = _compiled(*_program_key(plan, 3)), _compiled(*_program_key(plan, 2))
        long_costs, short_costs = longer.costs_from(cost), shorter.costs_from(cost)
        seconds = longer.makespan(long_costs, exchange) - shorter.makespan(short_costs, exchange)
        busy = longer.busy(long_costs, _CPU_KINDS) - shorter.busy(short_costs, _CPU_KINDS)
    else:
        compiled = _compiled(*_program_key(plan, 1))
        costs = compiled.costs_from(cost)
        seconds, busy = compiled.makespan(costs, exchange), compiled.busy(costs, _CPU_KINDS)
    return max(seconds, plan.width * busy / cores) if cores else seconds


def predict_step(profile: Profile, plan: PipelinePlan, microbatch_size: int,
                 costs: Optional[Sequence[StageCosts]] = None) -> tuple[float, list[HeldCounts]]:  # fmt: skip
    """Predicted seconds of one training step (:func:`step_time`), and the microbatches each stage
    holds (:func:`held`; empty for an interleaved plan, whose ranks have :func:`moments`).
    ``costs``: the plan's :func:`stage_costs`, if already summed."""
    cost = action_cost(profile, plan, costs if costs is not None else stage_costs(profile, plan, microbatch_size))
    return step_time(plan, cost, profile.cores, exchange(profile)), (held(plan) if plan.virtual_stages == 1 else [])


def weight_versions(plan: PipelinePlan) -> int:
    """Weight versions the plan's schedule keeps alive."""
    return 2 if plan.schedule == "2bw" else 1


#: The step's loss every rank holds during a training step (a float32 scalar, runtime/engine.py).
STEP_LOSS_BYTES = 4


def batch_bytes(profile: Profile, plan: PipelinePlan, microbatch_size: int) -> int:
    """Bytes of the batch a rank holds: its replica's (``m * b`` samples), or the whole global batch
    when every rank loads it (``profile.loads_global_batch``); and the step's loss."""
    replicas = plan.width if profile.loads_global_batch else 1
    return int(profile.batch_bytes_per_sample * plan.microbatches * microbatch_size * replicas) + STEP_LOSS_BYTES


def gradient_sets(profile: Profile, plan: PipelinePlan, stage: int) -> int:
    """Batches' gradients ``stage`` holds at once: 2 under 2BW, except on the first stage, which
    steps right after its all-reduce unless weights are tied across stages (schedules/two_bw.py;
    unknown ties, ``profile.shared_blocks is None``, count as tied)."""
    if plan.schedule != "2bw":
        return 1
    if stage > 0 or plan.depth == 1 or profile.shared_blocks is None:
        return 2
    stage_of = {b: s for s, blocks in enumerate(plan.stage_ranges()) for b in blocks}
    tied = any(len({stage_of[b] for b in group}) > 1 for group in profile.shared_blocks)
    return 2 if tied else 1


def predict_memory(profile: Profile, plan: PipelinePlan, microbatch_size: int, held: Sequence[HeldCounts],
                   costs: Optional[Sequence[StageCosts]] = None) -> list[int]:  # fmt: skip
    """Predicted peak tensor bytes of every pipeline rank: of its stage
    (:func:`~lightning_pipe.stage_memory.stage_peak_bytes` over ``held``), or of an interleaved
    rank's stages together (:func:`~lightning_pipe.stage_memory.rank_peak_bytes` over :func:`moments`).
    ``costs``: the plan's :func:`stage_costs`, if already summed."""
    costs = costs if costs is not None else stage_costs(profile, plan, microbatch_size)
    versions, batch = weight_versions(plan), batch_bytes(profile, plan, microbatch_size)
    last = len(costs) - 1
    if plan.virtual_stages > 1:
        ranges = plan.stage_ranges()
        return [rank_peak_bytes([costs[s] for s in mine], walked, [plan.recompute[s] for s in mine], [s == 0 for s in mine],
                                [s == last for s in mine], batch, plan.width > 1, _all_split(plan),
                                step_bytes(profile, [profile.blocks[i] for s in mine for i in ranges[s]])) + profile.device_bytes
                for mine, walked in zip(map(plan.stages_of, range(plan.depth)), moments(plan))]  # fmt: skip
    return [stage_peak_bytes(st, held[s], versions, plan.recompute[s], s == 0, s == last, batch, gradient_sets(profile, plan, s),
                             _all_split(plan)) + profile.device_bytes for s, st in enumerate(costs)]  # fmt: skip


def _all_split(plan: PipelinePlan) -> bool:
    """Whether every backward of the plan's program is split (so no forward keeps the loss's graph
    beside a recomputed last stage); "drain" keeps its earlier backwards whole."""
    return plan.split_backward and plan.split_placement != "drain"


def traffic(profile: Profile, plan: PipelinePlan, microbatch_size: int) -> tuple[float, float]:
    """Bytes one step moves (pipeline, replicas): activations forward and gradients backward
    across every stage boundary of a pipeline, and the ring all-reduce of every stage's gradients."""
    costs = stage_costs(profile, plan, microbatch_size)
    pipeline = sum(2 * plan.microbatches * st.output_bytes for st in costs[:-1])
    replicas = sum(2 * (plan.width - 1) / plan.width * st.gradient_bytes for st in costs)
    return pipeline, replicas


def orient(profile: Profile, plan: PipelinePlan, microbatch_size: int, ranks_per_node: int) -> PipelinePlan:
    """``plan`` with its heavier traffic on neighbouring ranks, which share a node (seed 000,
    section 3.3: "stage replicas can be placed on the same server so that expensive all-reduce
    updates are between GPUs on the same server"; here whichever traffic is larger stays there)."""
    if plan.world_size <= ranks_per_node:
        return plan.replace(inner="pp")
    pipeline, replicas = traffic(profile, plan, microbatch_size)
    return plan.replace(inner="pp" if pipeline >= replicas else "dp")


# -- seed 000, Appendix A (seed 002): closed forms, kept as a cross-check -------------------


def appendix_a_time(t_comp: Sequence[float], t_comm_in: Sequence[float], t_comm_dp: Sequence[float],
                    m: int, c_extra: float = 1.0) -> float:  # fmt: skip
    """Seconds per microbatch with pipelining (A.1.1):
    ``t = max_i max(c_extra * T_comp_i + sum_j T_comm_{j->i}, T_comm_i / m(b))``."""
    return max(max(c_extra * tc + ti, td / m) for tc, ti, td in zip(t_comp, t_comm_in, t_comm_dp))


def appendix_a_memory(weights: float, activations_total: float, activations_input: float, d: int, recompute: bool) -> float:
    """2BW footprint of a stage (A.1.2): ``2|W|/d + d|A_total(b)|/d + d|A_input(b)|``, or with
    recomputation ``2|W|/d + |A_total(b)|/d + d|A_input(b)|``."""
    versions = 1 if recompute else d
    return 2 * weights / d + versions * activations_total / d + d * activations_input


# -- the search ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Prediction:
    """One candidate plan with its predicted step time and peak memory per pipeline rank (its
    stage's, or under interleaving its stages' together)."""

    plan: PipelinePlan
    microbatch_size: int
    step_time: float
    stage_memory: tuple[int, ...]
    memory_limit: Optional[float] = None

    @property
    def feasible(self) -> bool:
        """Whether every stage fits the memory limit."""
        return self.memory_limit is None or max(self.stage_memory) <= self.memory_limit

    @property
    def samples_per_second(self) -> float:
        """Predicted throughput over all replicas."""
        return self.plan.width * self.plan.microbatches * self.microbatch_size / self.step_time

    def why_infeasible(self) -> str:
        """Which stage exceeds the budget and by how much ('' if none)."""
        if self.feasible:
            return ""
        r = max(range(len(self.stage_memory)), key=lambda i: self.stage_memory[i])
        over = self.stage_memory[r] - (self.memory_limit or 0)
        where = f"stage {r}" if self.plan.virtual_stages == 1 else f"rank {r} (stages {', '.join(map(str, self.plan.stages_of(r)))})"
        return f"{where} needs {_size(self.stage_memory[r])}, {_size(over)} over the budget"


def _size(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} B"


def predict(profile: Profile, plan: PipelinePlan, microbatch_size: int, memory_limit: Optional[float] = None,
            samples: Optional[Sequence[BlockSample]] = None) -> Prediction:  # fmt: skip
    """Predicted step time and memory of one resolved plan at ``microbatch_size`` (``samples``: every
    block already at that size, see :func:`stage_costs`)."""
    costs = stage_costs(profile, plan, microbatch_size, samples)
    seconds, peaks = predict_step(profile, plan, microbatch_size, costs)
    return Prediction(plan, microbatch_size, seconds, tuple(predict_memory(profile, plan, microbatch_size, peaks, costs)), memory_limit)


def time_balanced(profile: Profile, depth: int, microbatch_size: int) -> tuple[int, ...]:
    """Contiguous partition minimising the slowest stage's profiled F + B time."""
    samples = [b.at(microbatch_size) for b in profile.blocks]
    return tuple(balanced([s.forward + s.backward for s in samples], depth))


def _layouts(devices: int, blocks: int, virtual: Sequence[int]) -> Iterable[tuple[int, int, int]]:
    """``(w, d, v)``: every ``w * d = devices`` with ``v`` stages per rank where ``d * v`` blocks
    allow (interleaving needs ``d >= 2``)."""
    for d in (d for d in range(1, devices + 1) if devices % d == 0):
        yield from ((devices // d, d, v) for v in virtual if d * v <= blocks and (v == 1 or d > 1))


@dataclass(frozen=True)
class Candidate:
    """A plan to evaluate and its per-replica microbatch size."""

    plan: PipelinePlan
    microbatch_size: int


def _runs(name: str, depth: int, m: int, virtual: int) -> bool:
    """Whether schedule ``name`` runs ``m`` microbatches on ``depth`` ranks of ``virtual`` stages each."""
    if virtual > 1:
        return name == "1f1b" and m % depth == 0
    return name != "2bw" or m >= depth


#: Split backward as the search tries it: off, on with the schedule's own W placement, and on
#: with "drain" (1F1B's peak memory: only the backwards after a stage's last forward split).
_SPLITS = ((False, None), (True, None), (True, "drain"))


def candidates(profile: Profile, devices: int, global_batch: int, allow_stale: bool = False,
               schedules: Optional[Sequence[str]] = None, memory_limit: Optional[float] = None,
               partitions: Sequence[tuple[int, ...]] = (), virtual_stages: Sequence[int] = (1, 2),
               ranges: Optional[RangeCosts] = None) -> Iterator[Candidate]:  # fmt: skip
    """Every ``(w, d)`` with ``w * d = devices``; every microbatch size ``b`` with
    ``m = global_batch / (w * b)`` whole; every registered schedule (2BW only with
    ``allow_stale``: its update is 1-stale; a schedule registered later is covered with no change
    here); each of ``virtual_stages`` stages per rank (above 1: interleaved 1F1B, where ``d * v``
    blocks and ``m``, a multiple of ``d``, allow); split backward off, on, and for 1F1B on in its
    drain only, one stage per rank (:data:`_SPLITS`); the time-balanced
    partition and, under a memory limit, the memory-aware one
    (:func:`lightning_pipe.madpipe.madpipe_partition`, one stage per rank) when they differ;
    and each of ``partitions`` (a running job's own, for example) at its stage count.
    ``ranges``: the profile's block-range costs, to share with :func:`evaluate`."""
    names = [s for s in (schedules or SCHEDULE_NAMES) if allow_stale or s != "2bw"]
    ranges = RangeCosts.of(profile, ranges)
    layouts = _layouts(devices, len(profile.blocks), virtual_stages)
    for (width, depth, virtual), name, (split, placement) in itertools.product(layouts, names, _SPLITS):
        if placement == "drain" and not drain_applies(name, virtual):
            continue
        for b in (b for b in range(1, global_batch + 1) if global_batch % (width * b) == 0):
            m = global_batch // (width * b)
            if not _runs(name, depth, m, virtual):
                continue
            plan = PipelinePlan(width, depth, m, name, split, partition=ranges.balanced(depth * virtual, b), virtual_stages=virtual,
                                split_placement=placement)  # fmt: skip
            memory_aware = _memory_aware(ranges, plan, b, memory_limit) if virtual == 1 else None
            extra = [p for p in partitions if len(p) == plan.stages]
            for partition in dict.fromkeys([plan.partition, *([memory_aware] if memory_aware else []), *extra]):
                yield Candidate(plan.replace(partition=partition), b)


def _memory_aware(ranges: RangeCosts, plan: PipelinePlan, b: int, memory_limit: Optional[float]) -> Optional[tuple[int, ...]]:
    if memory_limit is None or plan.depth == 1:
        return None
    from lightning_pipe.madpipe import madpipe_partition

    found = madpipe_partition(ranges.profile, plan, b, memory_limit, ranges)
    return found.sizes if found is not None else None


def evaluate(profile: Profile, candidate: Candidate, memory_limit: Optional[float] = None,
             ranges: Optional[RangeCosts] = None) -> Prediction:  # fmt: skip
    """The candidate as is, or with recomputation on exactly the stages that would not fit
    (``ranges``: the profile's block-range costs, shared by a search's candidates)."""
    samples = RangeCosts.of(profile, ranges).samples(candidate.microbatch_size) if ranges is not None else None
    return _with_recompute(profile, candidate.plan, candidate.microbatch_size, memory_limit, samples)


def rank(predictions: Iterable[Prediction]) -> list[Prediction]:
    """Feasible plans first, by predicted throughput; infeasible ones after, also by throughput."""
    return sorted(predictions, key=lambda p: (not p.feasible, -p.samples_per_second))


def search(profile: Profile, devices: int, global_batch: int, memory_limit: Optional[float] = None,
           allow_stale: bool = False, schedules: Optional[Sequence[str]] = None,
           partitions: Sequence[tuple[int, ...]] = (), virtual_stages: Sequence[int] = (1, 2)) -> list[Prediction]:  # fmt: skip
    """Every :func:`candidates` plan evaluated and ranked, best first (see :func:`rank`); each
    infeasible one says which stage (or interleaved rank) exceeds the budget and by how much."""
    ranges = RangeCosts(profile)
    found = candidates(profile, devices, global_batch, allow_stale, schedules, memory_limit, partitions, virtual_stages, ranges)
    with _collector_paused():
        return rank(evaluate(profile, c, memory_limit, ranges) for c in found)


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cycle collector off for a search: it builds millions of objects, none in cycles,
    and each collector pass scans them all (a fifth of a 64-device search, measured 2026-11-24)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _with_recompute(profile: Profile, plan: PipelinePlan, b: int, memory_limit: Optional[float],
                    samples: Optional[Sequence[BlockSample]] = None) -> Prediction:  # fmt: skip
    """The plan as is, or with recomputation on the stages over the limit when that makes it fit (not with split)."""
    first = predict(profile, plan, b, memory_limit, samples)
    if first.feasible or plan.split_backward:
        return first
    over = [mem > (memory_limit or 0) for mem in first.stage_memory]  # per pipeline rank: all its stages
    flags = tuple(over[s % plan.depth] for s in range(plan.stages))
    second = predict(profile, plan.replace(recompute=flags), b, memory_limit, samples)
    return second if second.feasible else first

