"""PipeDream-2BW: schedule data, version semantics, simulator, and runtime parity with the
seed's delayed update rule W(t+1) = W(t) - lr * grad f(W(t-1)) written out in the tests."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_pipe import PipelineGroups, PipelinePlan, Topology, place
from lightning_pipe.schedules import (
    Kind,
    build_schedule,
    format_actions,
    get,
    receive_order,
    two_bw,
    two_bw_arrivals,
    two_bw_run,
    verify,
)
from lightning_pipe.schedules.simulate import simulate, unit_costs
from tests.models import ToyChain, assert_close_dicts, make_data, make_optimizer, reference_train
from tests.shared import scenario, scenario_per_layout

# -- pure ----------------------------------------------------------------------------------


def test_golden_two_stage_windows() -> None:
    # The diagram in schedules/two_bw.py, written out (compute, version, reduce and step actions).
    shown = {Kind.FORWARD, Kind.BACKWARD, Kind.VERSION, Kind.ALL_REDUCE, Kind.OPTIMIZER_STEP}
    program = two_bw_run(2, 2, 2)
    assert [format_actions([a for a in acts if a.kind in shown]) for acts in program] == [
        "0V0 0F0 0F1 0B0 0V2 0F2 0B1 0AR 0OPT 0F3 0B2 0B3 0AR 0OPT",
        "1V0 1F0 1B0 1F1 1B1 1AR 1V2 1F2 1B2 1F3 1B3 1AR 1OPT 1OPT",
    ]
    # With weights tied across stages every stage steps at the window's end (the step waits for all).
    late = two_bw_run(2, 2, 2, early=False)
    assert (
        format_actions([a for a in late[0] if a.kind in shown])
        == "0V0 0F0 0F1 0B0 0V2 0F2 0B1 0AR 0F3 0B2 0OPT 0B3 0AR 0OPT"
    )


def _replay_versions(actions: list, m: int) -> int:
    """Replay one rank's actions with the seed's rule, independent of the runtime: batch b runs
    on slot b % 2; the step for batch b writes version b+1 into that slot (one slot pair per
    rank, over all its stages; each stage's V sets the slot that stage's forwards read). Checks
    every microbatch k (0-indexed) runs F and B on version max(floor(k/m) - 1, 0) on every
    stage and returns the most versions alive at once."""
    slot_version: dict[int, int] = {0: 0, 1: 0}
    forward_slot: dict[int, int] = {}
    steps, seen, peak = 0, {}, 1
    for a in actions:
        key = (a.stage, a.microbatch)
        if a.kind is Kind.VERSION:
            forward_slot[a.stage] = (a.microbatch // m) % 2
        elif a.kind is Kind.FORWARD:
            slot = forward_slot[a.stage]
            seen[key] = (slot, slot_version[slot])
            assert slot_version[slot] == max(a.microbatch // m - 1, 0), f"{a} on wrong version"
        elif a.kind in (Kind.BACKWARD, Kind.INPUT_GRAD, Kind.WEIGHT_GRAD):
            slot, version = seen[key]
            assert slot_version[slot] == version, f"{a} ran on a version changed since its forward"
        elif a.kind is Kind.OPTIMIZER_STEP:
            slot_version[steps % 2] = steps + 1
            steps += 1
            peak = max(peak, len(set(slot_version.values())))
    return peak


@pytest.mark.parametrize("depth", range(1, 7))
@pytest.mark.parametrize("early", [True, False])
def test_two_bw_programs_are_valid_and_keep_two_versions(depth: int, early: bool) -> None:
    for m in range(depth, 13):
        for steps in (1, 2, 4):
            program = two_bw_run(depth, m, steps, early=early)
            verify(program, steps * m)  # each F and B once, F before B, deadlock-free
            for actions in program:
                assert _replay_versions(actions, m) <= 2
                assert sum(a.kind is Kind.OPTIMIZER_STEP for a in actions) == steps
            assert simulate(program, unit_costs()).peak_stash == [depth - s for s in range(depth)]


def test_golden_interleaved_windows() -> None:
    # The diagram of interleaved 2BW in schedules/two_bw.py, written out: d=2, v=2, m=2.
    shown = {Kind.FORWARD, Kind.BACKWARD, Kind.VERSION, Kind.ALL_REDUCE, Kind.OPTIMIZER_STEP}
    program = two_bw_run(2, 2, 1, virtual=2)
    assert [format_actions([a for a in acts if a.kind in shown]) for acts in program] == [
        "0V0 0F0 0F1 2V0 2F0 2F1 2B0 2B1 0B0 0B1 0AR 0OPT",
        "1V0 1F0 1F1 3V0 3F0 3B0 3F1 3B1 1B0 1B1 1AR 1OPT",
    ]


def _interleaved_layouts() -> list[tuple[int, int, int, str]]:
    """(d, m, v, placement) of interleaved 2BW: the loop placement at v = 2 and 3, the V at v = 2,
    each at the two smallest m it runs."""
    layouts = []
    for depth in range(2, 6):
        for virtual, placement in ((2, "loop"), (3, "loop"), (2, "v")):
            runs = [m for m in range(depth, 5 * depth) if get("2bw").runs(depth, m, virtual, placement)]
            layouts += [(depth, m, virtual, placement) for m in runs[:2]]
    return layouts


def _closes_batches(actions: list, m: int) -> None:
    """Each AR follows every backward (or W) of its batch on the rank."""
    stages = len({a.stage for a in actions if a.kind is Kind.FORWARD})
    done: dict[int, int] = {}
    reduced = 0
    for a in actions:
        if a.kind in (Kind.BACKWARD, Kind.WEIGHT_GRAD):
            done[a.microbatch // m] = done.get(a.microbatch // m, 0) + 1
            assert a.microbatch // m >= reduced, f"{a} after its batch's all-reduce"
        elif a.kind is Kind.ALL_REDUCE:
            assert done.get(reduced) == m * stages, f"all-reduce {reduced} before its batch's gradients are whole"
            reduced += 1


@pytest.mark.parametrize("depth,m,virtual,placement", _interleaved_layouts())
@pytest.mark.parametrize("early", [True, False])
@pytest.mark.parametrize("split", [False, True])
def test_interleaved_programs_are_valid_and_keep_two_versions(
    depth: int, m: int, virtual: int, placement: str, early: bool, split: bool
) -> None:
    for steps in (1, 2, 4):
        program = two_bw_run(depth, m, steps, split=split, early=early, virtual=virtual, placement=placement)
        # each F and B (or I and W) once per stage, ordered, deadlock-free, the V's turn in order
        verify(program, steps * m, virtual=virtual, placement=placement)
        for rank, actions in enumerate(program):
            assert _replay_versions(actions, m) <= 2  # never a third weight version, W's included
            _closes_batches(actions, m)
            stages = {a.stage for a in actions if a.kind is Kind.FORWARD}
            versions = [a for a in actions if a.kind is Kind.VERSION]
            assert sorted((a.stage, a.microbatch) for a in versions) == sorted(
                (s, t * m) for t in range(steps) for s in stages
            ), "a V at each batch's first forward on every stage"
            assert sum(a.kind is Kind.OPTIMIZER_STEP for a in actions) == steps
            assert sum(a.kind is Kind.ALL_REDUCE for a in actions) == steps
            if split:  # the carry placement per stage: stage 0 keeps no W waiting, the others one
                waiting = dict.fromkeys(stages, 0)
                for a in actions:
                    if a.kind in (Kind.INPUT_GRAD, Kind.WEIGHT_GRAD):
                        waiting[a.stage] += 1 if a.kind is Kind.INPUT_GRAD else -1
                        assert waiting[a.stage] <= min(a.stage, 1) + 1, f"{a}: W's waiting"


@pytest.mark.parametrize("depth,m,virtual,placement", _interleaved_layouts())
def test_split_interleaved_windows_are_parts_of_one_carried_stream(
    depth: int, m: int, virtual: int, placement: str
) -> None:
    # Each split window (and the drain) is built from the rank's window before it alone; together
    # they must be what the "carry" placement writes over the rank's whole stream at once.
    from lightning_pipe.schedules.w_placement import carry_split

    steps, comm = 4, (Kind.SEND_ACT, Kind.SEND_GRAD, Kind.RECV_ACT, Kind.RECV_GRAD)
    program = two_bw_run(depth, m, steps, split=True, virtual=virtual, placement=placement)
    plain = two_bw_run(depth, m, steps, virtual=virtual, placement=placement)
    for rank in range(depth):
        parts = [[a for a in plain[rank] if a.kind not in comm]]
        whole = [a for part in carry_split(parts, m) for a in part]
        assert [a for a in program[rank] if a.kind not in comm] == whole


def test_golden_v_windows() -> None:
    # The diagram of 2BW in a V in schedules/two_bw.py, written out: d=2, m=3.
    shown = {Kind.FORWARD, Kind.BACKWARD, Kind.VERSION, Kind.ALL_REDUCE, Kind.OPTIMIZER_STEP}
    program = two_bw_run(2, 3, 1, virtual=2, placement="v")
    assert [format_actions([a for a in acts if a.kind in shown]) for acts in program] == [
        "0V0 0F0 0F1 3V0 3F0 3B0 0F2 3F1 3B1 3F2 3B2 0B0 0B1 0B2 0AR 0OPT",
        "1V0 1F0 2V0 2F0 1F1 2F1 2B0 1F2 2F2 2B1 1B0 1B1 2B2 1B2 1AR 1OPT",
    ]


@pytest.mark.parametrize("depth,m,virtual,placement", _interleaved_layouts())
def test_interleaved_window_arrivals_follow_the_senders_order(depth: int, m: int, virtual: int, placement: str) -> None:
    # A window's receives, per neighbour in the order it sends them, continue one another
    # window after window: together they are the whole stream's order (runtime/comm/mailbox.py
    # reads each neighbour's messages in that order).
    steps = 6
    run = two_bw_run(depth, m, steps, virtual=virtual, placement=placement)
    for rank in range(depth):
        got: dict[int, list] = {}
        parts = [two_bw_arrivals(rank, depth, m, t, virtual=virtual, placement=placement) for t in range(steps)]
        parts.append(two_bw_arrivals(rank, depth, m, steps - 1, drain=True, virtual=virtual, placement=placement))
        for part in parts:
            for src, keys in part.items():
                got.setdefault(src, []).extend(keys)
        assert got == receive_order(run, rank)


@pytest.mark.parametrize("depth,m,virtual,placement", _interleaved_layouts())
def test_interleaved_steady_state_has_no_flush_bubble(depth: int, m: int, virtual: int, placement: str) -> None:
    # With unit costs a rank's step is m v forwards and m v backwards of a stage: interleaved
    # 2BW's steady-state window takes exactly that under the loop placement, where interleaved
    # 1F1B's flushed step adds its bubble, (d - 1)(F + B). In a V each window takes its lead
    # anew: 2d - 3 more, one less than flushed ZB-V without split backward (schedules/two_bw.py).
    n = 8

    def per_step(split: bool = False) -> float:
        runs = [two_bw_run(depth, m, k, split, virtual=virtual, placement=placement) for k in (n, 2 * n)]
        return (simulate(runs[1], unit_costs()).makespan - simulate(runs[0], unit_costs()).makespan) / n

    if placement == "v":
        flush = simulate(build_schedule("zbv", depth, m, virtual=2), unit_costs()).makespan
        assert per_step() == 4 * m + 2 * depth - 3 == flush - 1
        return
    flush = simulate(build_schedule("1f1b", depth, m, virtual=virtual), unit_costs()).makespan
    assert per_step() == 2 * m * virtual
    assert flush == per_step() + 2 * (depth - 1)


def test_gradient_sets_follow_each_ranks_program() -> None:
    # A stage holds two batches' gradients where its backwards of the next batch start before its
    # rank's deferred step: d=2, v=2, m=2 rank 1 (stages 1, 3) runs 3B of batch t before its OPT
    # for t-1, 1B after it; rank 0 steps right after its all-reduce. One stage per rank: the first
    # stage one, the others two (planning/costs.gradient_sets).
    from lightning_pipe.planning.programs import gradient_sets

    assert gradient_sets(PipelinePlan(1, 2, 2, "2bw", virtual_stages=2, partition=[1] * 4)) == [1, 1, 1, 2]
    assert gradient_sets(PipelinePlan(1, 2, 2, "2bw", partition=[1] * 2)) == [1, 2]
    assert gradient_sets(PipelinePlan(1, 2, 2, "1f1b", virtual_stages=2, partition=[1] * 4)) == [1] * 4
    # In a V rank 0 holds stage 0 (one set: it steps right after its all-reduce) and the last
    # stage, whose next batch's backwards run before that step; under split backward its W's
    # wait past the step (its I's gradients of undeferred weights are counted apart:
    # planning/memory.resting_bytes). Rank 1's stages 1 and 2 step at the window's end.
    for split, sets in ((False, [1, 2, 2, 2]), (True, [1, 1, 2, 1])):
        plan = PipelinePlan(1, 2, 3, "2bw", split, virtual_stages=2, placement="v", partition=[1] * 4)
        assert gradient_sets(plan) == sets


@pytest.mark.parametrize("depth,m", [(2, 2), (4, 4), (4, 8), (3, 5)])
def test_a_rank_holds_the_batch_befores_gradients_only_until_its_deferred_step(depth: int, m: int) -> None:
    # Per rank, walked action by action: a batch's gradients exist from its first W (or B) on,
    # and each OPT steps (and frees) the oldest batch's. An action is "lone" when fewer batches'
    # gradients live before it than the most the rank ever holds.
    from lightning_pipe.planning import programs
    from lightning_pipe.planning.held import lone_gradients
    from lightning_pipe.schedules.flat import BACKWARD, WEIGHT_GRAD

    plan = PipelinePlan(1, depth, m, "2bw", True, partition=[1] * depth)
    key = programs.program_key(plan, 3)
    flat = programs._flat(*key)
    lone = lone_gradients(flat, (flat.kind == BACKWARD) | (flat.kind == WEIGHT_GRAD), m)
    for r, actions in enumerate(programs._program(*key)):
        started: set[int] = set()
        stepped, live = 0, []
        for a in actions:
            live.append(len(started) - stepped)
            if a.kind in (Kind.BACKWARD, Kind.WEIGHT_GRAD):
                started.add(a.microbatch // m)
            stepped += a.kind is Kind.OPTIMIZER_STEP
        most = max(max(live), len(started) - stepped)
        expected = [n < most for n in live]
        assert lone[flat.starts[r] : flat.starts[r + 1]].tolist() == expected, r


def test_interleaved_two_bw_refusals_name_what_to_use() -> None:
    with pytest.raises(ValueError, match="use microbatches >= 8"):
        PipelinePlan(depth=4, microbatches=4, schedule="2bw", virtual_stages=2)
    with pytest.raises(ValueError, match="2BW in a V needs microbatches >= 2 pipeline_depth - 1 = 7.*>= 7"):
        PipelinePlan(depth=4, microbatches=6, schedule="2bw", virtual_stages=2, placement="v")
    with pytest.raises(ValueError, match="2BW in a V runs two stages per rank.*virtual_stages=2"):
        PipelinePlan(depth=2, microbatches=8, schedule="2bw", virtual_stages=3, placement="v")
    with pytest.raises(ValueError, match="multiple of it"):
        PipelinePlan(depth=2, microbatches=3, schedule="2bw", virtual_stages=2)
    with pytest.raises(ValueError, match="build it with two_bw_window"):
        build_schedule("2bw", 2, 2, virtual=2)
    assert get("2bw").runs(2, 3, 2, "v") and not get("2bw").runs(2, 2, 2, "v") and get("2bw").runs(2, 2, 2)
    # Split backward runs at every placement: each stage of a rank keeps its own W waiting.
    plan = PipelinePlan(depth=2, microbatches=3, schedule="2bw", virtual_stages=2, placement="v", split_backward=True)
    assert plan.stage_placement == "v" and plan.split_backward


def test_fewer_microbatches_than_stages_is_refused() -> None:
    with pytest.raises(ValueError, match="'2bw' needs microbatches >= pipeline_depth"):
        two_bw.window(0, 4, 3, 0)
    with pytest.raises(ValueError, match="'2bw' needs microbatches >= pipeline_depth"):
        PipelinePlan(depth=4, schedule="2bw", microbatches=2)


def test_steady_state_bubble_tends_to_zero() -> None:
    bubbles = [simulate(two_bw_run(4, 4, n), unit_costs()).total_bubble for n in (1, 4, 16, 64)]
    assert bubbles == sorted(bubbles, reverse=True)
    assert bubbles[-1] < 0.02


@pytest.mark.parametrize("depth", range(2, 9))
def test_step_time_against_pipedream_flush(depth: int) -> None:
    m, n = depth, 40  # m = d, as in the PipeDream-2BW paper's comparison
    per_step = (
        simulate(two_bw_run(depth, m, 2 * n), unit_costs()).makespan
        - simulate(two_bw_run(depth, m, n), unit_costs()).makespan
    ) / n
    flush = simulate(build_schedule("1f1b", depth, m), unit_costs()).makespan
    assert flush / per_step == pytest.approx((m + depth - 1) / m, rel=0.05)


# -- runtime parity --------------------------------------------------------------------------

BATCH, M, STEPS = 16, 4, 6
CASES = {
    # name: (schedule, optimizer, clip, step whose batch holds a NaN)
    "2bw-sgd": ("2bw", "sgd", None, None),
    "2bw-adam": ("2bw", "adam", None, None),
    "2bw-adam-clip": ("2bw", "adam", 0.05, None),
    "2bw-adam-nan": ("2bw", "adam", None, 2),
    "1f1b-adam-clip-nan": ("1f1b", "adam", 0.05, 3),
}


def _batches(nan_step: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    batches = [make_data(BATCH, seed=t) for t in range(STEPS)]
    if nan_step is not None:
        batches[nan_step][0][1, 2] = float("nan")
    return batches


def _two_bw_worker(rank: int, world: int, depth: int) -> dict:
    topo = Topology(world, depth)
    groups = PipelineGroups.build(topo, rank)
    replica, results = topo.replica_of(rank), {}
    for name, (schedule, kind, clip, nan_step) in CASES.items():
        torch.manual_seed(0)
        model = ToyChain()
        engine = place(
            model,
            PipelinePlan(topo.width, depth, M, schedule, partition="uniform"),
            rank,
            groups=groups,
            gradient_clip_val=clip,
        )
        opt = make_optimizer(model.parameters(), kind, model.lr)
        history, losses, in_flight, grad_sets = [], [], [], []
        step = engine.update.optimizer_step

        def counting(
            optimizer: Any, on_step: Any, step: Any = step, grad_sets: list = grad_sets, engine: Any = engine
        ) -> Any:
            # Batches whose gradients the stage holds when a step starts (slots with a .grad).
            grad_sets.append(sum(any(p.grad is not None for p in slot) for slot in engine.versions.slots if slot))
            return step(optimizer, on_step)

        engine.update.optimizer_step = counting
        for batch in _batches(nan_step):
            shard = tuple(t.chunk(topo.width)[replica] for t in batch)
            losses.append(float(engine.train_step(shard, opt)))
            history.append({k: v.clone() for k, v in engine.current_weights().items()})
            in_flight.append(engine.in_flight)
        engine.drain()
        history.append({k: v.clone() for k, v in engine.current_weights().items()})
        params = list(engine.stage.parameters())
        results[name] = {
            "history": history,
            "losses": losses,
            "module": {n: p.detach().clone() for n, p in model.named_parameters()},
            "peak_versions": engine.versions.peak_live,
            "state_on_module": sorted(id(p) for p in opt.state) == sorted(id(p) for p in params),
            "skipped": engine.skipped_steps,
            "in_flight": in_flight,
            "grad_sets": grad_sets,
        }
    return results


def _stage_union(out: list, depth: int, name: str, key: str, index: Any = None) -> dict:
    merged: dict = {}
    for rank in range(depth):
        value = out[rank][1][name][key]
        merged.update(value if index is None else value[index])
    return merged


LAYOUTS = [(1, 2), (1, 4), (2, 2)]
scenario_per_layout("two_bw", _two_bw_worker, LAYOUTS)


@pytest.mark.parametrize("width,depth", LAYOUTS)
def test_two_bw_follows_the_delayed_update_rule(launched, width: int, depth: int) -> None:
    out = launched(width * depth)[f"two_bw_{width}x{depth}"]
    assert all(status == "ok" for status, _ in out), [v for s, v in out if s != "ok"]
    for name, (schedule, kind, clip, nan_step) in CASES.items():
        delay = 1 if schedule == "2bw" else 0
        torch.manual_seed(0)
        history: list = []
        reference_train(ToyChain(), _batches(nan_step), delay=delay, optimizer=kind, clip=clip, history=history)
        # After step t the newest weights are W(t) under 2BW (batch t's update comes one step
        # later) and W(t+1) when flushed; the drain brings both to W(STEPS).
        for t in range(STEPS + 1):
            want = history[min(t + 1 - delay, STEPS)] if t < STEPS else history[STEPS]
            assert_close_dicts(_stage_union(out, depth, name, "history", t), want, rtol=1e-5)
        assert_close_dicts(_stage_union(out, depth, name, "module", None), history[STEPS], rtol=1e-5)
        for rank in range(width * depth):
            result = out[rank][1][name]
            assert result["peak_versions"] <= (2 if delay else 1)
            assert result["state_on_module"], "optimizer state must live on the module's parameters, once"
            assert result["skipped"] == (0 if nan_step is None else 1), "every rank skips the non-finite step"
            # No flush between steps under 2BW: stage s still holds d-1-s microbatches after each.
            stage = rank % depth
            assert result["in_flight"] == [(depth - 1 - stage) if delay else 0] * STEPS
            # 2BW's stage 0 steps right after its all-reduce, before the next batch's gradients
            # appear; the other stages step at the window's end, holding two batches' gradients.
            assert len(result["grad_sets"]) == STEPS
            assert max(result["grad_sets"]) == (2 if delay and stage > 0 else 1), result["grad_sets"]
    # The test can tell 2BW from 1F1B: the vanilla rule ends far from the delayed one.
    torch.manual_seed(0)
    vanilla = reference_train(ToyChain(), _batches(None), optimizer="adam")
    delayed = _stage_union(out, depth, "2bw-adam", "module", None)
    assert max(float((vanilla[k] - delayed[k]).abs().max()) for k in vanilla) > 1e-3


def _one_step_worker(rank: int, world: int) -> dict:
    groups = PipelineGroups.build(Topology(world, world), rank)
    torch.manual_seed(0)
    model = ToyChain()
    engine = place(model, PipelinePlan(1, world, M, "2bw", partition="uniform"), rank, groups=groups)
    opt = make_optimizer(model.parameters(), "adam", model.lr)
    engine.train_step(make_data(BATCH, seed=0), opt)
    engine.drain()  # as Lightning does when validation comes after the first step
    return {n: p.detach().clone() for n, p in model.named_parameters()}


scenario(2, "two_bw_one_step_drain", _one_step_worker)


def test_drain_after_the_first_two_bw_step_applies_its_update(launched) -> None:
    out = launched(2)["two_bw_one_step_drain"]
    assert all(status == "ok" for status, _ in out), [v for s, v in out if s != "ok"]
    torch.manual_seed(0)
    history: list = []
    reference_train(ToyChain(), [make_data(BATCH, seed=0)], delay=1, optimizer="adam", history=history)
    merged = {**out[0][1], **out[1][1]}
    assert_close_dicts(merged, history[1], rtol=1e-5)


def _held_sends_worker(rank: int, world: int) -> list[int]:
    """Messages whose tensors a 2BW stage still keeps after each of 8 steps (the stream never waits)."""
    groups = PipelineGroups.build(Topology(world, world), rank)
    torch.manual_seed(0)
    model = ToyChain()
    engine = place(model, PipelinePlan(1, world, M, "2bw", partition="uniform"), rank, groups=groups)
    opt = make_optimizer(model.parameters(), "sgd", model.lr)
    held = []
    for step in range(8):
        engine.train_step(make_data(BATCH, seed=step), opt)
        held.append(sum(len(box.messages) for box in engine._state.sent.values()))
    engine.drain()
    return held


scenario(2, "two_bw_held_sends", _held_sends_worker)


def test_a_two_bw_stream_does_not_keep_its_sent_tensors(launched) -> None:
    # Gloo reports a send complete only once waited on, and a 2BW stream never waits: before the
    # peers acknowledged receipt in their headers, every message sent stayed alive (M more each step).
    out = launched(2)["two_bw_held_sends"]
    assert all(status == "ok" for status, _ in out), [v for s, v in out if s != "ok"]
    for _, held in out:
        assert max(held) <= 2 and held[-1] <= held[0], held


def _loss_mode_worker(rank: int, world: int) -> dict:
    """Losses ``train_step`` returns on every stage under each loss mode, and the final weights."""
    groups = PipelineGroups.build(Topology(world, world), rank)
    out = {}
    for mode in ("current", "previous"):
        torch.manual_seed(0)
        model = ToyChain()
        engine = place(model, PipelinePlan(1, world, M, "2bw", partition="uniform"), rank, groups=groups, loss=mode)
        opt = make_optimizer(model.parameters(), "sgd", model.lr)
        losses = [float(engine.train_step(batch, opt)) for batch in _batches(None)]
        engine.drain()
        out[mode] = (losses, {n: p.detach().clone() for n, p in model.named_parameters()})
    return out


scenario(2, "two_bw_loss_modes", _loss_mode_worker)


def test_previous_loss_mode_returns_the_last_steps_loss_and_trains_alike(launched) -> None:
    out = launched(2)["two_bw_loss_modes"]
    assert all(status == "ok" for status, _ in out), [v for s, v in out if s != "ok"]
    torch.manual_seed(0)
    want: list[float] = []
    final = reference_train(ToyChain(), _batches(None), losses=want, delay=1, optimizer="sgd")
    for _, result in out:  # every stage returns the loss the last stage computed
        current, previous = result["current"][0], result["previous"][0]
        assert current == pytest.approx(want, rel=1e-5)
        assert previous == pytest.approx([want[0]] + want[:-1], rel=1e-5)  # the first step has no previous one
    merged = {**out[0][1]["previous"][1], **out[1][1]["previous"][1]}
    assert_close_dicts(merged, final, rtol=1e-5)


def test_an_unknown_loss_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="loss must be one of"):
        place(ToyChain(), PipelinePlan(1, 1, 2, "2bw", partition="uniform"), 0, loss="mean")
