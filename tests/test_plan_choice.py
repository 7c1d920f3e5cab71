"""The plan CLI's robust statistics: profiles combined by their median, and plans the noise cannot tell apart."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_pipe import PipelinePlan
from lightning_pipe.planning import search
from lightning_pipe.planning.predict import Prediction
from lightning_pipe.planning.profile import BlockProfile, BlockSample, Profile, median_profile


def _prediction(depth: int, step: float, peak: int, limit: float = 1e12) -> Prediction:
    plan = PipelinePlan(depth=depth, microbatches=4, partition=[1] * depth)
    return Prediction(plan, 1, step, (peak,) * depth, limit)


def test_the_best_plan_is_chosen_when_the_noise_tells_the_plans_apart() -> None:
    ranked = search.rank([_prediction(1, 1.00, 300), _prediction(2, 1.10, 100), _prediction(4, 1.30, 50)])
    assert search.choose(ranked, 0.05) is ranked[0]  # 10% apart: the faster plan, whatever its memory


def test_plans_whose_throughputs_round_alike_are_ranked_by_step() -> None:
    # Two steps 2 ulps apart whose throughputs (4 samples over the step) round to one float: the
    # ranking is still in step order, the shorter first, whichever came first.
    slower, faster = 0.013388073126706819, 0.013388073126706817
    assert slower > faster and 4 / slower == 4 / faster
    ranked = search.rank([_prediction(1, slower, 300), _prediction(2, faster, 300)])
    assert [p.step_time for p in ranked] == [faster, slower]


def test_plans_within_the_noise_yield_to_the_one_with_less_memory() -> None:
    ranked = search.rank([_prediction(1, 1.00, 300), _prediction(2, 1.03, 100), _prediction(4, 1.30, 50)])
    close = search.within_noise(ranked, 0.05)
    assert [p.plan.depth for p in close] == [1, 2]  # 1.30 s is 30% slower: not within 5%
    assert search.choose(ranked, 0.05).plan.depth == 2  # the measurements cannot order them: less memory wins
    assert search.choose(ranked, 0.0).plan.depth == 1  # no noise: the fastest


def test_the_ranking_json_marks_the_plans_within_the_noise_of_the_best() -> None:
    import json

    from lightning_pipe.lightning.plan_cli import ranking_json

    ranked = search.rank([_prediction(1, 1.00, 300), _prediction(2, 1.04, 100), _prediction(4, 1.06, 50)])
    out = json.loads(ranking_json(ranked, 4, 32, ranked[1], noise=0.05))
    # within 5% of the best's step, written out: 1.04 <= 1.05 < 1.06
    assert [p["within_noise"] for p in out["plans"]] == [True, True, False] and out["noise"] == 0.05
    assert [p["within_noise"] for p in json.loads(ranking_json(ranked, 4, 32))["plans"]] == [True, False, False]


def test_plans_of_equal_peak_within_the_noise_yield_to_the_one_with_less_memory_on_its_other_ranks() -> None:
    plan = PipelinePlan(depth=2, microbatches=1, partition=[1, 1])
    split = Prediction(dataclasses.replace(plan, split_backward=True), 1, 1.00, (300, 200), 1e12)
    plain = Prediction(plan, 1, 1.02, (300, 150), 1e12)
    ranked = search.rank([split, plain])
    assert search.choose(ranked, 0.05) is plain  # same peak, 50 bytes less on the second rank
    assert search.choose(ranked, 0.01) is split  # 2% apart is told apart: the faster


def test_a_plan_that_does_not_fit_is_never_chosen() -> None:
    ranked = search.rank([_prediction(1, 1.00, 300, limit=200), _prediction(2, 1.02, 100, limit=200)])
    assert search.choose(ranked, 0.05).plan.depth == 2
    assert search.choose(search.rank([_prediction(1, 1.0, 300, limit=200)]), 0.05) is None


def _profile(forward: float, overhead: float) -> Profile:
    sample = BlockSample(1, forward, 2 * forward, forward, forward, 100, 10)
    return Profile([BlockProfile("b", [sample], 1, 1, 2)], action_overhead=overhead)


def test_the_median_profile_ignores_one_slow_round() -> None:
    rounds = [_profile(1.0, 0.001), _profile(1.1, 0.002), _profile(9.0, 0.050)]  # the last round ran on a busy host
    median = median_profile(rounds)
    assert median.blocks[0].samples[0].forward == pytest.approx(1.1)
    assert median.blocks[0].samples[0].backward == pytest.approx(2.2)
    assert median.action_overhead == pytest.approx(0.002)
    assert dataclasses.replace(median.blocks[0].samples[0], forward=1.0).saved_bytes == 100  # bytes: the first's
