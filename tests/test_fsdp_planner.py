"""The planner's FSDP dimension: its time model, the search offering it, and the plan it writes (pure, one process)."""

from __future__ import annotations

from typing import Optional

import pytest

from lightning_pipe import PipelinePlan
from lightning_pipe.lightning.plan_cli import table
from lightning_pipe.lightning.trial import strategy_init_args
from lightning_pipe.planning import costs, predict, search
from lightning_pipe.planning.profile import BlockProfile, BlockSample, Profile
from lightning_pipe.schedules import Action, Kind

PARAMS, GRADS, OPT = 4000, 4000, 32000  # bytes per block: Adam's state dominates


def _profile(
    n: int = 2,
    bandwidth: float = 1e4,
    optimizer_step: float = 0.0,
    shared: Optional[list[list[int]]] = None,
) -> Profile:
    """A hand-made profile: ``n`` equal blocks, linear in the microbatch size, no tied weights known."""

    def at(k: int) -> BlockSample:
        return BlockSample(k, k * 1.0, k * 2.0, k * 1.0, k * 1.0, k * 100, k * 10)

    blocks = [BlockProfile(f"b{i}", [at(1), at(4)], PARAMS, GRADS, OPT) for i in range(n)]
    return Profile(
        blocks,
        optimizer_step=optimizer_step,
        input_bytes_per_sample=5,
        allreduce_bandwidth=bandwidth,
        shared_blocks=[] if shared is None else shared,
    )


def _brute_force(profile: Profile, devices: int, batch: int, limit: Optional[float]) -> list[predict.Prediction]:
    """Every DDP candidate, evaluated with ddp replicas and, where the runtime shards it, with FSDP's two settings."""
    found = []
    for c in search.candidates(profile, devices, batch, memory_limit=limit, fsdp=False):
        assert c.plan.data_parallel == "ddp"
        variants = [c.plan]
        if c.plan.width > 1 and c.plan.virtual_stages == 1 and not c.plan.spec.streams:
            variants += [c.plan.replace(data_parallel="fsdp", reshard_after_forward=r) for r in (True, False)]
        found += [search.evaluate(profile, search.Candidate(v, c.microbatch_size), limit) for v in variants]
    return found


def _fastest_feasible(found: list[predict.Prediction]) -> predict.Prediction:
    return max((p for p in found if p.feasible), key=lambda p: p.samples_per_second)


def test_search_picks_fsdp_only_where_ddp_does_not_fit() -> None:
    profile = _profile()
    devices, batch = 4, 8
    assert not any(p.plan.data_parallel == "fsdp" for p in search.search(profile, devices, batch))  # no budget
    free = search.search(profile, devices, batch, fsdp=True)
    assert any(p.plan.data_parallel == "fsdp" for p in free)  # offered when asked
    assert free[0].plan.data_parallel == "ddp"  # slower links: FSDP is predicted slower
    best_free = _fastest_feasible(_brute_force(profile, devices, batch, None))
    assert free[0].step_time == pytest.approx(best_free.step_time)
    assert best_free.plan.data_parallel == "ddp"

    ddp_peak = min(max(p.stage_memory) for p in free if p.plan.data_parallel == "ddp")
    # recompute cannot bring DDP under this: Adam's state alone is over it
    limit = ddp_peak - 1
    limited = search.search(profile, devices, batch, memory_limit=limit)
    assert limited[0].feasible and limited[0].plan.data_parallel == "fsdp"
    assert not any(p.feasible for p in limited if p.plan.data_parallel == "ddp")
    brute = _fastest_feasible(_brute_force(profile, devices, batch, limit))
    assert brute.plan.data_parallel == "fsdp"
    assert limited[0].samples_per_second == pytest.approx(brute.samples_per_second)
    assert search.choose(limited).plan.data_parallel == "fsdp"

    # a budget DDP fits: DDP again, being faster
    roomy = search.search(profile, devices, batch, memory_limit=2 * ddp_peak)
    assert roomy[0].plan.data_parallel == "ddp"
    assert roomy[0].samples_per_second == pytest.approx(
        _fastest_feasible(_brute_force(profile, devices, batch, 2 * ddp_peak)).samples_per_second
    )


def test_search_prefers_fsdp_where_predicted_faster() -> None:
    """A slow optimizer step and fast links: the sharded step over 1/w of the weights wins."""
    profile = _profile(bandwidth=1e9, optimizer_step=10.0)
    ranked = search.search(profile, 4, 8, fsdp=True)
    assert ranked[0].plan.data_parallel == "fsdp"
    best = _fastest_feasible(_brute_force(profile, 4, 8, None))
    assert ranked[0].samples_per_second == pytest.approx(best.samples_per_second)


def test_search_offers_fsdp_only_where_the_runtime_shards() -> None:
    def offered(profile: Profile, **kw: object) -> list[PipelinePlan]:
        return [c.plan for c in search.candidates(profile, 4, 8, **kw) if c.plan.data_parallel == "fsdp"]  # type: ignore[arg-type]

    assert not offered(_profile())  # without a memory limit: DDP only
    plans = offered(_profile(), fsdp=True)
    assert plans and {p.reshard_after_forward for p in plans} == {True, False}
    assert all(p.width > 1 and p.virtual_stages == 1 and not p.spec.streams for p in plans)
    assert {p.split_backward for p in plans} == {True, False}  # split backward sharded too (ShardedStage)
    assert offered(_profile(), memory_limit=1e12) == plans  # a memory limit offers them
    assert all(not p.spec.streams for p in offered(_profile(), allow_stale=True, fsdp=True))  # 2BW: DDP only
    assert not offered(_profile(shared=[[0, 1]]), fsdp=True)  # tied weights: refused by the runtime
    unknown = _profile()
    unknown.shared_blocks = None
    assert not offered(unknown, fsdp=True)  # unknown ties may be some
    assert not offered(_profile(bandwidth=0.0), fsdp=True)  # the collectives cannot be priced
    assert not offered(_profile(), fsdp=False)  # the AutoPlanner's search


@pytest.mark.parametrize("reshard", [True, False])
def test_fsdp_time_model_written_out(reshard: bool) -> None:
    """One rank (d = 1, GPipe): the step is every action back to back, written out from the formula."""
    bw, w, m, b, opt_step = 1e4, 2, 3, 2, 0.6
    profile = _profile(n=2, bandwidth=bw, optimizer_step=opt_step)
    plan = PipelinePlan(w, 1, m, "gpipe", data_parallel="fsdp", reshard_after_forward=reshard, partition=(2,))
    f, bwd = 2 * b * 1.0, 2 * b * 2.0  # two blocks' forward and backward at microbatch size b
    share = (w - 1) / w
    reduce_scatter = share * 2 * GRADS / bw  # once per step, at AR: half DDP's ring all-reduce
    all_gather = share * 2 * PARAMS / bw  # the stage's weights, once
    gathers = 2 * m if reshard else 1  # ZeRO-3: each forward and backward; ZeRO-2: once per step
    expected = m * (f + bwd) + gathers * all_gather + reduce_scatter + opt_step / w
    got = predict.predict(profile, plan, b)
    assert got.step_time == pytest.approx(expected)

    cost = costs.action_cost(profile, plan, costs.stage_costs(profile, plan, b))
    ddp = costs.action_cost(
        profile, plan.replace(data_parallel="ddp", reshard_after_forward=True), costs.stage_costs(profile, plan, b)
    )
    assert cost(Action(0, Kind.ALL_REDUCE)) == pytest.approx(reduce_scatter)
    assert ddp(Action(0, Kind.ALL_REDUCE)) == pytest.approx(2 * reduce_scatter)
    forward_gather = all_gather if reshard else all_gather / m
    assert cost(Action(0, Kind.FORWARD, 0)) - ddp(Action(0, Kind.FORWARD, 0)) == pytest.approx(forward_gather)
    assert cost(Action(0, Kind.BACKWARD, 0)) - ddp(Action(0, Kind.BACKWARD, 0)) == pytest.approx(
        all_gather if reshard else 0.0
    )
    # ZeRO-3 moves 1.5x DDP's bytes per microbatch pass (the ZeRO paper), with equal weights and gradients
    if reshard:
        _, fsdp_bytes = costs.traffic(profile, plan.replace(microbatches=1), b)
        _, ddp_bytes = costs.traffic(profile, plan.replace(microbatches=1, data_parallel="ddp"), b)
        assert fsdp_bytes == pytest.approx(1.5 * ddp_bytes)


def test_plan_written_trains_fsdp() -> None:
    plan = PipelinePlan(2, 2, 4, "1f1b", data_parallel="fsdp", reshard_after_forward=False, partition=(1, 1))
    init = strategy_init_args(plan, 16)
    assert init["data_parallel"] == "fsdp" and init["reshard_after_forward"] is False
    assert "data_parallel" not in strategy_init_args(plan.replace(data_parallel="ddp", reshard_after_forward=True), 16)
    from lightning_pipe import PipelineStrategy

    strategy = PipelineStrategy(**init)
    assert strategy.data_parallel == "fsdp"
    p = predict.predict(_profile(), plan, 2)
    assert "fsdp (ZeRO-2)" in table([p], 1)
    assert "FSDP replicas (kept gathered: ZeRO-2)" in plan.describe()


def test_fsdp_split_backward_priced_as_the_runtime_gathers() -> None:
    """ZeRO-3 with split backward, ZB-H1 at (2, 2): what each action gathers, walked over the
    program as the runtime leaves each stage gathered or not (runtime/sharding.py, ShardedStage),
    averaged over the step's actions of its kind. Stage 0 runs F F I W F I W F I W I W: every
    forward gathers (the one before resharded it), its I is empty and every W gathers. Stage 1
    runs F I F I W F I W F I W W: its I keeps it gathered for its W, so the forwards after the
    first find it gathered (and reshard it: the next I gathers again) and no W gathers."""
    profile = _profile(n=4)
    plan = PipelinePlan(2, 2, 4, "1f1b", split_backward=True, data_parallel="fsdp", partition=(2, 2))
    kinds = (Kind.FORWARD, Kind.INPUT_GRAD, Kind.WEIGHT_GRAD)
    assert [[costs.gathers(plan, Action(s, k, 0)) for k in kinds] for s in (0, 1)] == [[1, 0, 1], [0.25, 1, 0]]
    # A recomputed stage's I reruns its forward, which gathers and reshards, then gathers again.
    assert [[costs.gathers(plan.replace(recompute=True), Action(s, k, 0)) for k in kinds] for s in (0, 1)] == [
        [1, 1, 1],
        [0.25, 2, 0],
    ]
    zero2 = plan.replace(reshard_after_forward=False)
    assert [costs.gathers(zero2, Action(1, k, 0)) for k in kinds] == [1 / 4, 0.0, 0.0]
    # The step's gathers: the stage's weights (w - 1) / w of them each, at the replicas' bandwidth.
    share, st = (plan.width - 1) / plan.width, costs.stage_costs(profile, plan, 2)
    cost = costs.action_cost(profile, plan, st)
    ddp = costs.action_cost(profile, plan.replace(data_parallel="ddp"), st)
    for s, per_kind in ((0, (1, 0, 1)), (1, (0.25, 1, 0))):
        for kind, n in zip(kinds, per_kind):
            gather = n * share * st[s].weight_bytes / profile.allreduce_bandwidth
            assert cost(Action(s, kind, 0)) - ddp(Action(s, kind, 0)) == pytest.approx(gather), (s, kind)

    # The most microbatches pending at an I that gathers (the memory model holds the stage
    # gathered at the others): ZB-H1's forwards reshard between I's; under GPipe only the first gathers.
    assert [costs.gathering_pending(plan, s) for s in (0, 1)] == [0, 2]
    assert [costs.gathering_pending(plan.replace(schedule="gpipe"), s) for s in (0, 1)] == [0, 1]
    assert costs.gathering_pending(zero2, 1) == 0

    # Per step (the traffic's all-gathers): stage 0 gathers at its 4 forwards and 4 W's, stage 1 at
    # its first forward and 4 I's.
    assert costs.step_gathers(plan) == [8, 5] and costs.step_gathers(plan.replace(split_backward=False)) == [8, 8]
    _, moved = costs.traffic(profile, plan, 2)
    assert moved == pytest.approx(
        sum(share * (st[s].gradient_bytes + n * st[s].weight_bytes) for s, n in ((0, 8), (1, 5)))
    )

    # The memory model holds the whole stage gathered from an I to its W; without split backward
    # the largest block's weights, its flat all-gather output counted at its gather.
    assert predict.sharding(profile, plan, 1).gathered_bytes == 2 * PARAMS  # both blocks of the stage
    assert predict.sharding(profile, plan.replace(split_backward=False, partition=(1, 3)), 1).gathered_bytes == (
        PARAMS  # the largest of three blocks
    )
    assert search.offers_fsdp(profile, plan) and search.offers_fsdp(profile, zero2)
