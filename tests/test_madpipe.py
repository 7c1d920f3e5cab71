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


# Two stages per rank: (schedule, placement) pairs the search plans.
_VIRTUAL = (("1f1b", "loop"), ("looped_bfs", "loop"), ("looped_bfs", "v"), ("zbv", "v"))


def _virtual_brute_force(profile: Profile, plan: PipelinePlan, limit: float) -> tuple[float, tuple[int, ...]] | None:
    """Every contiguous cut into ``2d`` stages; the one whose slowest rank (its stages' F + B
    seconds summed) is fastest with every rank's memory (its stages' :func:`stage_peak_bytes`
    over :func:`madpipe.stage_held`, the batch with its first-round stage) within ``limit``."""
    n, stages, depth = len(profile.blocks), plan.stages, plan.depth
    samples = [b.at(1) for b in profile.blocks]
    held_ = madpipe.stage_held(plan)
    batch = costs.batch_bytes(profile, plan, 1)
    cap = costs.bucket_cap(plan)
    best = None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = [0, *cuts, n]
        spans = list(zip(bounds, bounds[1:]))
        memory = [
            stage_peak_bytes(
                costs.range_costs(profile, range(a, z), 1, bucket_cap=cap),
                held_[s],
                1,
                False,
                s == 0,
                s == stages - 1,
                batch if s < depth else 0,
            )
            for s, (a, z) in enumerate(spans)
        ]
        seconds = [sum(samples[i].forward + samples[i].backward for i in range(a, z)) for a, z in spans]
        ranks = [plan.stages_of(r) for r in range(depth)]
        if any(sum(memory[s] for s in mine) > limit for mine in ranks):
            continue
        period = max(sum(seconds[s] for s in mine) for mine in ranks)
        if best is None or period < best[0] - 1e-12:
            best = (period, tuple(z - a for a, z in spans))
    return best


def test_two_stages_per_rank_are_optimal_against_brute_force() -> None:
    rng = random.Random(1)
    checked = infeasible = binding = 0
    for trial in range(60):
        schedule, placement = _VIRTUAL[trial % len(_VIRTUAL)]
        n = rng.randint(4, 10)
        m = rng.choice([2, 4])
        plan = PipelinePlan(depth=2, microbatches=m, schedule=schedule, virtual_stages=2, placement=placement)
        profile = _chain([rng.uniform(0.5, 3.0) for _ in range(n)], [rng.randint(100, 5000) for _ in range(n)])
        free = _virtual_brute_force(profile, plan, float("inf"))
        assert free is not None
        for limit in (float("inf"), rng.uniform(20_000, 80_000)):
            got = madpipe_partition(profile, plan, 1, limit)
            want = _virtual_brute_force(profile, plan, limit)
            assert (got is None) == (want is None), (schedule, placement, n, limit, got, want)
            if got is None:
                infeasible += 1
                continue
            assert got.period == pytest.approx(want[0]), (schedule, placement, n, limit, got, want)
            assert sum(got.sizes) == n and len(got.sizes) == 4 and min(got.sizes) >= 1
            assert max(got.rank_memory) <= limit
            # The period reported is the partition's own.
            seconds = [sum(t for t in _times(profile)[a : a + k]) for a, k in zip(_starts(got.sizes), got.sizes)]
            assert max(sum(seconds[s] for s in plan.stages_of(r)) for r in range(2)) == pytest.approx(got.period)
            binding += got.period > free[0] + 1e-9
            checked += 1
    assert checked > 40 and infeasible > 5 and binding > 5  # every outcome exercised


def _times(profile: Profile) -> list[float]:
    return [s.forward + s.backward for s in (b.at(1) for b in profile.blocks)]


def _starts(sizes: tuple[int, ...]) -> list[int]:
    return [sum(sizes[:s]) for s in range(len(sizes))]


def test_two_stages_per_rank_memory_bounds_the_planners_prediction() -> None:
    # The dynamic program's rank memory (its stages' peaks summed) is at least what the planner
    # predicts for the partition it returns: what it finds fits when evaluated.
    rng = random.Random(2)
    for trial in range(12):
        schedule, placement = _VIRTUAL[trial % len(_VIRTUAL)]
        n = rng.randint(6, 12)
        times, saved = [rng.uniform(0.5, 3.0) for _ in range(n)], [rng.randint(100, 5000) for _ in range(n)]
        profile = _chain(times, saved, data=rng.choice([32.0, 20_000.0]))  # a large first input too
        plan = PipelinePlan(depth=3, microbatches=6, schedule=schedule, virtual_stages=2, placement=placement)
        got = madpipe_partition(profile, plan, 1, float("inf"))
        assert got is not None
        planned = plan.replace(partition=got.sizes)
        predicted = predict_memory(profile, planned, 1, None)
        assert all(mine >= p for mine, p in zip(got.rank_memory, predicted)), (schedule, got, predicted)


def test_search_chooses_the_interleaved_memory_aware_partition_under_a_budget() -> None:
    # Blocks 0 and 1 save 6 times what the others do, with equal compute; interleaved 1F1B holds
    # the most microbatches on rank 0, whose first stage the time-balanced cut gives both.
    from lightning_pipe.planning.search import search

    times, saved = [1.0] * 8, [6000, 6000] + [1000] * 6
    profile = _chain(times, saved)
    balanced_sizes = tuple(balanced(times, 4))
    assert balanced_sizes == (2, 2, 2, 2)
    limit = 60_000
    ranked = search(profile, 2, 4, memory_limit=limit, schedules=["1f1b"], virtual_stages=(2,))
    best = ranked[0]
    assert best.feasible and best.plan.virtual_stages == 2, best.plan.describe()
    assert best.plan.partition != balanced_sizes and not any(best.plan.recompute)
    plan = best.plan.replace(partition=balanced_sizes)
    want = madpipe_partition(profile, plan, best.microbatch_size, limit)
    assert want is not None and best.plan.partition == want.sizes == (1, 1, 3, 3)
    # The time-balanced cut of the same plan does not fit, and with recompute it is slower.
    assert max(predict_memory(profile, plan, best.microbatch_size, None)) > limit
    time_balanced = [p for p in ranked if p.plan.partition == balanced_sizes and p.feasible]
    assert time_balanced and all(p.samples_per_second < best.samples_per_second for p in time_balanced)


def test_two_stages_per_rank_keep_the_time_balanced_cut_among_the_fastest() -> None:
    # Equal blocks: every cut giving each rank half the chain has the smallest rank-sum period,
    # lopsided ones ((1, 7, 7, 1) under the V) too; the equal stages pipeline best and are returned.
    profile = _chain([1.0] * 16, [1000] * 16)
    for schedule, placement in (("1f1b", "loop"), ("zbv", "v")):
        plan = PipelinePlan(depth=2, microbatches=4, schedule=schedule, virtual_stages=2, placement=placement)
        assert madpipe_partition(profile, plan, 1, float("inf")).sizes == (4, 4, 4, 4)
