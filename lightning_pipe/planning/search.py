"""The layout search: every candidate plan for N devices, predicted, filtered by memory and ranked."""

from __future__ import annotations

import contextlib
import gc
import itertools
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional, Sequence

from lightning_pipe.core.pipeline_plan import PipelinePlan
from lightning_pipe.planning.madpipe import RangeCosts
from lightning_pipe.planning.predict import Prediction, predict
from lightning_pipe.planning.profile import BlockSample, Profile
from lightning_pipe.schedules.passes import check_two_bw_split
from lightning_pipe.schedules.registry import SCHEDULE_NAMES, get


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


#: Split backward as the search tries it: off, on with the schedule's own W placement, and on
#: with "drain" (1F1B's peak memory: only the backwards after a stage's last forward split).
_SPLITS = ((False, None), (True, None), (True, "drain"))


def candidates(
    profile: Profile,
    devices: int,
    global_batch: int,
    allow_stale: bool = False,
    schedules: Optional[Sequence[str]] = None,
    memory_limit: Optional[float] = None,
    partitions: Sequence[tuple[int, ...]] = (),
    virtual_stages: Sequence[int] = (1, 2),
    ranges: Optional[RangeCosts] = None,
    fsdp: Optional[bool] = None,
) -> Iterator[Candidate]:
    """Every ``(w, d)`` with ``w * d = devices``; every microbatch size ``b`` with
    ``m = global_batch / (w * b)`` whole; every registered schedule (2BW only with
    ``allow_stale``: its update is 1-stale; a schedule registered later is covered with no change
    here); each of ``virtual_stages`` stages per rank (above 1: the schedules of several stages
    per rank, interleaved 1F1B, looped BFS, ZB-V, DualPipeV and 2BW, in each stage placement its
    schedule runs, where ``d * v`` blocks and ``m`` allow); split backward off, on, and for 1F1B on in its
    drain only, one stage per rank (:data:`_SPLITS`); the time-balanced
    partition and, under a memory limit, the memory-aware one
    (:func:`lightning_pipe.planning.madpipe.madpipe_partition`, one or two stages per rank) when they differ;
    and each of ``partitions`` (a running job's own, for example) at its stage count; each
    with DDP replicas and, where :func:`offers_fsdp`, FSDP ones, ZeRO-3 and ZeRO-2 (both: the
    memory limit and the ranking decide between them; ZeRO-3 needs the least memory, ZeRO-2
    gathers the weights once per step).
    ``ranges``: the profile's block-range costs, to share with :func:`evaluate`; ``fsdp``: offer
    FSDP replicas at all (``False``: DDP only, as the AutoPlanner moves; ``None``: under a memory
    limit only, where sharding is what lets a plan fit: FSDP's hooks add time the model of its
    collectives does not price, measured at 1.1-2x its predicted step under gloo on CPU)."""
    fsdp = memory_limit is not None if fsdp is None else fsdp
    specs = [get(s) for s in (schedules or SCHEDULE_NAMES)]
    names = [spec.name for spec in specs if allow_stale or not spec.stale]
    ranges = RangeCosts.of(profile, ranges)
    layouts = _layouts(devices, len(profile.blocks), virtual_stages)
    for (width, depth, virtual), name, (split, placement) in itertools.product(layouts, names, _SPLITS):
        if placement == "drain" and not get(name).offers_drain(virtual):
            continue
        shapes = get(name).placements if virtual > 1 else ("loop",)
        for b, shape in itertools.product(_sizes(global_batch, width), shapes):
            m = global_batch // (width * b)
            if not get(name).runs(depth, m, virtual, shape):
                continue
            if split and get(name).streams and virtual > 1 and not _two_bw_split_runs(depth, m, virtual, shape):
                continue
            plan = PipelinePlan(
                width,
                depth,
                m,
                name,
                split,
                partition=ranges.balanced(depth * virtual, b),
                virtual_stages=virtual,
                split_placement=placement,
                placement=shape if virtual > 1 else None,
            )
            memory_aware = _memory_aware(ranges, plan, b, memory_limit)
            extra = [p for p in partitions if len(p) == plan.stages]
            for partition in dict.fromkeys([plan.partition, *([memory_aware] if memory_aware else []), *extra]):
                for replicas in _replicas(profile, plan.replace(partition=partition), fsdp):
                    yield Candidate(replicas, b)


def _sizes(global_batch: int, width: int) -> list[int]:
    """Microbatch sizes ``b`` that split each replica's share of ``global_batch`` into whole microbatches."""
    return [b for b in range(1, global_batch + 1) if global_batch % (width * b) == 0]


def _replicas(profile: Profile, plan: PipelinePlan, fsdp: bool = True) -> Iterator[PipelinePlan]:
    """``plan`` with DDP replicas, then where FSDP runs and the model prices it (:func:`offers_fsdp`)
    with FSDP replicas, ZeRO-3 and ZeRO-2 (``reshard_after_forward`` True and False)."""
    yield plan
    if fsdp and offers_fsdp(profile, plan):
        yield plan.replace(data_parallel="fsdp", reshard_after_forward=True)
        yield plan.replace(data_parallel="fsdp", reshard_after_forward=False)


def _two_bw_split_runs(depth: int, microbatches: int, virtual: int, placement: str) -> bool:
    """Whether interleaved 2BW with split backward runs there (:func:`check_two_bw_split`)."""
    try:
        check_two_bw_split(depth, microbatches, virtual, placement)
    except ValueError:
        return False
    return True


def offers_fsdp(profile: Profile, plan: PipelinePlan) -> bool:
    """Whether the search offers ``plan`` with ``data_parallel="fsdp"``: replicas to shard over
    (``w > 1``); a schedule the runtime shards (not 2BW: PipelinePlan refuses it); one stage per
    rank (the memory model predicts interleaved FSDP ranks as DDP ones, so they could only rank
    slower at the same memory); no tied weights, known from the profile (``shared_blocks == []``:
    the runtime refuses ties, and unknown ties may be some); and a measured replica bandwidth,
    without which the model could not price FSDP's collectives. Split backward included: the
    memory model holds its stage gathered from an I to its W and counts each gather's flat
    output, the time model each gather its program runs (``costs.gathers``)."""
    return (
        plan.width > 1
        and plan.virtual_stages == 1
        and not plan.spec.streams
        and profile.shared_blocks == []
        and profile.allreduce_bandwidth > 0
    )


def _memory_aware(
    ranges: RangeCosts, plan: PipelinePlan, b: int, memory_limit: Optional[float]
) -> Optional[tuple[int, ...]]:
    if memory_limit is None or plan.depth == 1:
        return None
    from lightning_pipe.planning.madpipe import madpipe_partition

    found = madpipe_partition(ranges.profile, plan, b, memory_limit, ranges)
    return found.sizes if found is not None else None


def evaluate(
    profile: Profile, candidate: Candidate, memory_limit: Optional[float] = None, ranges: Optional[RangeCosts] = None
) -> Prediction:
    """The candidate as is, or with recomputation on exactly the stages that would not fit
    (``ranges``: the profile's block-range costs, shared by a search's candidates)."""
    samples = RangeCosts.of(profile, ranges).samples(candidate.microbatch_size) if ranges is not None else None
    return _with_recompute(profile, candidate.plan, candidate.microbatch_size, memory_limit, samples)


def rank(predictions: Iterable[Prediction]) -> list[Prediction]:
    """Feasible plans first, by predicted throughput; infeasible ones after, also by throughput.
    Plans whose throughputs round to the same float go by step time (two steps a few ulps apart
    can give one quotient), so that a ranking of one global batch is in step order."""
    return sorted(predictions, key=lambda p: (not p.feasible, -p.samples_per_second, p.step_time))


def within_noise(ranked: Sequence[Prediction], noise: float) -> list[Prediction]:
    """The feasible plans of ``ranked`` (best first) predicted within ``noise`` (a fraction) of the best's step."""
    feasible = [p for p in ranked if p.feasible]
    if not feasible:
        return []
    best = feasible[0].samples_per_second
    return [p for p in feasible if p.samples_per_second >= best / (1 + noise)]


def choose(ranked: Sequence[Prediction], noise: float = 0.0) -> Optional[Prediction]:
    """The plan to run: the best feasible one, or among the plans within ``noise`` of it (which the
    measurements cannot tell apart) the one with the least peak memory, then the least memory
    over all its ranks, DDP replicas before FSDP ones (FSDP's time model leaves out each
    collective's latency and FSDP's hooks, so a plan that only ties a DDP one is not taken for
    its memory); ``None`` if none fits."""
    close = within_noise(ranked, noise)
    if not close:
        return None
    return min(
        close,
        key=lambda p: (
            p.plan.data_parallel == "fsdp",
            max(p.stage_memory),
            sum(p.stage_memory),
            -p.samples_per_second,
        ),
    )


def search(
    profile: Profile,
    devices: int,
    global_batch: int,
    memory_limit: Optional[float] = None,
    allow_stale: bool = False,
    schedules: Optional[Sequence[str]] = None,
    partitions: Sequence[tuple[int, ...]] = (),
    virtual_stages: Sequence[int] = (1, 2),
    fsdp: Optional[bool] = None,
) -> list[Prediction]:
    """Every :func:`candidates` plan evaluated and ranked, best first (see :func:`rank`); each
    infeasible one says which stage (or interleaved rank) exceeds the budget and by how much
    (``fsdp``: offer FSDP replicas, see :func:`candidates`)."""
    ranges = RangeCosts(profile)
    found = candidates(
        profile, devices, global_batch, allow_stale, schedules, memory_limit, partitions, virtual_stages, ranges, fsdp
    )
    with _collector_paused():
        return rank(evaluate(profile, c, memory_limit, ranges) for c in found)


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cycle collector off for a search: it builds millions of objects, none in cycles,
    and each collector pass would scan them all."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _with_recompute(
    profile: Profile,
    plan: PipelinePlan,
    b: int,
    memory_limit: Optional[float],
    samples: Optional[Sequence[BlockSample]] = None,
) -> Prediction:
    """The plan as is, or with recomputation on the stages over the limit when that makes it fit (not with split)."""
    first = predict(profile, plan, b, memory_limit, samples)
    if first.feasible or plan.split_backward:
        return first
    over = [mem > (memory_limit or 0) for mem in first.stage_memory]  # per pipeline rank: all its stages
    flags = tuple(over[plan.rank_of_stage(s)] for s in range(plan.stages))
    second = predict(profile, plan.replace(recompute=flags), b, memory_limit, samples)
    return second if second.feasible else first
