"""Pure tests of the V-shaped placement, looped BFS, ZB-V and DualPipeV (no processes)."""

from __future__ import annotations

import itertools

import pytest

from lightning_pipe import PipelinePlan
from lightning_pipe.schedules import Kind, build_inference, build_schedule, get, two_bw_run, verify
from lightning_pipe.schedules.actions import COMPUTE_KINDS, ScheduleError
from lightning_pipe.schedules.layout import owners, rank_stages, stage_rank
from lightning_pipe.schedules.simulate import SimResult, simulate
from lightning_pipe.schedules.verify import check_global_norm

DEPTHS = range(2, 7)
MICROBATCHES = range(1, 17)
#: Per-chunk costs with F = I = W, as the Zero Bubble paper's analysis assumes (a whole B is I + W).
EQUAL = {Kind.FORWARD: 1.0, Kind.INPUT_GRAD: 1.0, Kind.WEIGHT_GRAD: 1.0, Kind.BACKWARD: 2.0}


def _run(name: str, depth: int, m: int, split: bool = True, placement=None) -> SimResult:
    program = build_schedule(name, depth, m, split, virtual=2, stage_placement=placement)
    return simulate(program, lambda a: EQUAL.get(a.kind, 0.0))


def _span_bubbles(result: SimResult, depth: int) -> list[float]:
    """The Zero Bubble paper's bubble of each rank: its idle time between its first compute and
    its last (the parallelogram of one iteration; the ramp before a rank's first action is not
    idle time of the step, the next iteration's start fills it)."""
    out = []
    for r in range(depth):
        ran = [i for i in result.timeline if i.rank == r and i.action.kind in COMPUTE_KINDS]
        out.append(max(i.end for i in ran) - min(i.start for i in ran) - result.busy[r])
    return out


def test_v_placement_maps_rank_r_to_stages_r_and_2d_minus_1_minus_r() -> None:
    for d in DEPTHS:
        for r in range(d):
            assert rank_stages(r, d, 2, "v") == [r, 2 * d - 1 - r]
            assert rank_stages(r, d, 2, "loop") == [r, r + d]
        assert [stage_rank(s, d, "v") for s in range(2 * d)] == [*range(d), *reversed(range(d))]
    plan = PipelinePlan(depth=3, microbatches=4, schedule="zbv", virtual_stages=2)
    assert plan.stage_placement == "v" and plan.stages_of(0) == [0, 5] and plan.rank_of_stage(5) == 0
    assert plan == PipelinePlan(depth=3, microbatches=4, schedule="ZBVZeroBubble", virtual_stages=2, placement="v")
    assert PipelinePlan(depth=2, microbatches=4, virtual_stages=2).stage_placement == "loop"
    with pytest.raises(ValueError, match="unknown stage placement 'w'"):
        PipelinePlan(depth=2, microbatches=4, schedule="looped_bfs", virtual_stages=2, placement="w")
    with pytest.raises(ValueError, match="runs the stage placements \\['loop'\\], not 'v'"):
        PipelinePlan(depth=2, microbatches=4, virtual_stages=2, placement="v")


def test_torch_and_torchtitan_names_resolve_through_the_registry() -> None:
    names = {
        "GPipe": "gpipe",
        "1F1B": "1f1b",
        "Interleaved1F1B": "1f1b",
        "InterleavedZeroBubble": "1f1b",
        "LoopedBFS": "looped_bfs",
        "ZBVZeroBubble": "zbv",
        "DualPipeV": "dualpipev",
    }
    for alias, name in names.items():
        assert get(alias).name == name


@pytest.mark.parametrize("name", ["looped_bfs", "zbv", "dualpipev"])
def test_every_accepted_depth_and_microbatch_count_runs_without_deadlock(name: str) -> None:
    spec = get(name)
    accepted = 0
    for d, m, split, placement in itertools.product(DEPTHS, MICROBATCHES, (False, True), spec.placements):
        if not spec.runs(d, m, 2, placement):
            with pytest.raises(ValueError):
                build_schedule(name, d, m, split, virtual=2, stage_placement=placement)
            continue
        accepted += 1
        program = build_schedule(name, d, m, split, virtual=2, stage_placement=placement)
        verify(program, m, virtual=2, placement=placement)  # complete, ordered, no deadlock
        assert owners(program) == {s: stage_rank(s, d, placement) for s in range(2 * d)}
        verify(build_inference(d, m, 2, placement), m, train=False, virtual=2, placement=placement)
    assert accepted >= len(DEPTHS) * 8


@pytest.mark.parametrize("placement", ["loop", "v"])
def test_every_accepted_two_bw_layout_streams_without_deadlock(placement: str) -> None:
    # Interleaved 2BW at two stages per rank: every (d, m) the spec accepts streams three windows
    # and the drain complete, ordered and deadlock-free, with and without split backward; every
    # other one is refused by the spec and by the windows, naming the microbatches to use.
    spec, accepted, refused = get("2bw"), 0, []
    for d, m in itertools.product(DEPTHS, MICROBATCHES):
        if not spec.runs(d, m, 2, placement):
            with pytest.raises(ValueError, match="microbatches"):
                PipelinePlan(depth=d, microbatches=m, schedule="2bw", virtual_stages=2, placement=placement)
            with pytest.raises(ValueError, match="microbatches"):
                two_bw_run(d, m, 1, virtual=2, placement=placement)
            continue
        accepted += 1
        for split in (False, True):
            program = two_bw_run(d, m, 3, split, virtual=2, placement=placement)
            verify(program, 3 * m, virtual=2, placement=placement)
            assert owners(program) == {s: stage_rank(s, d, placement) for s in range(2 * d)}
            # Each optimizer step waits for every rank's all-reduce (the global norm): a plan
            # whose program deadlocks there is refused, naming it; every other one runs.
            plan = dict(depth=d, microbatches=m, schedule="2bw", split_backward=split, virtual_stages=2)
            try:
                check_global_norm(program)
            except ScheduleError:
                with pytest.raises(ValueError, match="would deadlock .*global gradient norm"):
                    PipelinePlan(**plan, placement=placement, partition=[1] * (2 * d))
                refused.append((d, m, split))
            else:
                PipelinePlan(**plan, placement=placement, partition=[1] * (2 * d))
    assert accepted >= len(DEPTHS) * 3
    assert all(split for _, _, split in refused)  # without split the all-reduce ends the window's backwards


def test_a_step_waiting_for_the_global_norm_deadlocks_a_rank_that_reduces_after_a_receive() -> None:
    # Rank 0 steps right after its all-reduce; rank 1 all-reduces only after a forward that
    # needs rank 0's next forward, which comes after rank 0's step: the step's global norm
    # waits for rank 1's all-reduce, which waits for the step. Rank 1 reducing first runs.
    from lightning_pipe.schedules import parse_actions

    stuck = [parse_actions("0F0 0B0 0AR 0OPT 0F1"), parse_actions("1F0 1B0 1F1 1AR 1OPT")]
    with pytest.raises(ScheduleError, match=r"global gradient norm: ranks wait at \{0: '0OPT', 1: '1F1'\}"):
        check_global_norm(stuck)
    check_global_norm([parse_actions("0F0 0B0 0AR 0OPT 0F1"), parse_actions("1F0 1B0 1AR 1F1 1OPT")])
    # The layout this hung through Trainer.fit: 2BW, loop placement, split, d=2, m=4.
    with pytest.raises(ValueError, match="would deadlock"):
        PipelinePlan(depth=2, microbatches=4, schedule="2bw", split_backward=True, virtual_stages=2, placement="loop")


def test_refusals_are_clear() -> None:
    with pytest.raises(ValueError, match="runs 2 stages per rank in a V: set virtual_stages=2"):
        PipelinePlan(depth=2, microbatches=4, schedule="zbv")
    with pytest.raises(ValueError, match="runs 2 stages per rank in a V: set virtual_stages=2"):
        PipelinePlan(depth=2, microbatches=4, schedule="DualPipeV", virtual_stages=3)
    with pytest.raises(ValueError, match="microbatches >= 2 x pipeline_depth"):
        PipelinePlan(depth=3, microbatches=5, schedule="dualpipev", virtual_stages=2)
    with pytest.raises(ValueError, match="one stage per rank is 'gpipe'"):
        PipelinePlan(depth=2, microbatches=4, schedule="looped_bfs")
    with pytest.raises(ValueError, match="split_placement does not apply"):
        PipelinePlan(2, 2, 4, "zbv", True, virtual_stages=2, split_placement="end")
    with pytest.raises(ValueError, match="needs pipeline_depth >= 2"):
        PipelinePlan(depth=1, microbatches=4, schedule="zbv", virtual_stages=2)


@pytest.mark.parametrize("depth", [2, 3, 4, 6])
def test_zbv_has_zero_bubble_and_1f1b_memory_at_equal_costs(depth: int) -> None:
    # Zero Bubble paper (Qi et al., ICLR 2024), section 6, and its authors' table ("Comparison
    # assuming T_F = T_B = T_W"): ZB-V's bubble rate is 0 and its activation memory 1x 1F1B's,
    # that is p microbatches of a whole stage, 2p of one of its two chunks.
    for m in (2 * depth - 1, 2 * depth, 3 * depth + 1, 16):
        result = _run("zbv", depth, m)
        assert _span_bubbles(result, depth) == [0.0] * depth
        assert result.peak_stash == [2 * depth] * depth
        one_f_one_b = simulate(build_schedule("1f1b", depth, m), {Kind.FORWARD: 2.0, Kind.BACKWARD: 4.0})
        assert max(one_f_one_b.peak_stash) == depth  # 1F1B's first stage: p microbatches of the whole stage
        # 1F1B's bubble on the same work: (p - 1)(T_F + T_B + T_W) = (p - 1)(2 + 2 + 2) per whole stage.
        assert max(_span_bubbles(one_f_one_b, depth)) == (depth - 1) * 6.0


def test_zbv_golden_two_ranks() -> None:
    # The phases of the paper's figure at d = 2, m = 4 (rank 0: stages 0 and 3, rank 1: 1 and 2).
    compute = [
        [str(a) for a in acts if a.kind in COMPUTE_KINDS] for acts in build_schedule("zbv", 2, 4, True, virtual=2)
    ]
    assert " ".join(compute[0]) == (
        "0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 3I3 3W3 0I2 0W2 0I3 0W3"
    )
    assert " ".join(compute[1]) == (
        "1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 1I2 2I3 1I3 1W2 2W3 1W3"
    )


def test_zbv_without_split_runs_whole_backwards_where_its_input_gradients_ran() -> None:
    split = build_schedule("zbv", 3, 6, True, virtual=2)
    whole = build_schedule("zbv", 3, 6, False, virtual=2)
    for s, w in zip(split, whole):
        expected = [a for a in s if a.kind is not Kind.WEIGHT_GRAD]
        assert [(a.stage, a.microbatch) for a in w] == [(a.stage, a.microbatch) for a in expected]
        assert all(a.kind is not Kind.INPUT_GRAD for a in w)


@pytest.mark.parametrize("depth", [2, 3, 4])
def test_dualpipev_holds_dualpipes_activations(depth: int) -> None:
    # DualPipe's table (DeepSeek's DualPipe repository): activations of PP + 1 microbatches per
    # rank, PP the stages of the pipeline (2d chunks here): one chunk-microbatch more than ZB-V.
    for m in (2 * depth, 3 * depth, 16):
        result = _run("dualpipev", depth, m)
        assert result.peak_stash == [2 * depth + 1] * depth
        # Every chunk runs each microbatch's F, and I and W (or a whole B), once.
        assert sum(result.busy) == pytest.approx(2 * depth * m * 3.0)


@pytest.mark.parametrize("f,i,w", [(1.0, 1.0, 1.0), (2.0, 1.0, 1.0), (1.0, 1.0, 0.5), (3.0, 2.0, 1.0), (1.0, 2.0, 1.0)])
def test_dualpipev_bubble_is_within_dualpipes_formula(f: float, i: float, w: float) -> None:
    # DualPipe's bubble (DeepSeek-V3 technical report, Table 2): (PP/2 - 1)(F&B + B - 3W), PP the
    # stages of the V (2d), B a whole backward (I + W), F&B a forward and a backward of two
    # microbatches run as a pair. This runtime runs the pair's actions one after the other, F&B =
    # F + B, and no rank idles longer than that within the step (all ranks start together).
    costs = {Kind.FORWARD: f, Kind.INPUT_GRAD: i, Kind.WEIGHT_GRAD: w, Kind.BACKWARD: i + w}
    for depth in (2, 3, 4, 5):
        for m in (2 * depth, 3 * depth + 1):
            result = simulate(build_schedule("dualpipev", depth, m, True, virtual=2), lambda a: costs.get(a.kind, 0.0))
            pair, backward = f + i + w, i + w
            formula = (2 * depth / 2 - 1) * (pair + backward - 3 * w)
            assert max(result.makespan - busy for busy in result.busy) <= formula + 1e-9


def test_looped_bfs_is_gpipe_per_chunk() -> None:
    # torch.distributed.pipelining's ScheduleLoopedBFS: every forward of the rank's first stage,
    # then of the next; backwards in reverse. Each rank holds every microbatch of each stage.
    for placement in ("loop", "v"):
        program = build_schedule("looped_bfs", 2, 3, virtual=2, stage_placement=placement)
        first, second = rank_stages(0, 2, 2, placement)
        compute = [str(a) for a in program[0] if a.kind in COMPUTE_KINDS]
        assert compute == [
            *(f"{first}F{k}" for k in range(3)),
            *(f"{second}F{k}" for k in range(3)),
            *(f"{second}B{k}" for k in range(3)),
            *(f"{first}B{k}" for k in range(3)),
        ]
        assert simulate(program, EQUAL).peak_stash == [6, 6]


def test_v_turn_needs_no_message_and_its_order_is_checked() -> None:
    program = build_schedule("zbv", 2, 2, True, virtual=2)
    # Rank 1 holds stages 1 and 2: nothing is sent between them, either way.
    between = {(Kind.SEND_ACT, 1), (Kind.RECV_ACT, 2), (Kind.SEND_GRAD, 2), (Kind.RECV_GRAD, 1)}
    assert not [a for a in program[1] if (a.kind, a.stage) in between]
    assert [a for a in program[0] if (a.kind, a.stage) == (Kind.SEND_ACT, 0)]  # rank 0 still sends to rank 1
    swapped = list(program[1])
    i, j = (next(n for n, a in enumerate(swapped) if str(a) == text) for text in ("1F0", "2F0"))
    swapped[i], swapped[j] = swapped[j], swapped[i]
    with pytest.raises(ValueError, match="stage 2 runs F0 before stage 1, on the same rank"):
        verify([program[0], swapped], 2, virtual=2, placement="v")
