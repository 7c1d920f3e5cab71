"""Pure tests of the schedule IR, generators, verifier and simulator (no processes)."""

from __future__ import annotations

import pytest

from lightning_pipe.schedules import (
    Action,
    Kind,
    build_inference,
    build_schedule,
    format_actions,
    parse_actions,
    verify,
)
from lightning_pipe.schedules.simulate import ScheduleError, simulate, unit_costs

DEPTHS = range(1, 9)
MICROBATCHES = range(1, 17)


def test_text_form_round_trips() -> None:
    program = build_schedule("1f1b", 3, 4)
    for actions in program:
        assert parse_actions(format_actions(actions)) == actions
    assert str(Action(1, Kind.FORWARD, 3)) == "1F3"
    assert Action.parse("12SB7") == Action(12, Kind.SEND_GRAD, 7)
    assert Action.parse("2OPT") == Action(2, Kind.OPTIMIZER_STEP)
    with pytest.raises(ValueError, match="not an action"):
        Action.parse("1X3")


def test_golden_two_stage_schedules() -> None:
    # The diagrams in generators.py, written out (compute actions only).
    def compute(name: str) -> list[str]:
        return [
            " ".join(str(a) for a in acts if a.kind in (Kind.FORWARD, Kind.BACKWARD))
            for acts in build_schedule(name, 2, 3)
        ]

    assert compute("gpipe") == ["0F0 0F1 0F2 0B0 0B1 0B2", "1F0 1F1 1F2 1B0 1B1 1B2"]
    assert compute("1f1b") == ["0F0 0F1 0B0 0F2 0B1 0B2", "1F0 1B0 1F1 1B1 1F2 1B2"]
    assert format_actions(build_schedule("1f1b", 2, 1)[1]) == "1RF0 1F0 1B0 1SB0 1AR 1OPT"


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_schedules_are_valid_and_match_seed_bubble(name: str) -> None:
    for d in DEPTHS:
        for m in MICROBATCHES:
            program = build_schedule(name, d, m)
            verify(program, m)  # each F and B once, F before B, no deadlock
            result = simulate(program, unit_costs())
            bubble = (d - 1) / (m + d - 1)  # GPipe's bubble: 1 - 2mn / (2n(m+n-1))
            assert result.makespan == pytest.approx(2 * (m + d - 1))
            assert result.bubble == pytest.approx([bubble] * d)
            if name == "gpipe":
                assert result.peak_stash == [m] * d
            else:
                assert all(p <= d - s for s, p in enumerate(result.peak_stash))
                assert result.peak_stash == [min(d - s, m) for s in range(d)]


def test_inference_schedule_runs_forwards_only() -> None:
    for d in DEPTHS:
        program = build_inference(d, 5)
        verify(program, 5, train=False)
        assert simulate(program, unit_costs()).makespan == 5 + d - 1


def test_unknown_schedule_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zigzag'"):
        build_schedule("zigzag", 2, 2)


def test_verifier_catches_deadlock_and_bad_order() -> None:
    program = build_schedule("gpipe", 2, 2)
    # Stage 1 waits for gradients of microbatch 1 before microbatch 0 ever arrives: deadlock.
    swapped = [program[0], parse_actions("1RB0 1RF0 1F0 1B0 1SB0 1RF1 1F1 1B1 1SB1 1AR 1OPT")]
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(swapped, unit_costs())
    backward_first = [parse_actions("0B0 0F0")]
    with pytest.raises(ScheduleError, match="B before F"):
        verify(backward_first, 1)
    with pytest.raises(ScheduleError, match="1 runs FORWARD of microbatch 1 0 times"):
        verify([program[0], [a for a in program[1] if str(a) != "1F1"]], 2)


def test_simulator_uses_cost_model() -> None:
    costs = {Kind.FORWARD: 1.0, Kind.BACKWARD: 2.0}
    result = simulate(build_schedule("gpipe", 4, 8), costs)
    assert result.makespan == pytest.approx(3 * (8 + 4 - 1))
    assert result.total_bubble == pytest.approx(3 / 11)


def test_interleaved_golden_schedule() -> None:
    # The diagram in schedules/interleaved.py: stages 0 and 2 on rank 0, 1 and 3 on rank 1.
    program = build_schedule("1f1b", 2, 2, virtual=2)
    compute = [" ".join(str(a) for a in acts if a.kind in (Kind.FORWARD, Kind.BACKWARD)) for acts in program]
    assert compute == ["0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1", "1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1"]
    # Stage 1 -> 2 crosses from rank 1 back to rank 0; the last stage (3) sends no activation.
    assert "1SF0" in format_actions(program[1]) and "2RF0" in format_actions(program[0])
    assert "3SF" not in format_actions(program[1]) and "0SB" not in format_actions(program[0])


@pytest.mark.parametrize("virtual", [2, 3, 4])
def test_interleaved_bubble_is_megatrons(virtual: int) -> None:
    # Megatron-LM (SC 2021) section 2.2.2: with per-chunk costs F = B = 1, the bubble is
    # (d - 1)(F + B) against an ideal step of v m (F + B), so idle / busy = (d - 1) / (v m).
    for d in range(2, 9):
        for m in range(d, 5 * d, d):
            program = build_schedule("1f1b", d, m, virtual=virtual)
            verify(program, m, virtual=virtual)
            verify(build_inference(d, m, virtual), m, train=False, virtual=virtual)
            result = simulate(program, unit_costs())
            assert result.busy == [2 * m * virtual] * d
            assert result.makespan - result.busy[0] == pytest.approx(2 * (d - 1))
            assert (result.makespan - result.busy[0]) / result.busy[0] == pytest.approx((d - 1) / (virtual * m))
            # Rank r holds its warm-up forwards plus one (Megatron's 2(d-1-r) + (v-1)d + 1 chunks).
            assert result.peak_stash == [min(2 * (d - 1 - r) + (virtual - 1) * d + 1, m * virtual) for r in range(d)]


@pytest.mark.parametrize("f, i, w", [(1.0, 1.0, 1.0), (2.0, 2.0, 1.0), (1.0, 2.0, 1.0), (3.0, 2.0, 2.0)])
def test_interleaved_split_is_zero_bubble_h1_per_chunk(f: float, i: float, w: float) -> None:
    # Each rank places its W's as ZB-H1 does (rank r keeps r waiting). Zero Bubble's ZB-H1 idle
    # time (Qi et al., 2023, section 2.1, T_W <= T_F), (d-1)(F + I - W), holds with per-chunk
    # costs: v times less than ZB-H1 on whole stages, and less than interleaved 1F1B's
    # (d-1)(F + I + W); no rank holds more chunks than interleaved 1F1B's first rank.
    costs = {Kind.FORWARD: f, Kind.INPUT_GRAD: i, Kind.WEIGHT_GRAD: w, Kind.BACKWARD: i + w}
    for d in range(2, 9):
        for virtual in (2, 3, 4):
            for m in range(d, 3 * d + 1, d):
                program = build_schedule("1f1b", d, m, split=True, virtual=virtual)
                verify(program, m, virtual=virtual)
                result = simulate(program, costs)
                assert result.makespan == pytest.approx(virtual * m * (f + i + w) + (d - 1) * (f + i - w))
                assert all(
                    b == pytest.approx((d - 1) * (f + i - w)) for b in (result.makespan - x for x in result.busy)
                )
                plain = simulate(build_schedule("1f1b", d, m, virtual=virtual), costs)
                assert plain.makespan - plain.busy[0] == pytest.approx((d - 1) * (f + i + w))
                assert max(result.peak_stash) <= plain.peak_stash[0] == max(plain.peak_stash)


def test_interleaved_misuse_is_refused() -> None:
    with pytest.raises(ValueError, match="multiple of it"):
        build_schedule("1f1b", 4, 6, virtual=2)
    with pytest.raises(ValueError, match="virtual_stages=2 runs interleaved 1F1B: use schedule='1f1b'"):
        build_schedule("gpipe", 2, 2, virtual=2)
    with pytest.raises(ValueError, match="pipeline_depth >= 2"):
        build_schedule("1f1b", 1, 2, virtual=2)
    with pytest.raises(ScheduleError, match="does not run"):
        verify(build_schedule("1f1b", 2, 2, virtual=2), 2)  # stages 2 and 3 need virtual=2
