"""The benchmark's simulated 2BW rate is what a running stream does, not a restart after a barrier;
its contender selection keeps each of ours with its torch counterpart."""

from __future__ import annotations

import random
import sys

import pytest

from lightning_pipe.schedules import Kind, two_bw_window
from lightning_pipe.schedules.simulate import simulate
from tests.launch import ROOT

sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "examples")]
from bench_pipelines import (  # noqa: E402
    OURS,
    SAME,
    SCHEDULES,
    TORCH,
    _name,
    _schedule_list,
    counterparts,
    page_name,
    running_rate,
    selected,
)

COMPUTE = (Kind.FORWARD, Kind.BACKWARD, Kind.INPUT_GRAD, Kind.WEIGHT_GRAD)


def _random_costs(depth: int, seed: int):
    rng = random.Random(seed)
    table = {(s, kind): rng.uniform(0.5, 1.5) for s in range(depth) for kind in COMPUTE}
    return lambda a: table.get((a.stage, a.kind), 0.0)


def _stream(depth: int, m: int, split: bool, windows: int) -> list[list]:
    return [two_bw_window(depth, m, t, split) for t in range(windows)]


def _steady_rate(depth: int, m: int, split: bool, cost, windows: int = 40, last: int = 5) -> float:
    """The slowest stage's seconds per window over the last ``last`` of ``windows`` windows of
    one stream that never stops (its start long behind it)."""
    stream = _stream(depth, m, split, windows)
    timeline = simulate([[a for w in stream for a in w[s]] for s in range(depth)], cost).timeline
    rates = []
    for s in range(depth):
        ends = [iv.end for iv in timeline if iv.rank == s]
        bounds = [sum(len(w[s]) for w in stream[: t + 1]) - 1 for t in range(windows)]
        rates.append((ends[bounds[-1]] - ends[bounds[-1 - last]]) / last)
    return max(rates)


def _timed_by_each_stage(depth: int, m: int, split: bool, steps: int, cost) -> list[float]:
    """What each stage of the benchmark's timing sees, found without counting actions: window 0
    of a stream from empty ends on each stage when window 0 run alone does (no action of it
    waits on a later window), and the stream's last action ends the timed windows."""
    stream = _stream(depth, m, split, steps + 1)
    alone = simulate(stream[0], cost).timeline
    whole = simulate([[a for w in stream for a in w[s]] for s in range(depth)], cost).timeline
    last = lambda timeline, s: max(iv.end for iv in timeline if iv.rank == s)  # noqa: E731
    return [(last(whole, s) - last(alone, s)) / steps for s in range(depth)]


def _restarted_rate(depth: int, m: int, split: bool, steps: int, cost) -> float:
    """Seconds per window of ``steps`` windows timed from a barrier: a restart, which a running job never has."""
    first = two_bw_window(depth, m, 0, split)
    timed = [two_bw_window(depth, m, t, split) for t in range(1, steps + 1)]
    sends = (Kind.SEND_ACT, Kind.SEND_GRAD)
    program = [[a for a in first[s] if a.kind in sends] + [a for w in timed for a in w[s]] for s in range(depth)]
    return simulate(program, cost).makespan / steps


@pytest.mark.parametrize("depth,m", [(2, 8), (3, 5), (4, 8), (8, 8), (8, 16)])
@pytest.mark.parametrize("split", [False, True])
def test_running_rate_is_what_each_stage_times(depth: int, m: int, split: bool) -> None:
    for seed in range(3):
        cost = _random_costs(depth, seed=depth * 10 + m + 100 * seed)
        assert running_rate(depth, m, split, 8, cost) == pytest.approx(
            _timed_by_each_stage(depth, m, split, 8, cost), rel=1e-9
        )


@pytest.mark.parametrize("depth,m", [(3, 5), (8, 8)])
def test_running_rate_approaches_the_streams_steady_rate(depth: int, m: int) -> None:
    # After a start from empty, split 2BW with unequal stage costs settles over a few windows:
    # 8 timed windows come within 0.14% of the steady rate over 25 seeds, 32 closer still.
    for seed in range(6):
        cost = _random_costs(depth, seed)
        for split in (False, True):
            steady = _steady_rate(depth, m, split, cost)
            off = [abs(max(running_rate(depth, m, split, n, cost)) / steady - 1) for n in (8, 32)]
            assert off[0] <= 0.005 and off[1] <= off[0] + 1e-12, (seed, split, off)


@pytest.mark.parametrize("depth,m", [(4, 8), (8, 16)])
def test_running_rate_leaves_out_the_refill_after_a_barrier(depth: int, m: int) -> None:
    units = {Kind.FORWARD: 1.0, Kind.BACKWARD: 2.0, Kind.INPUT_GRAD: 1.0, Kind.WEIGHT_GRAD: 1.0}
    cost = lambda a: units.get(a.kind, 0.0)  # noqa: E731
    for split in (False, True):
        running = max(running_rate(depth, m, split, 8, cost))
        assert running == pytest.approx(3 * m)  # F + I + W (or F + B) per microbatch, no bubble
        assert _restarted_rate(depth, m, split, 8, cost) > running * 1.01


def _all_names() -> list[str]:
    return ["one process", *(f"torch {k}" for k in TORCH), *(_name(*o) for o in OURS)]


def test_every_one_of_ours_has_a_torch_counterpart_of_the_same_stages_per_rank() -> None:
    from bench_pipelines import VIRTUAL

    assert set(SAME) == set(OURS)
    for schedule, _, virtual, _ in OURS:
        assert schedule in SCHEDULES
    for ours, kind in SAME.items():
        assert kind in TORCH and VIRTUAL.get(kind, 1) == ours[2]
    assert SAME[("zbv", True, 2, None)] == "zbv" and TORCH["zbv"] == "ScheduleZBVZeroBubble"
    assert SAME[("dualpipev", True, 2, None)] == "dualpipev" and TORCH["dualpipev"] == "ScheduleDualPipeV"


def test_contenders_select_ours_of_those_schedules_their_counterparts_and_one_process() -> None:
    names = _all_names()
    keep = selected(names, contenders=["zbv", "dualpipev"])
    ours = {_name("zbv", True, 2), _name("dualpipev", True, 2)}
    assert keep == {"one process", "torch zbv", "torch dualpipev", *ours}
    assert counterparts(sorted(keep)) == {
        _name("zbv", True, 2): "torch zbv",
        _name("dualpipev", True, 2): "torch dualpipev",
    }
    assert selected(names) == set(names)  # no filter: every contender
    assert set(counterparts(names)) == {_name(*o) for o in OURS}


def test_a_subset_has_its_own_page_and_unknown_schedules_are_refused() -> None:
    import argparse

    assert page_name([]) == "bench_pipelines"
    assert page_name(_schedule_list("zbv,dualpipev")) == "bench_pipelines_zbv_dualpipev"
    for bad in ("zbv,nope", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            _schedule_list(bad)
