"""Memory-aware partitioning (MadPipe, section 4): optimal against brute force, exact stash counts, its own case."""

from __future__ import annotations

import itertools
import random

import pytest

from lightning_pipe import PipelinePlan
from lightning_pipe.core.partition import balanced
from lightning_pipe.planning import costs, madpipe, predict, programs
from lightning_pipe.planning.madpipe import madpipe_partition
from lightning_pipe.planning.memory import stage_peak_bytes
from lightning_pipe.planning.predict import predict_memory
from lightning_pipe.planning.profile import BlockProfile, BlockSample, Profile
from lightning_pipe.planning.search import candidates
from lightning_pipe.schedules import build_schedule
from lightning_pipe.schedules.simulate import simulate, unit_costs


def _chain(times: list[float], saved: list[int], out: int = 64, weights: int = 1000, data: float = 32.0) -> Profile:
    blocks = [
        BlockProfile(f"b{i}", [BlockSample(1, t / 3, 2 * t / 3, t / 3, t / 3, a, out)], weights, weights, 2 * weights)
        for i, (t, a) in enumerate(zip(times, saved))
    ]
    return Profile(blocks, input_bytes_per_sample=data)


def _stage_memory(profile: Profile, a: int, z: int, s: int, depth: int, m: int, schedule: str) -> float:
    """Peak bytes of blocks ``a .. z-1`` as stage ``s``: the planner's memory model for that one
    stage (tested against measured steps in test_planner.py), so that the brute force below and
    the dynamic program search the same function, and only the search is compared."""
    plan = PipelinePlan(depth=depth, microbatches=m, schedule=schedule)
    stage = costs.range_costs(profile, range(a, z), 1)
    return stage_peak_bytes(
        stage, programs.held(plan)[s], 1, False, s == 0, s == depth - 1, costs.batch_bytes(profile, plan, 1)
    )


def _brute_force(
    profile: Profile, schedule: str, depth: int, m: int, limit: float
) -> tuple[float, tuple[int, ...]] | None:
    """Every contiguous partition; the fastest whose every stage fits (:func:`_stage_memory`)."""
    n, best = len(profile.blocks), None
    samples = [b.at(1) for b in profile.blocks]
    for cuts in itertools.combinations(range(1, n), depth - 1):
        bounds = [0, *cuts, n]
        period, fits = 0.0, True
        for s, (a, z) in enumerate(zip(bounds, bounds[1:])):
            fits &= _stage_memory(profile, a, z, s, depth, m, schedule) <= limit
            period = max(period, sum(samples[i].forward + samples[i].backward for i in range(a, z)))
        if fits and (best is None or period < best[0] - 1e-12):
            best = (period, tuple(z - a for a, z in zip(bounds, bounds[1:])))
    return best


def held_microbatches(schedule: str, depth: int, microbatches: int) -> list[int]:
    """Microbatches each stage keeps for its backward at the peak of the simulated program."""
    return simulate(build_schedule(schedule, depth, microbatches), unit_costs()).peak_stash


def test_held_microbatches_are_the_schedules_exact_counts() -> None:
    for d, m in itertools.product(range(1, 7), range(1, 9)):
        assert held_microbatches("1f1b", d, m) == [min(d - s, m) for s in range(d)]
        assert held_microbatches("gpipe", d, m) == [m] * d


def test_dynamic_program_is_optimal_against_brute_force() -> None:
    rng = random.Random(0)
    checked = infeasible = 0
    for _ in range(250):
        n = rng.randint(2, 8)
        depth = rng.randint(1, min(n, 4))
        m = rng.choice([1, 2, 4])
        schedule = rng.choice(["1f1b", "gpipe"])
        profile = _chain([rng.uniform(0.5, 3.0) for _ in range(n)], [rng.randint(100, 5000) for _ in range(n)])
        limit = rng.uniform(5_000, 60_000)
        plan = PipelinePlan(depth=depth, microbatches=m, schedule=schedule)
        got = madpipe_partition(profile, plan, 1, limit)
        want = _brute_force(profile, schedule, depth, m, limit)
        assert (got is None) == (want is None), (n, depth, m, schedule, limit, got, want)
        if got is None:
            infeasible += 1
            continue
        assert got.period == pytest.approx(want[0])
        assert max(got.stage_memory) <= limit and sum(got.sizes) == n and len(got.sizes) == depth
        checked += 1
    assert checked > 100 and infeasible > 20  # both outcomes exercised


def test_memory_heavy_first_block_fits_only_with_the_memory_aware_partition() -> None:
    # MadPipe's networks keep most activations in their first layers: here block 0 saves 8 times
    # what the others do, with equal compute. Under 1F1B stage 0 holds d microbatches of them.
    times, saved = [1.0] * 8, [8000] + [1000] * 7
    profile = _chain(times, saved)
    plan = PipelinePlan(depth=4, microbatches=4, schedule="1f1b")
    balanced_sizes = tuple(balanced(times, 4))
    assert balanced_sizes == (2, 2, 2, 2)
    limit = 40_000
    got = madpipe_partition(profile, plan, 1, limit)
    assert got is not None and got.sizes[0] == 1 and max(got.stage_memory) <= limit
    want = _brute_force(profile, "1f1b", 4, 4, limit)
    assert want is not None and got.period == pytest.approx(want[0]) == 3.0
    # The time-balanced partition does not fit: stage 0 holds 4 x (8000 + 1000) bytes of activations.
    balanced_plan = plan.replace(partition=balanced_sizes)
    peaks = predict_memory(profile, balanced_plan, 1, predict.predict_step(profile, balanced_plan, 1)[1])
    assert peaks[0] > limit
    # The planner's search offers the memory-aware partition next to the time-balanced one.
    offered = {
        c.plan.partition for c in candidates(profile, 4, 4, schedules=["1f1b"], memory_limit=limit) if c.plan.depth == 4
    }
    assert balanced_sizes in offered and got.sizes in offered


def test_the_lower_bound_never_rejects_a_stage_that_fits() -> None:
    # The DP rejects most ranges on a bound from prefix sums before computing their memory: at
    # exactly a range's memory it must accept, one byte under it must reject.
    from lightning_pipe.planning.madpipe import _Chain

    rng = random.Random(4)
    profile = _chain([rng.uniform(0.5, 3.0) for _ in range(7)], [rng.randint(100, 5000) for _ in range(7)])
    ranges = madpipe.RangeCosts(profile)
    for schedule, depth, m, split in (("gpipe", 2, 4, False), ("1f1b", 3, 6, True), ("2bw", 3, 4, False)):
        chain = _Chain(ranges, PipelinePlan(1, depth, m, schedule, split), 1)
        for a, z, s in ((a, z, s) for a in range(7) for z in range(a + 1, 8) for s in range(depth)):
            memory = chain.memory(a, z, s)
            assert chain.fits(a, z, s, memory) and not chain.fits(a, z, s, memory - 1), (schedule, a, z, s)
