"""The planner's user-path benchmark: what it trains, how it reads a launch's ranks, and its statistics."""

from __future__ import annotations

import math

import yaml

from benchmarks.planner_user_path import (
    WORKLOADS,
    Options,
    choices_within_noise,
    fit_config,
    measured_steps,
    memory_ok,
    peaks_per_position,
    plan_key,
    pooled,
    repeat_scores,
    spearman,
    stability,
    step_scores,
    to_train,
)
from lightning_pipe import PipelineStrategy


def _row(depth: int = 2, m: int = 4, step: float = 0.1, feasible: bool = True, **extra) -> dict:
    row = {
        "width": 1,
        "depth": depth,
        "microbatches": m,
        "schedule": "1f1b",
        "split_backward": False,
        "split_placement": None,
        "virtual_stages": 1,
        "inner": "pp",
        "partition": [3, 3][:depth] if depth <= 2 else [2] * depth,
        "recompute": [False] * depth,
        "microbatch_size": 32 // m,
        "step_seconds": step,
        "peak_bytes_per_rank": [1000] * depth,
        "feasible": feasible,
    }
    return {**row, **extra}


def test_spearman_matches_known_orders_and_ties() -> None:
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == -1.0
    assert math.isclose(spearman([1, 2, 3], [1, 3, 2]), 0.5)
    assert math.isclose(spearman([1, 1, 2], [1, 2, 3]), 3**0.5 / 2)  # tied ranks share their mean
    assert math.isnan(spearman([1], [1])) and math.isnan(spearman([1, 1], [1, 2]))


def test_measured_steps_are_the_slowest_ranks_and_leaves_out_the_tracked_steps() -> None:
    fast = {"ends": [0, 1, 2, 3, 4, 100, 200], "position": 0, "peak": 5}
    slow = {"ends": [0, 1, 3, 4, 6, 100, 300], "position": 1, "peak": 7}
    # steps of the slowest rank per step: 1, 2, 1, 2; the last two ends (the tracked steps) are not timed
    assert measured_steps([fast, slow], 4) == [1, 2, 1, 2] and measured_steps([fast, slow], 1) == [2]
    assert peaks_per_position([fast, slow, {**fast, "peak": 9}], 2) == [9, 7]


def test_pooled_launches_take_the_median_of_all_steps_and_the_largest_peak_per_rank() -> None:
    launches = [{"steps": [1.0, 1.0, 5.0], "peaks": [10, 20]}, {"steps": [2.0, 2.0, 2.0], "peaks": [12, 18]}]
    got = pooled(launches)
    assert got["step"] == 2.0  # of 1, 1, 2, 2, 2, 5: not the mean of the launches' medians (1.5)
    assert got["launch_steps"] == [1.0, 2.0]
    assert got["peaks"] == [12, 20]


def test_to_train_takes_the_top_plans_then_plans_spread_over_the_ranking_then_other_runs_choices() -> None:
    plans = [_row(m=m, step=0.1 * m) for m in (1, 2, 4, 8, 16)]
    twin = {**plans[0], "schedule": "gpipe", "step_seconds": 0.11}  # the best's layout: not trained twice
    first = {"plans": [plans[0], twin] + plans[1:]}
    other = {"plans": [_row(m=16, step=0.05), _row(m=1)], "chosen": 1}
    trained = to_train([first, other], 4)
    assert [r["microbatches"] for r in trained] == [1, 2, 4, 16]  # top 2; then the ends of the rest [4, 8, 16]
    assert len({plan_key(r) for r in trained}) == 4
    late = {"plans": [_row(m=8, step=0.01)]}
    trained = to_train([first, late], 3)
    assert [r["microbatches"] for r in trained] == [1, 2, 16, 8]  # another run's choice comes last
    assert trained[3]["step_seconds"] == 0.8  # the first ranking's prediction for it, not the other run's
    stale = {"plans": plans[:3] + [_row(m=4, step=0.45, schedule="2bw"), _row(m=8, step=0.5, schedule="2bw")]}
    assert [r["schedule"] for r in to_train([stale], 2)] == ["1f1b", "1f1b"]
    assert to_train([stale], 2, stale=True)[-1] == stale["plans"][3]  # and the best 2BW plan


def test_memory_ok_wants_every_rank_within_two_percent_above() -> None:
    layout = {"row": _row(peak_bytes_per_rank=[1000, 1020]), "peaks": [1000, 1000]}
    assert memory_ok(layout)
    assert not memory_ok({**layout, "peaks": [1001, 1000]})  # under on rank 0
    assert not memory_ok({**layout, "row": _row(peak_bytes_per_rank=[1000, 1021])})  # over by more than 2%


def test_stability_reports_one_choice_or_whether_the_choices_overlap() -> None:
    a, b = _row(m=2, step=0.10), _row(m=4, step=0.11)
    held = stability({"rankings": [{"plans": [a, b], "seconds": 30}] * 3})
    assert "the same first choice every time" in held
    runs = [
        {"plans": [a, b], "seconds": 30},
        {"plans": [{**b, "step_seconds": 0.09}, {**a, "step_seconds": 0.095}], "seconds": 31},
    ]
    assert "2 different first choices" in stability({"rankings": runs}) and "spread: yes" in stability(
        {"rankings": runs}
    )
    far = [
        {"plans": [a, {**b, "step_seconds": 0.08}], "seconds": 30},
        {"plans": [{**b, "step_seconds": 0.05}, {**a, "step_seconds": 0.2}], "seconds": 31},
    ]
    assert "spread: no" in stability({"rankings": far})  # a: 0.10 to 0.2, b: 0.05 to 0.08


def test_fit_config_is_the_users_config_with_the_plans_strategy_arguments(tmp_path) -> None:
    row = _row(depth=2, m=2, split_backward=True, split_placement="drain", partition=[2, 4], recompute=[True, False])
    path = fit_config(WORKLOADS["gpt"], row, {"devices": 2, "global_batch": 32}, Options(steps=5), tmp_path)
    cfg = yaml.safe_load(path.read_text())
    user = yaml.safe_load(WORKLOADS["gpt"].config.read_text())
    assert cfg["model"] == user["model"] and cfg["data"] == user["data"]
    trainer = cfg["trainer"]
    assert trainer["devices"] == 2 and trainer["max_steps"] == 7 and trainer["logger"] is False
    assert trainer["default_root_dir"] == str(tmp_path)
    assert [c["class_path"] for c in trainer["callbacks"]] == ["benchmarks.planner_user_path.StepRecorder"]
    assert trainer["callbacks"][0]["init_args"] == {"out_dir": str(tmp_path), "tracked_step": 5}
    init = trainer["strategy"]["init_args"]
    assert trainer["strategy"]["class_path"] == "lightning_pipe.PipelineStrategy"
    assert init["partition"] == [2, 4] and init["recompute"] == [True, False] and init["split_placement"] == "drain"
    assert init["global_batch_size"] == 32 and init["microbatches"] == 2
    PipelineStrategy(**init)


def test_choices_are_within_the_noise_only_where_every_plan_command_says_so() -> None:
    a, b = _row(m=1), _row(m=2)
    both = {"plans": [{**a, "within_noise": True}, {**b, "within_noise": True}]}
    one = {"plans": [{**a, "within_noise": True}, {**b, "within_noise": False}]}
    keys = [plan_key(a), plan_key(b)]
    assert choices_within_noise([both, both], keys)
    assert not choices_within_noise([both, one], keys)


def test_a_view_of_the_datasets_tensor_inside_the_tracked_steps_is_not_counted() -> None:
    # The next batch's rows are views of the dataset's storage, taken while the tracker runs:
    # its whole storage would count as created there unless the dataset's tensors are left out.
    from types import SimpleNamespace

    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from benchmarks.bench_pipelines import PeakTensorBytes
    from benchmarks.planner_user_path import _dataset_tensors

    data = torch.zeros(1000, 64)  # 256,000 bytes
    loader = DataLoader(TensorDataset(data), batch_size=4)
    nested = SimpleNamespace(dataset=SimpleNamespace(parts={"train": [data]}))
    assert [t is data for t in _dataset_tensors(loader)] == [True]
    assert [t is data for t in _dataset_tensors([nested])] == [True]
    for ignored, counted in (((), 256_000), (_dataset_tensors(loader), 0)):
        with PeakTensorBytes([], ignored=ignored) as tracker:
            rows = data[:4]
            made = rows * 2  # 1,024 bytes of its own
        assert tracker.peak == counted + made.untyped_storage().nbytes()


def test_step_scores_are_the_errors_the_order_and_the_pick_of_the_layout_predicted_fastest() -> None:
    got = step_scores([1.0, 1.2, 3.0], [1.5, 1.2, 2.0])
    errors = [1.0 / 1.5 - 1, 0.0, 3.0 / 2.0 - 1]  # -33%, 0, +50%
    assert math.isclose(got["median_error"], abs(errors[0])) and math.isclose(got["worst_error"], errors[2])
    assert got["within"] == 1  # only the exact one within 15%
    assert math.isclose(got["spearman"], spearman([1.0, 1.2, 3.0], [1.5, 1.2, 2.0]))
    assert math.isclose(got["fastest_over_fastest"], 1.5 / 1.2)  # predicted fastest, measured 1.25x the fastest


def test_repeat_scores_take_each_launch_as_the_prediction_of_the_median_of_the_others() -> None:
    group = {"layouts": [{"launch_steps": [1.0, 1.2, 1.1]}, {"launch_steps": [2.0, 2.0, 2.6]}]}
    rounds = repeat_scores(group)
    assert len(rounds) == 3
    # round 0: 1.0 against median(1.2, 1.1) = 1.15, 2.0 against median(2.0, 2.6) = 2.3
    assert math.isclose(rounds[0]["median_error"], 1 - 1.0 / 1.15) and rounds[0]["within"] == 2
    # round 2: 1.1 against median(1.0, 1.2) = 1.1 exactly, 2.6 against 2.0: 30% over
    assert math.isclose(rounds[2]["worst_error"], 2.6 / 2.0 - 1) and rounds[2]["within"] == 1
    assert all(r["spearman"] == 1.0 and r["fastest_over_fastest"] == 1.0 for r in rounds)
    swapped = {"layouts": [{"launch_steps": [1.0, 1.5, 1.5]}, {"launch_steps": [1.2, 1.2, 1.2]}]}
    first = repeat_scores(swapped)[0]  # one fast launch of the slower layout picks it
    assert first["spearman"] == -1.0 and math.isclose(first["fastest_over_fastest"], 1.5 / 1.2)
    assert repeat_scores({"layouts": [{"launch_steps": [1.0]}, {"launch_steps": [2.0, 2.1]}]}) == []
