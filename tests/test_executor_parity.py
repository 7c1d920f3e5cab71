"""Gradient and parameter parity of the executor against a single-process reference."""

from __future__ import annotations

import pytest
import torch

from lightning_pipe import PipelineGroups, PipelinePlan, Topology, place
from tests.shared import scenario, scenario_per_layout
from tests.models import frozen as _frozen
from tests.models import ToyChain, assert_close_dicts, make_data, reference_grads, reference_train

BATCH, M, STEPS = 16, 4, 5
COMBOS = [(s, r) for s in ("gpipe", "1f1b") for r in (False, True)]


def _shard(batch: tuple, replica: int, width: int) -> tuple:
    return tuple(t.chunk(width)[replica] for t in batch)


def _worker(rank: int, world: int, depth: int) -> dict:
    topo = Topology(world, depth)
    groups = PipelineGroups.build(topo, rank)
    replica = topo.replica_of(rank)
    results = {}
    for schedule, recompute in COMBOS:
        torch.manual_seed(0)
        model = ToyChain()
        engine = place(model, PipelinePlan(topo.width, depth, M, schedule, partition="uniform", recompute=recompute), rank, groups=groups)
        opt = torch.optim.Adam(model.parameters(), lr=model.lr)
        losses, grads = [], None
        for step in range(STEPS):
            batch = _shard(make_data(BATCH, seed=step), replica, topo.width)
            opt.zero_grad()
            losses.append(float(engine.train_step(batch, opt)))
            if step == 0:
                grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        results[(schedule, recompute)] = (grads, params, losses, engine.last_peak_stash)
    return results


LAYOUTS = [(1, 2), (1, 4), (2, 2)]
scenario_per_layout("executor", _worker, LAYOUTS)


@pytest.mark.parametrize("width,depth", LAYOUTS)
def test_executor_matches_single_process(launched, width: int, depth: int) -> None:
    out = launched(width * depth)[f"executor_{width}x{depth}"]
    assert all(status == "ok" for status, _ in out), [v for s, v in out if s != "ok"]
    torch.manual_seed(0)
    want_grads = reference_grads(ToyChain(), make_data(BATCH, seed=0))
    torch.manual_seed(0)
    want_params = reference_train(ToyChain(), [make_data(BATCH, seed=s) for s in range(STEPS)])
    for combo in COMBOS:
        grads, params = {}, {}
        for rank in range(depth):  # replica 0 holds every stage; others must agree with it
            grads.update(out[rank][1][combo][0])
            params.update(out[rank][1][combo][1])
        assert_close_dicts(grads, want_grads, rtol=1e-5)
        assert_close_dicts(params, want_params, rtol=1e-5)
        for rank in range(depth, width * depth):
            assert_close_dicts(out[rank][1][combo][1], {k: params[k] for k in out[rank][1][combo][1]}, rtol=0, atol=0)
        peaks = [out[r][1][combo][3] for r in range(depth)]
        assert peaks == [M if combo[0] == "gpipe" else min(depth - s, M) for s in range(depth)]
        losses = [out[r][1][combo][2] for r in range(depth)]
        assert all(l == losses[0] for l in losses), "every stage must return the same loss"


SIZES = [8, 7, 5, 3]  # the last batches are partial: uneven microbatches, new shapes every step


def _varying_worker(rank: int, world: int) -> list[dict]:
    topo = Topology(world, world)
    groups = PipelineGroups.build(topo, rank)
    torch.manual_seed(0)
    model = ToyChain()
    engine = place(model, PipelinePlan(1, world, 3, "1f1b", partition="uniform"), rank, groups=groups)
    grads = []
    for step, size in enumerate(SIZES):
        engine.train_step(make_data(size, seed=step), _frozen(engine))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    return grads


scenario(2, "executor_varying_shapes", _varying_worker)


def test_shapes_change_between_steps(launched) -> None:
    out = launched(2)["executor_varying_shapes"]
    assert all(status == "ok" for status, _ in out), out
    torch.manual_seed(0)
    reference = ToyChain()
    for step, size in enumerate(SIZES):
        got = {**out[0][1][step], **out[1][1][step]}
        assert_close_dicts(got, reference_grads(reference, make_data(size, seed=step)), rtol=1e-5)
