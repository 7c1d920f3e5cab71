"""Split backward (2BP) as schedule data: the pass, 2BP's Table 1, and stash memory."""

from __future__ import annotations

from typing import Callable

import pytest

from lightning_pipe.schedules import build_schedule, format_actions, one_f_one_b, two_bw, two_bw_run, verify
from lightning_pipe.schedules.actions import Action, Kind
from lightning_pipe.schedules.generators import gpipe
from lightning_pipe.schedules.passes import add_communication, add_optimizer
from lightning_pipe.schedules.simulate import ScheduleError, StashModel, simulate
from lightning_pipe.schedules.w_placement import carry_split, split_backward

# Equal F, I and W times (2BP, Table 1); an unsplit B is I followed by W.
EQUAL = {Kind.FORWARD: 1.0, Kind.INPUT_GRAD: 1.0, Kind.WEIGHT_GRAD: 1.0, Kind.BACKWARD: 2.0}

# 2BP, Table 1: (schedule, microbatches as a function of N, bubble without 2BP, with 2BP).
TABLE_1 = {
    "Naive": ("gpipe", lambda n: 1, lambda n: (n - 1) / n, lambda n: 2 * (n - 1) / (2 * n + 1)),
    "GPipe": ("gpipe", lambda n: n, lambda n: (n - 1) / (2 * n - 1), lambda n: 2 * (n - 1) / (2 * (n - 1) + 3 * n)),
    "1F1B-1": ("1f1b", lambda n: n, lambda n: (n - 1) / (2 * n - 1), lambda n: (n - 1) / (n - 1 + 3 * n)),
    "1F1B-2": ("1f1b", lambda n: 2 * n, lambda n: (n - 1) / (3 * n - 1), lambda n: (n - 1) / (n - 1 + 6 * n)),
}


def _placed(d: int, m: int, placement: str) -> list:
    """GPipe over ``d`` stages, ``m`` microbatches, split with W's placed by ``placement``."""
    return [add_optimizer(add_communication(split_backward(gpipe(s, d, m), placement), d), s) for s in range(d)]


@pytest.mark.parametrize("row", list(TABLE_1))
def test_simulator_reproduces_table_1(row: str) -> None:
    name, microbatches, plain, with_2bp = TABLE_1[row]
    for n in range(2, 9):
        m = microbatches(n)
        assert simulate(build_schedule(name, n, m), EQUAL).total_bubble == pytest.approx(plain(n))
        assert simulate(build_schedule(name, n, m, split=True), EQUAL).total_bubble == pytest.approx(with_2bp(n))
        if name == "gpipe":  # 2BP's own GPipe placement (every W after the last I), and one W per I, the same
            for placement in ("end", "cooldown"):
                assert simulate(_placed(n, m, placement), EQUAL).total_bubble == pytest.approx(with_2bp(n))


def test_golden_split_and_placement() -> None:
    assert format_actions(split_backward(one_f_one_b(0, 2, 2), "cooldown")) == "0F0 0F1 0I0 0W0 0I1 0W1"
    assert format_actions(split_backward(one_f_one_b(1, 2, 3), "cooldown")) == "1F0 1I0 1F1 1I1 1F2 1I2 1W0 1W1 1W2"
    assert format_actions(split_backward(one_f_one_b(1, 2, 3), "zb-h1")) == "1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1W2"
    gpipe_3 = [
        [a for a in actions if a.kind in (Kind.INPUT_GRAD, Kind.WEIGHT_GRAD)]
        for actions in build_schedule("gpipe", 3, 3, split=True)
    ]
    assert [format_actions(a) for a in gpipe_3] == [  # GPipe: stage s defers W's until s wait (ZB-H1's bound)
        "0I0 0W0 0I1 0W1 0I2 0W2",
        "1I0 1I1 1W0 1I2 1W1 1W2",
        "2I0 2I1 2I2 2W0 2W1 2W2",
    ]
    assert (
        format_actions(split_backward(gpipe(2, 3, 3), "bounded", max_pending=0))
        == "2F0 2F1 2F2 2I0 2W0 2I1 2W1 2I2 2W2"
    )
    at_end = [
        a
        for a in split_backward(build_schedule("gpipe", 2, 2)[0], "end")
        if a.kind in (Kind.INPUT_GRAD, Kind.WEIGHT_GRAD)
    ]
    assert format_actions(at_end) == "0I0 0I1 0W0 0W1"  # 2BP, section 3.2: all W after all I
    assert format_actions(build_schedule("1f1b", 2, 1, split=True)[1]) == "1RF0 1F0 1I0 1SB0 1W0 1AR 1OPT"
    with pytest.raises(ValueError, match="unknown W placement"):
        split_backward([], "sometime")


def _stage_costs(i: float, w: float) -> Callable[[Action], float]:
    """F = 0.5, B = 1 on every stage; I = ``i`` and W = ``w`` but on stage 0, whose input needs
    no gradient: its I computes nothing and its W is a whole backward."""

    def cost(a: Action) -> float:
        first = a.stage == 0
        return {
            Kind.FORWARD: 0.5,
            Kind.BACKWARD: 1.0,
            Kind.INPUT_GRAD: 0.0 if first else i,
            Kind.WEIGHT_GRAD: 1.0 if first else w,
        }.get(a.kind, 0.0)

    return cost


@pytest.mark.parametrize("i, w", [(0.55, 0.45), (0.596, 0.478)])  # I + W = B; and 1.07 B, as GPT blocks on a CPU
def test_gpipe_split_is_faster_than_gpipe_when_the_first_stage_has_no_input_gradient(i: float, w: float) -> None:
    # Deferring every W to the end (2BP's GPipe placement) idles stage 0 while gradients
    # arrive, then runs them in a row: slower than no split. Running each W right after its I
    # ("cooldown") sends each gradient after a whole I + W, no faster than a full backward:
    # slower than no split where I + W costs more than B. ZB-H1's bound (GPipe's default) is
    # faster than no split, as fast as "cooldown" where I + W = B, and faster where it costs more.
    cost = _stage_costs(i, w)
    for d in (2, 4, 8):
        for m in (d, 2 * d):
            plain = simulate(build_schedule("gpipe", d, m), cost).makespan
            split = simulate(build_schedule("gpipe", d, m, split=True), cost).makespan
            cooldown, end = (simulate(_placed(d, m, placement), cost).makespan for placement in ("cooldown", "end"))
            assert split < plain < end and (split < cooldown if i + w > 1 else split == pytest.approx(cooldown)), (d, m)
    if i + w > 1:  # the GPT example's case, d = 2, m = 8: "cooldown" is slower than no split
        assert (
            simulate(_placed(2, 8, "cooldown"), cost).makespan > simulate(build_schedule("gpipe", 2, 8), cost).makespan
        )


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("max_pending", [None, 0, 1, 3])
def test_split_schedules_are_valid(name: str, max_pending: int) -> None:
    for d in range(1, 9):
        for m in range(1, 17):
            program = build_schedule(name, d, m, split=True, max_pending=max_pending)
            verify(program, m)  # F, I, W once each and in that order; no deadlock
            for actions in program:  # every W before the all-reduce that needs its gradient
                ar = next(i for i, a in enumerate(actions) if a.kind is Kind.ALL_REDUCE)
                assert all(i < ar for i, a in enumerate(actions) if a.kind is Kind.WEIGHT_GRAD)


def test_memory_bounded_split_brings_1f1b_2_back_towards_1f1b_1() -> None:
    # 2BP, Figure 5: running W part-way through 1F1B-2 lowers its peak stash.
    stash = StashModel(activation=1.0, after_input_grad=0.5)
    n = 4
    unbounded = simulate(build_schedule("1f1b", n, 2 * n, split=True, max_pending=2 * n), EQUAL, stash)  # 2BP
    bounded = simulate(build_schedule("1f1b", n, 2 * n, split=True, max_pending=1), EQUAL, stash)
    one_f_one_b_1 = simulate(build_schedule("1f1b", n, n, split=True), EQUAL, stash)
    plain = simulate(build_schedule("1f1b", n, 2 * n), EQUAL, stash)
    assert max(bounded.peak_stash_bytes) < max(unbounded.peak_stash_bytes)
    assert max(bounded.peak_stash_bytes) - max(one_f_one_b_1.peak_stash_bytes) < 0.5 * (
        max(unbounded.peak_stash_bytes) - max(one_f_one_b_1.peak_stash_bytes)
    )
    assert bounded.total_bubble < plain.total_bubble  # still fills bubbles
    # Split keeps microbatches stashed until W: more than the d - s of plain 1F1B.
    assert unbounded.peak_stash == [2 * n] * n and plain.peak_stash == [n - s for s in range(n)]


@pytest.mark.parametrize("f, i, w", [(1.0, 1.0, 1.0), (2.0, 2.0, 1.0), (1.0, 2.0, 1.0), (3.0, 2.0, 2.0)])
def test_split_1f1b_is_zero_bubble_h1(f: float, i: float, w: float) -> None:
    # Zero Bubble (Qi et al., 2023), section 2.1, ZB-H1 with T_W <= T_F: each stage idles
    # (p-1)(T_F + T_B - T_W) (their B is our I), and every stage holds at most p microbatches,
    # the peak of 1F1B's first stage, so no stage needs more than 1F1B's peak memory.
    costs = {Kind.FORWARD: f, Kind.INPUT_GRAD: i, Kind.WEIGHT_GRAD: w}
    for p in range(2, 9):
        for m in range(p, 3 * p + 1):
            result = simulate(build_schedule("1f1b", p, m, split=True), costs)
            assert result.makespan == pytest.approx(m * (f + i + w) + (p - 1) * (f + i - w))
            assert all(b == pytest.approx((p - 1) * (f + i - w)) for b in (result.makespan - x for x in result.busy))
            assert result.peak_stash == [p] * p == [max(simulate(build_schedule("1f1b", p, m), costs).peak_stash)] * p


@pytest.mark.parametrize("depth", range(1, 7))
def test_split_two_bw_keeps_weight_grads_before_the_step(depth: int) -> None:
    for m in range(depth, 10):
        program = two_bw_run(depth, m, 3, split=True)
        verify(program, 3 * m)
        for actions in program:  # a batch's W's all run before its all-reduce, and that before its step
            reduced = stepped = 0
            for a in actions:
                if a.kind is Kind.ALL_REDUCE:
                    reduced += 1
                if a.kind is Kind.OPTIMIZER_STEP:
                    assert stepped < reduced, f"step {stepped} before its batch's all-reduce"
                    stepped += 1
                if a.kind is Kind.WEIGHT_GRAD:
                    assert a.microbatch // m == reduced, f"W{a.microbatch} after its batch's all-reduce"
            assert reduced == stepped == 3


@pytest.mark.parametrize("depth", range(1, 7))
def test_split_two_bw_windows_are_parts_of_one_carried_stream(depth: int) -> None:
    # Each window (and the drain) is built from the window before it alone; together they must
    # be what the "carry" placement writes over the whole stream at once.
    for m in (depth, depth + 1, 2 * depth):
        for early in (True, False):
            steps = 4
            program = two_bw_run(depth, m, steps, split=True, early=early)
            for s in range(depth):
                parts = [two_bw.window(s, depth, m, t, early) for t in range(steps)] + [
                    two_bw.drain(s, depth, m, steps - 1)
                ]
                whole = [a for part in carry_split(parts, m) for a in part]
                compute = [
                    a
                    for a in program[s]
                    if a.kind not in (Kind.SEND_ACT, Kind.SEND_GRAD, Kind.RECV_ACT, Kind.RECV_GRAD)
                ]
                assert compute == whole


@pytest.mark.parametrize("depth", [2, 3, 4, 8])
def test_split_two_bw_posts_every_norm_before_the_first_stage_steps(depth: int) -> None:
    # Stage 0 steps right after its all-reduce, and that step waits for every stage's gradient
    # norm (schedules/two_bw.py). With equal F, I and W, the carry placement has every stage's
    # all-reduce of batch b done when stage 0 starts its step of batch b (a batch's last W runs
    # after the next F: after the next I it would come a whole F late). Stages slower than
    # stage 0 can still be late by the difference; that wait is measured, not simulated.
    for m in (depth, 2 * depth):
        result = simulate(two_bw_run(depth, m, 4, split=True), EQUAL)
        reduced: dict[int, list[float]] = {}
        for i in result.timeline:
            if i.action.kind is Kind.ALL_REDUCE:
                reduced.setdefault(i.rank, []).append(i.end)
        steps = [i.start for i in result.timeline if i.rank == 0 and i.action.kind is Kind.OPTIMIZER_STEP]
        assert len(steps) == 4
        for rank in range(1, depth):
            assert all(reduced[rank][b] <= start for b, start in enumerate(steps)), (
                f"rank {rank}: {reduced[rank]} vs {steps}"
            )


@pytest.mark.parametrize("depth", [2, 3, 4, 8])
def test_split_two_bw_hides_hops_shorter_than_half_a_weight_gradient(depth: int) -> None:
    # 2BW has no bubble: in steady state a stage's microbatch takes F + B (PipeDream-2BW paper, section
    # 3.1). A message that travels h delays the gradient of a stage's next I by a round trip:
    # unsplit, every microbatch then takes at least h longer. Split with "carry", the stage runs
    # its held-back W meanwhile, so a hop up to W / 2 costs nothing but once per batch, where a
    # batch's last W runs before the next I (so that every stage posts its gradient norm before
    # stage 0 steps): at most one round trip, 2h, per batch.
    def rate(split: bool, latency: float) -> float:  # per microbatch, windows 3 to 8 of a long stream
        short, long = (simulate(two_bw_run(depth, m, n, split), EQUAL, latency=latency).makespan for n in (3, 9))
        return (long - short) / (6 * m)

    for m in (depth, 2 * depth):
        for latency in (0.1, 0.25, 0.5):
            assert rate(True, latency) <= 3.0 + 2 * latency / m + 1e-9
            assert rate(False, latency) >= 3.0 + latency - 1e-9
    m = 2 * depth
    assert rate(True, 0.75) > 3.0 + 2 * 0.75 / m  # past W / 2 the round trip shows at every microbatch


def test_drain_placement_splits_only_the_backwards_after_the_last_forward() -> None:
    assert format_actions(split_backward(one_f_one_b(1, 2, 3), "drain")) == "1F0 1B0 1F1 1B1 1F2 1I2 1W2"
    assert format_actions(split_backward(one_f_one_b(0, 2, 3), "drain")) == "0F0 0F1 0B0 0F2 0I1 0W1 0I2 0W2"
    # the gradient goes upstream after I, before W
    assert (
        format_actions(build_schedule("1f1b", 2, 2, split=True, placement="drain")[1])
        == "1RF0 1F0 1B0 1SB0 1RF1 1F1 1I1 1SB1 1W1 1AR 1OPT"
    )


@pytest.mark.parametrize(
    "f, i, w", [(1.0, 1.0, 1.0), (2.0, 2.0, 1.0), (1.0, 2.0, 1.0), (3.0, 1.0, 2.0), (0.5, 0.6, 0.48)]
)
def test_drain_split_keeps_1f1b_memory_and_saves_a_weight_gradient_per_hop(f: float, i: float, w: float) -> None:
    # 1F1B takes (m + p - 1)(F + B). In its drain every stage waits for the gradient of each
    # microbatch; split there, the gradient leaves after I and the stage's W runs while the stage
    # above computes, so each of the p - 1 hops of the last microbatch's gradient is a W shorter
    # (where W <= F, ZB-H1's condition too): (m + p - 1)(F + I + W) - (p - 1) W, half of ZB-H1's
    # saving with equal costs. Before the drain the program is 1F1B's, so each stage holds as many
    # microbatches as under 1F1B (p - s on stage s), not ZB-H1's p on every stage.
    costs = {Kind.FORWARD: f, Kind.INPUT_GRAD: i, Kind.WEIGHT_GRAD: w, Kind.BACKWARD: i + w}
    for p in range(1, 9):
        for m in range(1, 17):
            program = build_schedule("1f1b", p, m, split=True, placement="drain")
            verify(program, m)
            result, plain = simulate(program, costs), simulate(build_schedule("1f1b", p, m), costs)
            assert plain.makespan == pytest.approx((m + p - 1) * (f + i + w))
            assert result.makespan == pytest.approx((m + p - 1) * (f + i + w) - (p - 1) * w)
            assert result.peak_stash == plain.peak_stash == [min(m, p - s) for s in range(p)]


def test_verify_takes_split_and_whole_backwards_per_microbatch_but_not_both() -> None:
    mixed = build_schedule("1f1b", 2, 3, split=True, placement="drain")
    verify(mixed, 3)
    both = [list(actions) for actions in mixed]
    both[1].insert(len(both[1]) - 2, Action(1, Kind.BACKWARD, 2))  # 1B2 beside 1I2 1W2
    with pytest.raises(ScheduleError, match="runs BACKWARD of microbatch 2 1 times"):
        verify(both, 3)
    half = [[a for a in actions if not (a.stage == 1 and a.kind is Kind.WEIGHT_GRAD)] for actions in mixed]
    with pytest.raises(ScheduleError, match="runs WEIGHT_GRAD of microbatch 2 0 times"):
        verify(half, 3)
