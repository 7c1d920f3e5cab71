"""Memory-aware contiguous partitioning (MadPipe, Beaumont et al., section 4): a DP per target period, searched.

MadPipe-DP (MadPipe, section 4.2.2) takes a target period ``T^`` and splits a chain into stages whose
memory, counted from how many activations each stage must keep, fits the device; the
target is then found by binary search (4.2.3, Algorithm 1). Here the stages are contiguous
and every processor is "normal" (no special processor), and the activation count of a stage
is exact rather than MadPipe's 1F1B* group estimate: it is the simulator's peak stash for the
schedule that will run (``d - s`` on stage ``s`` under 1F1B, ``m`` everywhere under GPipe), so
the memory the DP budgets is the memory the planner predicts for the same plan.

With two stages per rank (interleaved and V placements) a rank's period and memory are sums
over its two non-contiguous stages: :func:`madpipe_partition` then runs an exact min-max
dynamic program over pairs of stages (:func:`_paired`), on a per-stage memory estimate that
bounds the rank's from above (:func:`stage_held`).
"""

from __future__ import annotations

import bisect
import functools
import itertools
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from lightning_pipe.core.pipeline_plan import PipelinePlan
from lightning_pipe.planning.costs import (
    StageCosts,
    batch_bytes,
    bucket_cap,
    range_costs,
    time_balanced,
    weight_versions,
)
from lightning_pipe.planning.held import (
    HeldCounts,
    Point,
    _dominant,
    by_size,
)
from lightning_pipe.planning.memory import _bucketed_moment, stage_peak_bytes
from lightning_pipe.planning.profile import BlockSample, Profile
from lightning_pipe.planning.programs import held, moments, program_key
from lightning_pipe.schedules.layout import rank_stages


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
            self._costs[key] = range_costs(
                self.profile, range(start, stop), microbatch_size, samples=samples, bucket_cap=bucket_cap
            )
        return self._costs[key]

    def peak(
        self,
        start: int,
        stop: int,
        microbatch_size: int,
        bucket_cap: int,
        held: HeldCounts,
        versions: int,
        first: bool,
        last: bool,
        batch_bytes: int,
    ) -> int:
        """:func:`stage_peak_bytes` of blocks ``start .. stop-1`` as one stage (no recompute), computed once."""
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


@dataclass(frozen=True)
class Partition:
    """A memory-feasible contiguous partition, its period (slowest rank's F + B seconds over its
    stages), each stage's memory as the dynamic program counts it, and each pipeline rank's
    (the sum over its stages; with one stage per rank, the stage's)."""

    sizes: tuple[int, ...]
    period: float
    stage_memory: tuple[int, ...]
    rank_memory: tuple[int, ...] = ()


class _Chain:
    """Stage time and memory of any block range at one microbatch size (the planner's own formulas)."""

    def __init__(self, ranges: RangeCosts, plan: PipelinePlan, microbatch_size: int) -> None:
        self.ranges, self.b, self.cap = ranges, microbatch_size, bucket_cap(plan)
        self.held, self.depth = held(plan), plan.depth
        self.versions, self.batch = weight_versions(plan), batch_bytes(ranges.profile, plan, microbatch_size)
        blocks, samples = ranges.profile.blocks, ranges.samples(microbatch_size)
        self._elapsed = [0.0, *itertools.accumulate(x.forward + x.backward for x in samples)]
        self.memory = functools.lru_cache(maxsize=None)(self._memory)  # type: ignore[method-assign]  # each DP asks again
        # A lower bound of a stage's memory, from prefix sums: its weights (times the versions)
        # and optimizer state, the batch, and the saved tensors of the most microbatches it
        # holds at a forward (every forward moment's bytes hold those: stage_memory_terms).
        self._state = [0, *itertools.accumulate(self.versions * b.parameter_bytes + b.optimizer_bytes for b in blocks)]
        self._saved = [0, *itertools.accumulate(x.saved_bytes for x in samples)]
        self._forward_held = [max((p[0] for p in h.forward_cold + h.forward_warm), default=0) for h in self.held]

    def time(self, start: int, stop: int) -> float:
        """MadPipe's U(k, l): F + B seconds of blocks ``start .. stop-1`` (range_costs' sums, from prefix sums)."""
        return self._elapsed[stop] - self._elapsed[start]

    def fits(self, start: int, stop: int, stage: int, limit: float) -> bool:
        """Whether :meth:`memory` is at most ``limit`` (the lower bound answers most rejections)."""
        bound = self._state[stop] - self._state[start] + self.batch
        if bound + self._forward_held[stage] * (self._saved[stop] - self._saved[start]) > limit:
            return False
        return self.memory(start, stop, stage) <= limit

    def _memory(self, start: int, stop: int, stage: int) -> int:
        """MadPipe's M(k, l, g) with g the exact count of stage ``stage`` (the planner's stage_peak_bytes)."""
        last = stage == self.depth - 1
        return self.ranges.peak(
            start, stop, self.b, self.cap, self.held[stage], self.versions, stage == 0, last, self.batch
        )


def _fits(chain: _Chain, n: int, depth: int, target: float, limit: float) -> Optional[tuple[int, ...]]:
    """MadPipe-DP for a target period: a split of blocks into ``depth`` stages, each at most
    ``target`` seconds and ``limit`` bytes, or ``None``. Stage ``s`` starts at block ``i``."""

    @functools.lru_cache(maxsize=None)
    def rest(i: int, s: int) -> Optional[tuple[int, ...]]:
        if s == depth:
            return () if i == n else None
        for stop in range(i + 1, n - (depth - s - 1) + 1) if s < depth - 1 else (n,):  # the last stage takes the rest
            if chain.time(i, stop) > target:
                break  # longer stages only take longer
            if chain.fits(i, stop, s, limit):
                tail = rest(stop, s + 1)
                if tail is not None:
                    return (stop - i, *tail)
        return None

    return rest(0, 0)


def madpipe_partition(
    profile: Profile, plan: PipelinePlan, microbatch_size: int, memory_limit: float, ranges: Optional[RangeCosts] = None
) -> Optional[Partition]:
    """The contiguous partition of ``plan``'s depth with the smallest period whose every stage fits ``memory_limit``.

    Binary search (MadPipe, section 4.2.3) over the candidate periods, the times of every contiguous
    block range: feasibility is monotone in the target, so the smallest feasible one is optimal.
    The time-balanced partition's period is tried first: no partition is faster, and it often
    fits. Else the loosest period (when nothing fits there the search is over), then the
    periods between.

    ``ranges``: the profile's block-range costs, shared by the searches over many plans.

    With two stages per rank (``virtual_stages=2``, loop or V placement) the chain is cut into
    ``2d`` stages, a rank's period is the sum of its two stages' F + B seconds, and its memory
    the sum of its two stages' (:class:`_VirtualChain`). The cut minimizing the slowest rank's
    period with every rank within the limit is found exactly by a min-max dynamic program in
    the spirit of MadPipe-DP (MadPipe, section 4.2.2): for each boundary between the two rounds
    of stages, :func:`_paired` walks the ranks in order, each step choosing a rank's two stages
    at once, the state being where each round has got to. Its cost is
    ``O(d * sum_c (c - d)^2 (n - c - d)^2) = O(d n^5)`` array operations for ``n`` blocks (numpy), and
    ``2d * n^2 / 2`` stage memories, each computed once per profile and counts (:class:`RangeCosts`).

    The approximation (two stages per rank): a rank's memory is taken as the sum of its stages'
    :func:`stage_peak_bytes`, each over the points the stage holds at every moment of its rank's
    program (:func:`stage_held`), the batch counted once. Each stage's peak bounds its share of
    the rank's at every moment, so the sum bounds :func:`rank_peak_bytes` from above up to its
    cross-layout receive padding (its peaks fall at different moments, so it can exceed the
    rank's peak): a partition found fits when the planner predicts it, and one at the limit may be missed.
    Above two stages per rank the result is ``None`` (no memory-aware partition is offered).
    Of the cuts with the smallest period the time-balanced one is returned where it is one of
    them and fits (the rank-sum period has lopsided minima too, which pipeline worse). Above
    :data:`VIRTUAL_BLOCKS` blocks the dynamic program (``O(d n^5)``) is not run: ``None``.

    Returns:
        ``None`` if no contiguous partition fits the limit.
    """
    if plan.virtual_stages > 1:
        if plan.virtual_stages != 2:
            return None
        return _virtual_partition(profile, plan, microbatch_size, memory_limit, ranges)
    n, depth, ranges = len(profile.blocks), plan.depth, RangeCosts.of(profile, ranges)
    chain = _Chain(ranges, plan, microbatch_size)
    targets = sorted({chain.time(i, j) for i in range(n) for j in range(i + 1, n + 1)})
    # Algorithm 1's lower bound U(1, L) / P, tightened: no partition is faster than the
    # time-balanced one, which often fits (a margin for the two ways of summing the times).
    balanced = ranges.balanced(depth, microbatch_size)
    floor = max(chain.time(a, a + k) for a, k in zip(itertools.accumulate((0, *balanced)), balanced))
    lo, hi = bisect.bisect_left(targets, floor * (1 - 1e-9)), len(targets) - 1
    best = _fits(chain, n, depth, targets[lo], memory_limit) if lo < hi else None
    if best is not None:
        hi = lo - 1
    else:
        best = _fits(
            chain, n, depth, targets[hi], memory_limit
        )  # the loosest period: if nothing fits there, nothing does
        if best is None:
            return None
        lo, hi = lo + 1, hi - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        found = _fits(chain, n, depth, targets[mid], memory_limit)
        if found is None:
            lo = mid + 1
        else:
            best, hi = found, mid - 1
    starts = [sum(best[:s]) for s in range(depth)]
    period = max(chain.time(a, a + k) for a, k in zip(starts, best))
    memory = tuple(chain.memory(a, a + k, s) for s, (a, k) in enumerate(zip(starts, best)))
    return Partition(best, period, memory, memory)


_STAGE_HELD: dict[tuple[Any, ...], tuple[HeldCounts, ...]] = {}


def _stage_held(plan: PipelinePlan) -> tuple[HeldCounts, ...]:
    depth, virtual, placement, width = plan.depth, plan.virtual_stages, plan.stage_placement, plan.width
    seen: list[dict[str, set[Point]]] = [
        {name: set() for name in HeldCounts.__dataclass_fields__} for _ in range(depth * virtual)
    ]
    for r, walked in enumerate(moments(plan)):
        mine = rank_stages(r, depth, virtual, placement)
        for c, kind, points, grads in walked:
            if width > 1:  # the rank's shared gradient buckets (rank_peak_bytes)
                kind, grads = _bucketed_moment(kind, grads)
            for o, (point, warm) in enumerate(zip(points, grads)):
                name = kind if o == c else ("forward_warm" if warm else "forward_cold")
                seen[mine[o]][name].add(_as_sent(point))
    return tuple(HeldCounts(**{name: _dominant(points) for name, points in s.items()}) for s in seen)


def _as_sent(point: Point) -> Point:
    """A rank moment's point with its buffers as one stage's :data:`~.held.Sent` ``(output-sized,
    input-sized)``: a point walked with :func:`~.held.buffered_by_kind` counts them by
    kind, then its output-sized tensors kept for the next stage on the rank (gradients handed
    over, outputs kept for that stage's W) and the rank's earlier batches alive
    (2BW), which stay the point's third count; summed here, each at its own size."""
    held, pending, sends = point
    if len(sends) <= 3:
        return point
    counts, handed, earlier = sends[:-2], sends[-2], sends[-1]
    outputs, inputs = by_size(counts)
    outputs += handed
    return held, pending, (outputs, inputs, earlier) if earlier else (outputs, inputs)


def stage_held(plan: PipelinePlan) -> tuple[HeldCounts, ...]:
    """Per stage of an interleaved plan, the points it holds at every moment of its rank's program
    (:func:`~lightning_pipe.planning.programs.moments`): at the moments its rank runs it, as the
    rank's moment; at the moments its rank runs another of its stages, as a forward's (whose bytes,
    :func:`stage_memory_terms`, bound the :func:`resting_bytes` the rank counts there, plus its buffers).
    So the stage's :func:`stage_peak_bytes` over these counts is at least its share of its rank's
    :func:`rank_peak_bytes` at every moment (cached per program)."""
    key = (*program_key(plan, 1), plan.width > 1)
    if key not in _STAGE_HELD:
        if len(_STAGE_HELD) >= 256:  # bounded, like the program caches it is built from
            _STAGE_HELD.clear()
        _STAGE_HELD[key] = _stage_held(plan)
    return _STAGE_HELD[key]


class _VirtualChain:
    """Stage time and memory of any block range as any stage of an interleaved plan: MadPipe's
    U(k, l) and M(k, l, g), with g the stage's own counts over its rank's program (:func:`stage_held`)."""

    def __init__(self, ranges: RangeCosts, plan: PipelinePlan, microbatch_size: int) -> None:
        self.ranges, self.b, self.cap = ranges, microbatch_size, bucket_cap(plan)
        self.held, self.depth, self.stages = stage_held(plan), plan.depth, plan.stages
        self.batch = batch_bytes(ranges.profile, plan, microbatch_size)
        self.versions = weight_versions(plan)  # interleaved 2BW: two, each with its gradients (an upper bound)
        samples = ranges.samples(microbatch_size)
        self._elapsed = [0.0, *itertools.accumulate(x.forward + x.backward for x in samples)]

    def time(self, start: int, stop: int) -> float:
        return self._elapsed[stop] - self._elapsed[start]

    def memory(self, start: int, stop: int, stage: int) -> int:
        """Peak bytes of blocks ``start .. stop-1`` as ``stage`` (the plan's weight versions, as
        rank_peak_bytes counts); the batch is counted with the rank's first stage only."""
        first_round = stage < self.depth
        return self.ranges.peak(
            start,
            stop,
            self.b,
            self.cap,
            self.held[stage],
            self.versions,
            stage == 0,
            stage == self.stages - 1,
            self.batch if first_round else 0,
        )


def _paired(
    times: np.ndarray, memory: list[np.ndarray], lo: int, mid: int, hi: int, limit: float, reverse: bool
) -> tuple[float, list[int], list[int]]:
    """The exact min-max DP of one round boundary ``mid``: blocks ``lo .. mid-1`` cut into ``d``
    stages (the first round, stage ``k`` on rank ``k``), blocks ``mid .. hi-1`` into ``d`` more
    (the second round: stage ``d + k`` on rank ``k``, or under the V placement, ``reverse``, stage
    ``2d - 1 - k``), each rank's two stages together at most ``limit`` bytes, the slowest rank's
    two stages' seconds least. The state after ``k`` ranks is where each round has got to,
    ``(a, b)``; a rank's transition picks both of its stages at once. ``memory[s]``: stage ``s``'s
    bytes by ``[start, stop]``. Returns the period (``inf`` if nothing fits) and each round's cuts."""
    depth = len(memory) // 2
    first = np.arange(lo, mid + 1)
    second = np.arange(mid, hi + 1)
    na, nb = len(first), len(second)
    ta = times[np.ix_(first, first)]  # [a, a']: seconds of a first-round stage
    tb = times[np.ix_(second, second)] if not reverse else times[np.ix_(second, second)].T
    # Second round in the order its stages meet rank 0, 1, ...: forward from mid, or under V back from hi.
    if reverse:
        tb = tb[::-1, ::-1]  # [b, b'] over positions hi, hi-1, ..., mid: stage [hi-b', hi-b)
    best = np.full((na, nb), np.inf)
    best[0, 0] = 0.0
    choices = []
    for k in range(depth):
        partner = 2 * depth - 1 - k if reverse else depth + k
        ma = memory[k][np.ix_(first, first)]
        mb = memory[partner][np.ix_(second, second)]
        mb = mb.T[::-1, ::-1] if reverse else mb
        # Rank k's stage of a round starts after k blocks of it and leaves one to each later
        # stage: from [k, n - (d - k)], to one further (the same width, n - d, in both rounds).
        wa, wb = na - depth, nb - depth
        ia, ja, ib, jb = slice(k, k + wa), slice(k + 1, k + 1 + wa), slice(k, k + wb), slice(k + 1, k + 1 + wb)
        # cost[a, b, a', b']: the rank's two stages' seconds where they fit, else inf.
        cost = ta[ia, ja][:, None, :, None] + tb[ib, jb][None, :, None, :]
        fits = (ma[ia, ja][:, None, :, None] + mb[ib, jb][None, :, None, :]) <= limit
        cost = np.where(fits, cost, np.inf)
        total = np.maximum(best[ia, ib][:, :, None, None], cost).reshape(wa * wb, wa * wb)
        arg = np.argmin(total, axis=0)
        best = np.full((na, nb), np.inf)
        best[ja, jb] = total[arg, np.arange(wa * wb)].reshape(wa, wb)
        came = np.zeros((na, nb, 2), np.int64)  # the state each one came from
        came[ja, jb, 0], came[ja, jb, 1] = (k + arg // wb).reshape(wa, wb), (k + arg % wb).reshape(wa, wb)
        choices.append(came)
    period = float(best[na - 1, nb - 1])
    if not np.isfinite(period):
        return period, [], []
    a, b, cuts_a, cuts_b = na - 1, nb - 1, [], []
    for came in reversed(choices):
        cuts_a.append(a)
        cuts_b.append(b)
        a, b = int(came[a, b, 0]), int(came[a, b, 1])
    cuts_a = [int(first[x]) for x in reversed(cuts_a)]
    cuts_b = [int(hi - x if reverse else second[x]) for x in reversed(cuts_b)]
    return period, cuts_a, cuts_b


#: Chains longer than this get no memory-aware partition for two stages per rank (the dynamic
#: program takes about 0.2 s at 48 blocks and grows as the fifth power).
VIRTUAL_BLOCKS = 48


def _virtual_partition(
    profile: Profile, plan: PipelinePlan, microbatch_size: int, memory_limit: float, ranges: Optional[RangeCosts]
) -> Optional[Partition]:
    """:func:`madpipe_partition` for two stages per rank (loop and V placements): see there."""
    n, depth, stages = len(profile.blocks), plan.depth, plan.stages
    chain = _VirtualChain(RangeCosts.of(profile, ranges), plan, microbatch_size)
    elapsed = np.asarray(chain._elapsed)
    times = elapsed[None, :] - elapsed[:, None]
    times = np.where(np.triu(np.ones((n + 1, n + 1), bool), 1), times, np.inf)  # a stage holds a block
    memory = []
    for s in range(stages):
        m = np.full((n + 1, n + 1), np.inf)
        for a in range(s, n):  # stage s starts after s blocks and leaves one to each later stage
            for z in range(a + 1, n - (stages - 1 - s) + 1):
                m[a, z] = chain.memory(a, z, s)
        memory.append(m)
    if n > VIRTUAL_BLOCKS:
        return None
    reverse = plan.stage_placement == "v"
    found: Optional[tuple[float, list[int], list[int]]] = None
    for mid in range(depth, n - depth + 1):
        got = _paired(times, memory, 0, mid, n, memory_limit, reverse)
        if np.isfinite(got[0]) and (found is None or got[0] < found[0]):
            found = got
    if found is None:
        return None
    _, cuts_a, cuts_b = found
    bounds = [0, *cuts_a, *sorted(cuts_b[:-1]), n]
    best = _partition_of(chain, plan, tuple(z - a for a, z in zip(bounds, bounds[1:])), n)
    balanced = _partition_of(chain, plan, RangeCosts.of(profile, ranges).balanced(stages, microbatch_size), n)
    if max(balanced.rank_memory) <= memory_limit and balanced.period <= best.period * (1 + 1e-9):
        return balanced  # as fast, and its stages pipeline best (the rank-sum period has lopsided minima too)
    return best


def _partition_of(chain: "_VirtualChain", plan: PipelinePlan, sizes: tuple[int, ...], n: int) -> Partition:
    """``sizes`` with its period (the slowest rank's stages together) and stage and rank memories."""
    bounds = list(itertools.accumulate((0, *sizes)))
    stage_memory = tuple(chain.memory(a, z, s) for s, (a, z) in enumerate(zip(bounds, bounds[1:])))
    times = [chain._elapsed[z] - chain._elapsed[a] for a, z in zip(bounds, bounds[1:])]
    rank_memory = tuple(sum(stage_memory[s] for s in plan.stages_of(r)) for r in range(plan.depth))
    period = max(sum(times[s] for s in plan.stages_of(r)) for r in range(plan.depth))
    return Partition(sizes, period, stage_memory, rank_memory)
