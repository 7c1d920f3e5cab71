"""Memory-aware contiguous partitioning (MadPipe, Beaumont et al., section 4): a DP per target period, searched.

MadPipe-DP (MadPipe, section 4.2.2) takes a target period ``T^`` and splits a chain into stages whose
memory, counted from how many activations each stage must keep, fits the device; the
target is then found by binary search (4.2.3, Algorithm 1). Here the stages are contiguous
and every processor is "normal" (no special processor), and the activation count of a stage
is exact rather than MadPipe's 1F1B* group estimate: it is the simulator's peak stash for the
schedule that will run (``d - s`` on stage ``s`` under 1F1B, ``m`` everywhere under GPipe), so
the memory the DP budgets is the memory the planner predicts for the same plan.
"""

from __future__ import annotations

import bisect
import functools
import itertools
from dataclasses import dataclass
from typing import Any, Optional

from lightning_pipe.core.pipeline_plan import PipelinePlan
from lightning_pipe.planning.costs import (
    StageCosts,
    batch_bytes,
    bucket_cap,
    range_costs,
    time_balanced,
    weight_versions,
)
from lightning_pipe.planning.held import HeldCounts
from lightning_pipe.planning.memory import stage_peak_bytes
from lightning_pipe.planning.profile import BlockSample, Profile
from lightning_pipe.planning.programs import held


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
    """A memory-feasible contiguous partition and its period (slowest stage's F + B seconds)."""

    sizes: tuple[int, ...]
    period: float
    stage_memory: tuple[int, ...]


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

    Returns:
        ``None`` if no contiguous partition fits the limit.
    """
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
    return Partition(best, period, memory)
