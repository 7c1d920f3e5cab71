"""The time model: fitted to trial runs (scales and step overhead from synthetic traces), 2BW's weight copies."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_pipe import PipelinePlan
from lightning_pipe.lightning.plan_cli import (
    choice_noise,
    confirmed,
    layout,
    measured_first,
    prediction_spread,
    same_run,
    trial_ranking,
)
from lightning_pipe.planning import costs, predict, programs, search
from lightning_pipe.planning.calibration import (
    Stalls,
    Trial,
    calibrate,
    fitted_line,
    fitted_scale,
    median_error,
    message_stall,
    slowest_steps,
    traced_stalls,
    trial_step,
)
from lightning_pipe.schedules import Action, Kind
from lightning_pipe.schedules.actions import MESSAGE_KINDS
from tests.test_planner import _uniform

#: The job as it really runs: what the profile misses, to be recovered by the fit (the
#: executor's overhead per action is the profiler's own measurement, kept).
TRUE = {
    "compute_scale": 1.3,
    "send_seconds_per_byte": 2e-9,  # beyond the profiled posting of a small message, kept
    "optimizer_scale": 0.8,
    "allreduce_scale": 3.0,
    "step_overhead": 0.005,
    "message_stall": 0.0003,  # each send and receive, beyond the medians the traces hold
}


def _profile():
    return dataclasses.replace(
        _uniform(4, f=0.01, b=0.02),
        optimizer_step=0.004,
        allreduce_bandwidth=1e6,
        action_overhead=0.0001,
        send_overhead=0.00005,
    )


def _traced(job, plan: PipelinePlan, b: int) -> Trial:
    """What a trial of ``plan`` would record in ``job``: every action's median at its cost without
    the message stalls, which each rank's stalls hold (its messages times the job's stall), the
    step simulated."""
    typical = dataclasses.replace(job, message_stall=0.0)
    cost = costs.action_cost(typical, plan, costs.stage_costs(typical, plan, b))
    program = programs.program(plan)
    actions = tuple({str(a): cost(a) for a in rank} for rank in program)
    stalls = []
    for rank, medians in zip(program, actions):
        messages = sum(a.kind in MESSAGE_KINDS for a in rank)
        stalls.append(Stalls(job.message_stall * messages, messages, sum(medians.values())))
    return Trial(plan, b, predict.predict_step(job, plan, b)[0], actions, stalls=tuple(stalls))


def test_calibration_recovers_the_scales_and_overhead_that_made_the_traces() -> None:
    profile = _profile()
    job = dataclasses.replace(profile, **TRUE)
    ran = [
        _traced(job, PipelinePlan(width=2, depth=2, microbatches=4, schedule="1f1b", partition=(2, 2)), 1),
        _traced(job, PipelinePlan(width=1, depth=4, microbatches=4, schedule="gpipe", partition=(1, 1, 1, 1)), 1),
    ]
    fitted = calibrate(profile, ran)
    for name, value in TRUE.items():
        assert getattr(fitted, name) == pytest.approx(value, rel=1e-9), name
    # A plan no trial ran is predicted as the job runs it.
    other = PipelinePlan(width=4, depth=1, microbatches=2, schedule="1f1b", split_backward=True, partition=(4,))
    assert predict.predict_step(fitted, other, 1)[0] == pytest.approx(predict.predict_step(job, other, 1)[0])
    assert predict.predict_step(profile, other, 1)[0] < 0.9 * predict.predict_step(job, other, 1)[0]
    # Sends of another size: posting plus the fitted cost of each byte.
    deeper = PipelinePlan(width=1, depth=4, microbatches=8, schedule="1f1b", partition=(1, 1, 1, 1))
    assert predict.predict_step(fitted, deeper, 4)[0] == pytest.approx(predict.predict_step(job, deeper, 4)[0])
    # Refitting starts from the profile's own numbers, not an earlier fit's.
    again = calibrate(fitted, ran)
    assert again.compute_scale == pytest.approx(TRUE["compute_scale"])
    assert again.meta["calibration"]["profiled_action_overhead"] == profile.action_overhead
    assert calibrate(profile, []) is profile


def test_the_step_overhead_is_fitted_per_layout_and_elsewhere_is_the_median_over_all_trials() -> None:
    # Three trials whose jobs spend 10 and 12 ms (2 x 2) and 2 ms (1 x 4) a step outside the program.
    profile = _profile()

    def job(overhead: float):
        return dataclasses.replace(profile, **{**TRUE, "step_overhead": overhead})

    two_by_two = PipelinePlan(width=2, depth=2, microbatches=4, schedule="1f1b", partition=(2, 2))
    deep = PipelinePlan(width=1, depth=4, microbatches=4, schedule="gpipe", partition=(1, 1, 1, 1))
    ran = [
        _traced(job(0.010), two_by_two, 1),
        _traced(job(0.012), two_by_two.replace(schedule="gpipe"), 1),
        _traced(job(0.002), deep, 1),
    ]
    fitted = calibrate(profile, ran)
    assert fitted.layout_overheads == pytest.approx({"2x2": 0.011, "1x4": 0.002})
    assert fitted.step_overhead == pytest.approx(0.010)  # the median of 10, 12 and 2 ms
    for plan, overhead in (
        (two_by_two.replace(microbatches=2), 0.011),
        (deep.replace(schedule="1f1b"), 0.002),
        (PipelinePlan(width=4, depth=1, microbatches=2, schedule="1f1b", partition=(4,)), 0.010),
    ):
        assert predict.predict_step(fitted, plan, 1)[0] == pytest.approx(
            predict.predict_step(job(overhead), plan, 1)[0]
        )
    # A profile written and read back keeps them.
    assert type(fitted).from_json(fitted.to_json()).layout_overheads == fitted.layout_overheads


def test_a_steps_stalls_are_its_actions_means_beyond_their_medians_and_counted_per_message() -> None:
    ms = 1e-3
    traced = {
        "0F0": [1 * ms, 1 * ms, 1 * ms, 5 * ms],  # a 4 ms slice lost in one of 4 steps
        "0SF0": [0.1 * ms, 0.1 * ms, 4.1 * ms, 0.1 * ms],  # and another
        "1RB0": [0.2 * ms] * 4,
        "0F1": [9 * ms],  # traced once: no median to stand beyond
    }
    assert traced_stalls(traced, microbatches=2) == Stalls(
        pytest.approx((4 + 4) * ms / 4), 2, pytest.approx((1 + 0.1 + 0.2) * ms)
    )
    # A PipeDream-2BW window numbers its microbatches on: microbatch 2 of m=2 is microbatch 0 again.
    windows = {"0SF0": [0.1 * ms], "0SF2": [2.1 * ms], "0SF4": [0.1 * ms], "0SF6": [0.1 * ms]}
    assert traced_stalls(windows, microbatches=2) == Stalls(pytest.approx(2 * ms / 4), 1, pytest.approx(0.1 * ms))


def test_the_stall_per_message_is_fitted_beside_a_share_of_the_steps_length() -> None:
    ms = 1e-3

    def rank(typical: float, messages: int, slowdown: float = 1.0) -> tuple[Stalls, float]:
        """A rank that loses 2% of its step's length and 0.3 ms a message, times its slowdown."""
        return Stalls(0.02 * typical + 0.3 * ms * slowdown * messages, messages, typical), slowdown

    data_parallel = [rank(80 * ms, 0), rank(75 * ms, 0)]
    pipelined = [rank(100 * ms, 4), rank(90 * ms, 4, slowdown=1.5), rank(120 * ms, 12)]
    assert message_stall(data_parallel + pipelined) == pytest.approx(0.3 * ms)
    # All slices read as the messages' would price a message nearly twice as much.
    alone = sum(s.beyond for s, _ in pipelined) / sum(s.messages * w for s, w in pipelined)
    assert alone > 1.8 * 0.3 * ms
    # Ranks that send nothing price nothing; slices shorter than the medians price no stall.
    assert message_stall(data_parallel) == 0.0 and message_stall([]) == 0.0
    assert message_stall([(Stalls(-1 * ms, 4, 50 * ms), 1.0), (Stalls(0.0, 0, 40 * ms), 1.0)]) == 0.0


def test_the_compute_scale_is_the_least_squares_slope_through_the_measured_overhead() -> None:
    assert fitted_scale([(1.0, 2.5), (2.0, 4.5), (3.0, 6.5)], 0.5) == pytest.approx(2.0)
    # Through the origin: sum(x * y) / sum(x * x), written out.
    assert fitted_scale([(1.0, 1.0), (2.0, 3.0)], 0.0) == pytest.approx((1 * 1 + 2 * 3) / (1 + 4))
    assert fitted_scale([], 0.1) == 1.0


def test_a_trial_step_is_the_slowest_rank_median_over_the_last_steps() -> None:
    ends = [[0.0, 1.0, 3.0, 4.0, 9.0], [0.0, 2.0, 3.0, 5.0, 6.0]]  # steps (1, 2, 1, 5) and (2, 1, 2, 1)
    assert trial_step(ends, 3) == 2.0  # slowest per step: 2, 2, 2, 5 -> last three 2, 2, 5
    with pytest.raises(ValueError, match="at least two step ends"):
        trial_step([[0.0]], 3)


def test_trials_run_the_best_plan_and_another_width_then_the_fitted_best_until_one_ran() -> None:
    profile = _profile()
    job = dataclasses.replace(profile, **TRUE)

    def ranking(p):
        return search.search(p, 4, 8, virtual_stages=(1,))

    ran: list[PipelinePlan] = []

    def trained(p: predict.Prediction) -> Trial:
        ran.append(p.plan)
        return _traced(job, p.plan, p.microbatch_size)

    first = ranking(profile)
    fitted, ranked, modeled, spreads = trial_ranking(profile, first, ranking, trained, budget=4)
    assert ran[0] == first[0].plan and ran[1].width != first[0].plan.width
    assert fitted.compute_scale == pytest.approx(TRUE["compute_scale"])
    # Every plan that ran is charged its measured step; the rest the fitted model's; ranked by them.
    truth = {(p.plan, p.microbatch_size): p.step_time for p in ranking(job)}
    for p in ranked:
        assert p.step_time == pytest.approx(truth[(p.plan, p.microbatch_size)])
    assert set(spreads) == {(p, b) for p, b in truth if p in ran}
    # The model's step is reported for those, and for the plans their trials' layouts scaled.
    tried = {layout(p, b) for p, b in spreads}
    assert set(modeled) == set(spreads) | {(p, b) for p, b in truth if layout(p, b) in tried}
    # The loop stops once the fitted best has run (or the budget is spent).
    assert ranked[0].plan in ran or len(ran) == 4
    assert [p.plan for p in measured_first(ranked, {})] == [p.plan for p in ranked]


def test_a_plan_taken_for_its_memory_runs_a_trial_first_and_is_kept_out_unless_measured() -> None:
    profile = _profile()
    job = dataclasses.replace(profile, **TRUE)

    def ranking(p):
        return search.search(p, 4, 8, virtual_stages=(1,))

    def memory_pick(ranked, spreads):  # a noise so wide that a plan of less memory is always in it
        return search.choose(ranked, 1.0)

    ran: list[PipelinePlan] = []

    def trained(p: predict.Prediction) -> Trial:
        ran.append(p.plan)
        return _traced(job, p.plan, p.microbatch_size)

    first = ranking(profile)
    _, ranked, _, spreads = trial_ranking(profile, first, ranking, trained, 6, memory_pick)
    pick = memory_pick(ranked, spreads)
    assert pick.plan is not ranked[0].plan and max(pick.stage_memory) < max(ranked[0].stage_memory)
    assert pick.plan in ran and (pick.plan, pick.microbatch_size) in spreads  # measured before it is taken
    assert search.choose(confirmed(ranked, spreads, 1.0), 1.0) is pick
    # Without the confirming trial (the budget spent first), the choice keeps the measured best.
    ran.clear()
    _, ranked, _, spreads = trial_ranking(profile, first, ranking, trained, 1, memory_pick)
    pick = memory_pick(ranked, spreads)
    assert pick.plan not in ran and search.choose(confirmed(ranked, spreads, 1.0), 1.0) is ranked[0]
    assert confirmed(ranked, {}, 1.0) == ranked  # no trial ran: every plan is the model's alike


def test_a_measured_plan_is_taken_for_its_memory_only_if_its_own_spread_stays_in_the_noise() -> None:
    # The best measured 100 ms; a plan of less memory measured 104 ms, inside a 5% noise. With a
    # spread of 0.5% its step one spread up (104.5 ms) stays within 105 ms: taken. With 3% (107.1
    # ms) it may be slower than the noise allows: the best is kept.
    def measured(step: float, memory: int, b: int) -> predict.Prediction:
        plan = PipelinePlan(width=2, depth=1, microbatches=16 // b, schedule="gpipe", partition=(4,))
        return predict.Prediction(plan, b, step, (memory,))

    best, lean = measured(0.100, 50, 8), measured(0.104, 30, 4)
    ranked = [best, lean]
    tight = {(best.plan, 8): 0.01, (lean.plan, 4): 0.005}
    assert search.choose(confirmed(ranked, tight, 0.05), 0.05) is lean
    wide = {**tight, (lean.plan, 4): 0.03}
    assert confirmed(ranked, wide, 0.05) == [best]
    assert search.choose(confirmed(ranked, wide, 0.05), 0.05) is best


def test_every_action_the_executor_takes_costs_its_overhead_and_messages_share_the_cores() -> None:
    profile = dataclasses.replace(_profile(), link_latency=0.001, link_bandwidth=1e6, send_seconds_per_byte=1e-9)
    plan = PipelinePlan(1, 2, 2, "gpipe", partition=(2, 2))
    stages = costs.stage_costs(profile, plan, 1)
    cost = costs.action_cost(profile, plan, stages)
    out = stages[0].output_bytes  # stage 0's activation: what it sends and stage 1 receives
    overhead, posting = profile.action_overhead, profile.send_overhead
    assert cost(Action(0, Kind.FORWARD, 0)) == pytest.approx(stages[0].forward + overhead)
    assert cost(Action(0, Kind.SEND_ACT, 0)) == pytest.approx(posting + out * 1e-9 + overhead)
    assert cost(Action(1, Kind.RECV_ACT, 0)) == pytest.approx(0.001 + out / 1e6 + overhead)
    assert cost(Action(1, Kind.RECV_GRAD, 0)) == pytest.approx(0.001 + stages[1].output_bytes / 1e6 + overhead)
    # Two ranks on one core: stage 0's second send runs while stage 1 computes, so it takes longer
    # than alone; on a core each, as long as alone.
    shared = predict.slowdowns(dataclasses.replace(profile, cores=1), plan, cost)
    assert shared[(0, Kind.SEND_ACT)] > 1.0 and shared[(1, Kind.SEND_GRAD)] > 1.0
    assert set(predict.slowdowns(dataclasses.replace(profile, cores=2), plan, cost).values()) == {1.0}


def test_a_trial_measures_every_plan_that_runs_the_same_program_under_another_name() -> None:
    # With one microbatch GPipe and 1F1B are the same action lists (written out): a trial of one
    # is the other's measured step, not a layout ratio's estimate.
    gpipe, one_f_one_b = (PipelinePlan(1, 2, 1, s, partition=(2, 2)) for s in ("gpipe", "1f1b"))
    assert [[str(a) for a in rank] for rank in programs.program(gpipe)] == [
        ["0F0", "0SF0", "0RB0", "0B0", "0AR", "0OPT"],
        ["1RF0", "1F0", "1B0", "1SB0", "1AR", "1OPT"],
    ]
    assert programs.program(one_f_one_b) == programs.program(gpipe) and same_run(one_f_one_b, gpipe)
    two = PipelinePlan(1, 2, 2, "1f1b", partition=(2, 2))
    assert not same_run(two, PipelinePlan(1, 2, 2, "gpipe", partition=(2, 2)))  # F F B B against F B F B
    assert not same_run(two, PipelinePlan(1, 2, 2, "2bw", partition=(2, 2)))  # another weight rule
    # A layout that ran two trials (with and without split backward) charges its other plans one
    # trial's ratio; the plan that runs the same program as a trial is charged that trial's step.
    split = PipelinePlan(1, 2, 1, "gpipe", split_backward=True, partition=(2, 2))
    profile = _profile()
    plans = (gpipe, one_f_one_b, two, split)
    ranked = search.rank(search.evaluate(profile, search.Candidate(p, 8 // p.microbatches)) for p in plans)
    trials = {(gpipe, 8): Trial(gpipe, 8, 9.0, ()), (split, 8): Trial(split, 8, 5.0, ())}
    charged = {
        (p.plan.schedule, p.plan.microbatches, p.plan.split_backward): p.step_time
        for p in measured_first(ranked, trials)
    }
    assert charged[("gpipe", 1, False)] == charged[("1f1b", 1, False)] == 9.0
    assert charged[("gpipe", 1, True)] == 5.0 and charged[("1f1b", 2, False)] not in (5.0, 9.0)
    # With one microbatch a split backward's W runs right after its I wherever it is placed.
    drained = PipelinePlan(1, 2, 1, "1f1b", split_backward=True, partition=(2, 2), split_placement="drain")
    assert programs.program(drained) == programs.program(split) and same_run(drained, split)
    drained_two = PipelinePlan(1, 2, 2, "1f1b", split_backward=True, partition=(2, 2), split_placement="drain")
    assert not same_run(drained_two, PipelinePlan(1, 2, 2, "1f1b", split_backward=True, partition=(2, 2)))


def test_a_two_bw_step_copies_the_newest_weights_before_stepping_and_a_flushed_one_does_not() -> None:
    profile = dataclasses.replace(_profile(), version_copy=0.003)
    stages = costs.stage_costs(profile, PipelinePlan(1, 2, 4, "2bw", partition=(3, 1)), 1)
    for schedule, copies in (("2bw", True), ("1f1b", False)):
        plan = PipelinePlan(1, 2, 4, schedule, partition=(3, 1))
        cost = costs.action_cost(profile, plan, stages)
        for s, share in enumerate((0.75, 0.25)):  # by weight share: equal blocks, 3 and 1 per stage
            step = programs.program(plan)[s][-1]
            assert step.kind.name == "OPTIMIZER_STEP"
            assert cost(step) == pytest.approx((0.004 + (0.003 if copies else 0.0)) * share)


def test_the_choice_trusts_a_measured_best_plan_to_its_trial_spread() -> None:
    profile = _profile()
    ranked = search.search(profile, 4, 8, virtual_stages=(1,))
    top = ranked[0]
    # Profiled in rounds the best plan's prediction moved 30%; measured in its trial, 2%: another
    # step measured as closely can differ from it by sqrt(0.02**2 + 0.02**2) and not be told apart.
    measured = choice_noise(ranked, {top.plan: 0.3}, {(top.plan, top.microbatch_size): 0.02})
    assert measured == pytest.approx((0.02**2 + 0.02**2) ** 0.5)
    assert choice_noise(ranked, {top.plan: 0.3}, {}) == 0.3
    # A best plan no trial ran, charged by a trial of its layout (another schedule), is as
    # uncertain as that trial's step.
    other = next(
        p
        for p in ranked
        if layout(p.plan, p.microbatch_size) == layout(top.plan, top.microbatch_size) and not same_run(p.plan, top.plan)
    )
    assert choice_noise(ranked, {top.plan: 0.3}, {(other.plan, other.microbatch_size): 0.02}) == pytest.approx(
        2**0.5 * 0.02
    )
    assert choice_noise([], {}, {}) == 0.0
    ends = [[0.0, 1.0, 2.1, 3.0, 4.0], [0.0, 1.0, 2.0, 3.2, 7.2]]  # steps (1, 1.1, .9, 1) and (1, 1, 1.2, 4)
    # slowest: 1.0, 1.1, 1.2, 4.0: median 1.15, absolute deviations .15, .05, .05, 2.85 -> MAD 0.1
    assert median_error(slowest_steps(ends)[-4:]) == pytest.approx(1.2533 * 1.4826 * 0.1 / 2 / 1.15)


def test_the_prediction_spread_is_its_medians_error_over_the_rounds_one_disturbed_round_aside() -> None:
    # Three rounds of profiling, the third on a host that ran everything twice as slowly: the
    # ranking reads their median, so the spread is that median's standard error (written out
    # here), not the rounds' range, which the disturbed round alone would set.
    profile = _profile()
    ranked = search.search(profile, 4, 8, virtual_stages=(1,))[:3]
    rounds = [profile, dataclasses.replace(profile, compute_scale=1.1), dataclasses.replace(profile, compute_scale=2.0)]
    spread = prediction_spread(rounds, ranked, None)
    for p in ranked:
        steps = sorted(search.evaluate(q, search.Candidate(p.plan, p.microbatch_size)).step_time for q in rounds)
        median, mad = steps[1], sorted(abs(s - steps[1]) for s in steps)[1]
        assert spread[p.plan] == pytest.approx(1.2533 * 1.4826 * mad / 3**0.5 / median)
        assert spread[p.plan] < (steps[2] - steps[0]) / median / 3


@pytest.mark.parametrize("recompute", [False, True])
def test_split_stage_0_runs_its_whole_backward_in_w_and_a_recomputed_i_recomputes(recompute: bool) -> None:
    # Two blocks a stage, each F = 1, B = 2, I = W = 1 at one sample: stage 0's input needs no
    # gradient (the executor's I finds none), so its I only recomputes and its W is the whole B.
    profile = _uniform(4, f=1.0, b=2.0)
    plan = PipelinePlan(1, 2, 2, "1f1b", split_backward=True, partition=(2, 2), recompute=(recompute, recompute))
    first, second = costs.stage_costs(profile, plan, 1)
    again = 2.0 if recompute else 0.0  # one more forward of each block
    assert (first.input_grad, first.weight_grad) == pytest.approx((again, 4.0))
    assert (second.input_grad, second.weight_grad) == pytest.approx((2.0 + again, 2.0))
    assert first.backward == second.backward == pytest.approx(4.0 + again)


def test_a_trial_on_shared_cores_is_fitted_as_the_ranks_alone() -> None:
    # Four ranks on 1.5 effective cores: each traced action took its seconds alone times the
    # slowdown of the ranks computing with it (from the processor-sharing simulation of the job
    # itself). The fit divides the contention out: the compute scale is the job's, where a fit
    # blind to sharing would read the contention as a slower compute.
    from lightning_pipe.schedules.simulate import SharedCores, shared_run

    profile = dataclasses.replace(_profile(), cores=1.5, action_overhead=0.0)
    job = dataclasses.replace(profile, compute_scale=1.3)
    plan = PipelinePlan(width=2, depth=2, microbatches=4, schedule="1f1b", partition=(2, 2))
    cost = costs.action_cost(job, plan, costs.stage_costs(job, plan, 1))
    flat = programs.flat_program(*programs.program_key(plan, 1))
    computes = [a.kind in predict._CPU_KINDS for a in flat.actions]
    _, starts, ends = shared_run(flat, [cost(a) for a in flat.actions], computes, SharedCores(1.5, 2))
    took = {str(a): e - s for a, s, e in zip(flat.actions, starts, ends)}
    actions = tuple({str(a): took[str(a)] for a in rank} for rank in programs.program(plan))
    trial = Trial(plan, 1, predict.predict_step(job, plan, 1)[0], actions)
    assert calibrate(profile, [trial]).compute_scale == pytest.approx(1.3, rel=0.05)
    blind = calibrate(dataclasses.replace(profile, cores=None), [dataclasses.replace(trial)])
    assert blind.compute_scale > 1.3 * 1.2


def test_a_layout_no_trial_ran_takes_the_step_overhead_of_the_fitted_layouts_of_its_kind() -> None:
    fitted = dataclasses.replace(
        _profile(), step_overhead=0.02, layout_overheads={"2x2": 0.04, "1x4": 0.03, "2x1": 0.005}
    )
    assert fitted.overhead_of(2, 2) == 0.04  # its own
    assert fitted.overhead_of(4, 1) == 0.005  # data-parallel only: the one such layout fitted
    assert fitted.overhead_of(1, 8) == pytest.approx((0.04 + 0.03) / 2)  # pipelined: their median
    pipelines = dataclasses.replace(fitted, layout_overheads={"2x2": 0.04})
    assert pipelines.overhead_of(4, 1) == 0.02  # no layout of its kind ran: over all trials


def test_the_second_trial_runs_a_layout_of_the_other_kind_where_one_is_feasible() -> None:
    # The best plan is a pipeline (2 x 2); a 1 x 4 pipeline ranks above every 4 x 1 plan, but the
    # second trial runs the best data-parallel-only plan, whose step overhead differs.
    profile = _profile()
    job = dataclasses.replace(profile, **TRUE)
    found = search.search(profile, 4, 8, virtual_stages=(1,))
    by_layout = {
        (w, d): [p for p in found if (p.plan.width, p.plan.depth) == (w, d)] for w, d in ((2, 2), (1, 4), (4, 1))
    }
    ranked = by_layout[(2, 2)][:1] + by_layout[(1, 4)][:1] + by_layout[(4, 1)][:1]
    ran: list[PipelinePlan] = []

    def trained(p: predict.Prediction) -> Trial:
        ran.append(p.plan)
        return _traced(job, p.plan, p.microbatch_size)

    trial_ranking(profile, ranked, lambda p: ranked, trained, budget=2)
    assert [(p.width, p.depth) for p in ran] == [(2, 2), (4, 1)]


def test_fsdp_trials_are_left_out_of_the_fit_where_a_ddp_trial_ran() -> None:
    # An FSDP trial whose collectives take far more than the model prices (its hooks) must not
    # move the DDP plans' scales: the fit with it equals the fit of the DDP trial alone.
    profile = _profile()
    job = dataclasses.replace(profile, **TRUE)
    ddp = _traced(job, PipelinePlan(width=2, depth=2, microbatches=4, schedule="1f1b", partition=(2, 2)), 1)
    fsdp_plan = PipelinePlan(width=2, depth=2, microbatches=4, schedule="1f1b", partition=(2, 2), data_parallel="fsdp")
    slow = _traced(dataclasses.replace(job, allreduce_scale=40.0, compute_scale=3.0), fsdp_plan, 1)
    both, alone = calibrate(profile, [ddp, slow]), calibrate(profile, [ddp])
    for name in TRUE:
        assert getattr(both, name) == pytest.approx(getattr(alone, name)), name
    assert calibrate(profile, [slow]).allreduce_scale > 10  # an FSDP trial alone is still fitted


def test_a_best_plan_with_fsdp_replicas_is_tried_beside_the_best_with_ddp_ones() -> None:
    # The fit reads DDP trials only: where the best plan shards its replicas, the best DDP plan
    # runs next (then another width's), so the fit has a trial to read.
    profile = dataclasses.replace(_profile(), shared_blocks=[])
    job = dataclasses.replace(profile, **TRUE)

    def ranking(p):
        return search.search(p, 4, 8, virtual_stages=(1,), fsdp=True)

    first = ranking(profile)
    sharded = next(p for p in first if p.plan.data_parallel == "fsdp")
    ran: list[PipelinePlan] = []

    def trained(p: predict.Prediction) -> Trial:
        ran.append(p.plan)
        return _traced(job, p.plan, p.microbatch_size)

    trial_ranking(profile, [sharded] + [p for p in first if p is not sharded], ranking, trained, budget=3)
    best_ddp = next(p.plan for p in first if p.plan.data_parallel == "ddp")
    assert ran[:2] == [sharded.plan, best_ddp]
    assert ran[2].data_parallel == "ddp" and ran[2].width != sharded.plan.width


def test_a_trial_scales_the_model_step_of_the_plans_of_its_layout_only() -> None:
    # The model's miss on a layout (its blocks, ranks and sizes) is shared by its other
    # schedules: measured over model step of the trial, times their model step.
    profile = _profile()
    ranked = search.search(profile, 4, 8, virtual_stages=(1,))
    tried = next(p for p in ranked if p.plan.depth == 2 and p.plan.schedule == "1f1b" and not p.plan.split_backward)
    same = [p for p in ranked if layout(p.plan, p.microbatch_size) == layout(tried.plan, tried.microbatch_size)]
    other = [p for p in ranked if layout(p.plan, p.microbatch_size) != layout(tried.plan, tried.microbatch_size)]
    assert len(same) > 1 and other
    trial = Trial(tried.plan, tried.microbatch_size, 2 * tried.step_time, ())
    charged = {
        (p.plan, p.microbatch_size): p.step_time
        for p in measured_first(ranked, {(tried.plan, tried.microbatch_size): trial})
    }
    for p in same:
        assert charged[(p.plan, p.microbatch_size)] == pytest.approx(2 * p.step_time)
    for p in other:
        assert charged[(p.plan, p.microbatch_size)] == p.step_time


def test_fitted_line_is_least_squares_with_both_terms_at_least_zero() -> None:
    assert fitted_line([(1.0, 5.0), (2.0, 8.0), (4.0, 14.0)]) == pytest.approx((2.0, 3.0))
    assert fitted_line([(2.0, 6.0), (2.0, 8.0)]) == pytest.approx((0.0, 3.5))  # one size: the ratio of sums
    assert fitted_line([(1.0, 1.0), (3.0, 9.0)]) == pytest.approx((0.0, 10 / 4))  # would cross below 0
    assert fitted_line([(1.0, 6.0), (3.0, 4.0)]) == pytest.approx((5.0, 0.0))  # no growth: a latency
    assert fitted_line([]) == (0.0, 1.0)


def test_the_all_reduce_is_fitted_as_latency_and_scale_at_each_stages_fastest_replica() -> None:
    # Stages of different sizes give the line two points; one replica of each stage waited for
    # the other at the all-reduce (its traced seconds longer): the fit reads the other.
    profile = _profile()
    job = dataclasses.replace(profile, allreduce_scale=2.0, allreduce_latency=0.004)
    plan = PipelinePlan(width=2, depth=2, microbatches=4, schedule="1f1b", partition=(1, 3))
    trial = _traced(job, plan, 1)  # one traced program per pipeline position: replica 0's ranks
    waited = trial.actions + tuple(  # replica 1's ranks, which waited at each all-reduce
        {k: v + (0.01 if k.endswith("AR") else 0.0) for k, v in actions.items()} for actions in trial.actions
    )
    fitted = calibrate(profile, [dataclasses.replace(trial, actions=waited)])
    assert (fitted.allreduce_latency, fitted.allreduce_scale) == pytest.approx((0.004, 2.0))


def test_a_two_bw_plan_runs_and_is_tried_as_the_stream_the_model_prices() -> None:
    # The time model prices 2BW as its never-flushed stream; a step that returns its own loss
    # waits for it at every window end, so the written plan (and its trial) returns the previous one.
    from lightning_pipe.lightning.trial import strategy_init_args

    assert strategy_init_args(PipelinePlan(1, 2, 4, "2bw", partition=(2, 2)), 16)["loss"] == "previous"
    assert "loss" not in strategy_init_args(PipelinePlan(1, 2, 4, "1f1b", partition=(2, 2)), 16)


def test_every_device_holds_the_logged_values_the_trials_measured_once_per_fit() -> None:
    # Lightning keeps a copy of each logged value between steps: the most a trial's rank held is
    # added to the bytes every device holds, so to every stage's predicted peak; a refit starts
    # from the profile's own bytes (a second fit adds it once, not twice).
    profile = dataclasses.replace(_profile(), device_bytes=1000)
    plan = PipelinePlan(width=1, depth=2, microbatches=2, schedule="1f1b", partition=(2, 2))
    trials = [dataclasses.replace(_traced(profile, plan, 1), logged_bytes=n) for n in (8, 4)]
    fitted = calibrate(profile, trials)
    assert fitted.device_bytes == 1008
    assert calibrate(fitted, trials[1:]).device_bytes == 1004
    before = predict.predict(profile, plan, 1).stage_memory
    after = predict.predict(fitted, plan, 1).stage_memory
    assert [a - b for a, b in zip(after, before, strict=True)] == [8, 8]


def _launch_ranks(steps: list[float], actions: dict[str, list[float]], logged: int = 0) -> list[dict]:
    """One trial launch's two ranks: rank 1 the slower by ``steps``, after a 9 s warm-up step."""
    ends = [0.0, 9.0]
    for s in steps:
        ends.append(ends[-1] + s)
    fast = [e * 0.5 for e in ends]
    return [
        {"rank": 0, "ends": fast, "actions": actions, "logged_bytes": 0},
        {"rank": 1, "ends": ends, "actions": actions, "logged_bytes": logged},
    ]


def test_a_trial_launches_until_two_launches_agree_and_at_most_its_cap() -> None:
    from lightning_pipe.lightning.trial import LAUNCHES_AGREE, TIMED_STEPS, until_stable

    n = TIMED_STEPS - 1
    medians = iter([1.0, 1.2, 1.1, 1.19, 5.0])  # the 4th agrees with the 2nd within 3%

    def launch() -> list[dict]:
        return _launch_ranks([next(medians)] * n, {})

    assert LAUNCHES_AGREE == 0.03
    assert len(until_stable(launch, (2, 6))) == 4
    agreeing = iter([1.0, 1.02])
    assert len(until_stable(lambda: _launch_ranks([next(agreeing)] * n, {}), (2, 6))) == 2
    apart = iter([1.0, 2.0, 3.0, 4.0])
    assert len(until_stable(lambda: _launch_ranks([next(apart)] * n, {}), (2, 3))) == 3  # the cap


def test_a_trial_of_several_launches_takes_their_median_and_pools_the_traced_actions() -> None:
    from lightning_pipe.lightning.trial import TIMED_STEPS, pooled_trial

    n = TIMED_STEPS - 1
    plan = PipelinePlan(1, 2, 2, "1f1b", partition=(3, 3))
    launches = [
        _launch_ranks([1.0] * n, {"0F0": [0.1, 0.1]}, logged=4),
        _launch_ranks([1.1] * n, {"0F0": [0.3]}, logged=8),
        _launch_ranks([3.0] * n, {"0F0": [0.2, 0.2]}),  # one odd launch of three does not move the step
    ]
    trial = pooled_trial(plan, 4, launches)
    assert trial.step == pytest.approx(1.1)
    assert trial.actions[0] == {"0F0": 0.2}  # the median of 0.1, 0.1, 0.3, 0.2, 0.2
    # The launches' median absolute deviation (0.1 of 1.1, the odd launch aside), scaled to a sigma.
    assert trial.spread == pytest.approx(1.4826 * 0.1 / 1.1)
    assert trial.logged_bytes == 8 and trial.launches == pytest.approx((1.0, 1.1, 3.0))
    # Stalls over every launch's traced steps: their mean 0.18 less their median 0.2 (a rank's
    # may read below 0; the fit pools them over the ranks and keeps the whole at least 0).
    assert trial.stalls[0] == Stalls(pytest.approx(0.18 - 0.2), 0, pytest.approx(0.2))
    steady = pooled_trial(plan, 4, launches[:2])  # two launches: half their difference
    assert steady.step == pytest.approx(1.05) and steady.spread == pytest.approx(0.05 / 1.05)


def test_every_trial_reads_the_launch_noise_pooled_over_the_plan_commands_trials() -> None:
    from lightning_pipe.planning.calibration import host_launch_sigma, measured_spreads

    a, b, c = (PipelinePlan(1, 2, m, "1f1b", partition=(3, 3)) for m in (1, 2, 4))
    trials = [
        Trial(a, 8, 1.0, ({},), spread=0.005, launches=(0.98, 1.02)),  # agreed at once: 2% apart
        Trial(b, 4, 2.0, ({},), spread=0.01, launches=(1.8, 2.2, 2.0)),  # 10% apart, then a third
        Trial(c, 2, 3.0, ({},), spread=0.2),  # one launch: no degree of freedom, its own spread stays
    ]
    # Squared relative deviations about each trial's mean over the degrees of freedom (1 + 2).
    squares = (0.02**2 + 0.02**2) + (0.1**2 + 0.1**2 + 0.0)
    sigma = (squares / 3) ** 0.5
    assert host_launch_sigma(trials) == pytest.approx(sigma)
    spreads = measured_spreads(trials)
    assert spreads[(a, 8)] == pytest.approx(sigma / 2**0.5)  # the mean of two launches
    assert spreads[(b, 4)] == pytest.approx(1.2533 * sigma / 3**0.5)  # the median of three
    assert spreads[(c, 2)] == 0.2  # its own, larger than the host's one-launch error
    assert host_launch_sigma(trials[2:]) == 0.0 and measured_spreads(trials[2:]) == {(c, 2): 0.2}
