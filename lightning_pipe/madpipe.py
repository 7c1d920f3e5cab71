"""Memory-aware contiguous partitioning after MadPipe (seed 004, section 4): a DP for a target period, binary-searched.

MadPipe-DP (seed 004, 4.2.2) takes a target period ``T^`` and splits a chain into stages whose
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
from typing import Optional

from lightning_pipe.layout import PipelinePlan
from lightning_pipe.planner import batch_bytes, bucket_cap, held, range_costs, weight_versions
from lightning_pipe.stage_memory import stage_peak_bytes
from lightning_pipe.profiler import Profile
from lightning_pipe.schedules import build_schedule, two_bw_run
from lightning_pipe.simulate import simulate, unit_costs


@dataclass(frozen=True)
class Partition:
    """A memory-feasible contiguous partition and its period (slowest stage's F + B seconds)."""

    sizes: tuple[int, ...]
    period: float
    stage_memory: tuple[int, ...]


def held_microbatches(schedule: str, depth: int, microbatches: int, split: bool = False) -> list[int]:
    """Microbatches each stage keeps for its backward at the peak, read from the simulated program
    (any registered schedule; the count does not depend on the partition or the costs)."""
    program = (two_bw_run(depth, microbatches, 2, split) if schedule == "2bw"
               else build_schedule(schedule, depth, microbatches, split))  # fmt: skip
    return simulate(program, unit_costs()).peak_stash


class _Chain:
    """Stage time and memory of any block range at one microbatch size (the planner's own formulas)."""

    def __init__(self, profile: Profile, plan: PipelinePlan, microbatch_size: int) -> None:
        self.profile, self.b = profile, microbatch_size
        self.held = held(plan)
        self.versions, self.depth = weight_versions(plan), plan.depth
        self.batch = batch_bytes(profile, plan, microbatch_size)
        samples = [block.at(microbatch_size) for block in profile.blocks]
        cap = bucket_cap(plan)
        self.costs = functools.lru_cache(maxsize=None)(
            lambda a, z: range_costs(profile, range(a, z), microbatch_size, samples=samples, bucket_cap=cap))
        self.memory = functools.lru_cache(maxsize=None)(self._memory)  # type: ignore[method-assign]
        self._elapsed = [0.0, *itertools.accumulate(x.forward + x.backward for x in samples)]

    def time(self, start: int, stop: int) -> float:
        """U(k, l) of seed 004: F + B seconds of blocks ``start .. stop-1`` (range_costs' sums, from prefix sums)."""
        return self._elapsed[stop] - self._elapsed[start]

    def _memory(self, start: int, stop: int, stage: int) -> int:
        """M(k, l, g) of seed 004 with g the exact count of stage ``stage``."""
        first, last = stage == 0, stage == self.depth - 1
        return stage_peak_bytes(self.costs(start, stop), self.held[stage], self.versions, False, first, last, self.batch)


def _fits(chain: _Chain, n: int, depth: int, target: float, limit: float) -> Optional[tuple[int, ...]]:
    """MadPipe-DP for a target period: a split of blocks into ``depth`` stages, each at most
    ``target`` seconds and ``limit`` bytes, or ``None``. Stage ``s`` starts at block ``i``."""

    @functools.lru_cache(maxsize=None)
    def rest(i: int, s: int) -> Optional[tuple[int, ...]]:
        if s == depth:
            return () if i == n else None
        for stop in range(i + 1, n - (depth - s - 1) + 1):
            if chain.time(i, stop) > target:
                break  # longer stages only take longer
            if chain.memory(i, stop, s) <= limit:
                tail = rest(stop, s + 1)
                if tail is not None:
                    return (stop - i, *tail)
        return None

    return rest(0, 0)


def madpipe_partition(profile: Profile, plan: PipelinePlan, microbatch_size: int, memory_limit: float) -> Optional[Partition]:
    """The contiguous partition of ``plan``'s depth with the smallest period whose every stage fits ``memory_limit``.

    Binary search (seed 004, 4.2.3) over the candidate periods, the times of every contiguous
    block range: feasibility is monotone in the target, so the smallest feasible one is optimal.

    Returns:
        ``None`` if no contiguous partition fits the limit.
    """
    n, depth = len(profile.blocks), plan.depth
    chain = _Chain(profile, plan, microbatch_size)
    targets = sorted({chain.time(i, j) for i in range(n) for j in range(i + 1, n + 1)})
    lo = bisect.bisect_left(targets, chain.time(0, n) / depth)  # lb = U(1, L) / P (Algorithm 1)
    best: Optional[tuple[int, ...]] = None
    hi = len(targets) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        found = _fits(chain, n, depth, targets[mid], memory_limit)
        if found is None:
            lo = mid + 1
        else:
            best, hi = found, mid - 1
    if best is None:
        return None
    starts = [sum(best[:s]) for s in range(depth)]
    period = max(chain.time(a, a + k) for a, k in zip(starts, best))
    memory = tuple(chain.memory(a, a + k, s) for s, (a, k) in enumerate(zip(starts, best)))
    return Partition(best, period, memory)
