"""Gradient and parameter parity of the executor against a single-process reference."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_pipe import PipelineGroups, PipelinePlan, Topology, place
from tests.models import ToyChain, assert_close_dicts, make_data, reference_grads, reference_train
from tests.models import frozen as _frozen
from tests.nccl_order import record, run_in_order
from tests.shared import scenario, scenario_per_layout

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
        engine = place(
            model,
            PipelinePlan(topo.width, depth, M, schedule, partition="uniform", recompute=recompute),
            rank,
            groups=groups,
        )
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
        assert all(loss == losses[0] for loss in losses), "every stage must return the same loss"


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


def _side_channel_worker(rank: int, world: int) -> tuple[list[dict], list[tuple[bool, bool, bool]], str, dict]:
    """Headers on a gloo group of their own (as with NCCL tensors): gradients for changing
    shapes, where each message went, what a failure on the other rank raised here, and the
    transfers each group carried."""
    import dataclasses

    import torch.distributed as dist

    from lightning_pipe.runtime.comm import p2p

    base = PipelineGroups.build(Topology(world, world), rank, side_channel=True)
    # The failure below leaves a receive and the loss broadcast posted: on groups of this test
    # alone, not the launch's (a failed job ends; a shared launch goes on). Its link groups are.
    groups = dataclasses.replace(base, pp=dist.new_group(backend="gloo"))
    links = set(groups.links.values())
    torch.manual_seed(0)
    model = ToyChain()
    engine = place(model, PipelinePlan(1, world, 3, "1f1b", partition="uniform"), rank, groups=groups)
    routes = []
    grads = []
    with record(skip=groups.headers) as streams:
        original = dist.isend  # the recorder's: both see every single send

        def recording(tensor: Any, dst: int, group: Any = None, tag: int = 0) -> Any:
            header = tensor.dtype == torch.int64 and tensor.numel() == p2p.HEADER_LEN
            routes.append((header, group is groups.headers, group in links))
            return original(tensor, dst, group=group, tag=tag)

        dist.isend = recording
        try:
            for step, size in enumerate(SIZES):
                engine.train_step(make_data(size, seed=step), _frozen(engine))
                grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        finally:
            dist.isend = original
    if rank == world - 1:
        model.pipeline_loss = lambda *args: (_ for _ in ()).throw(RuntimeError("loss exploded"))
    try:
        engine.train_step(make_data(8, seed=9), _frozen(engine))
        failure = "none"
    except Exception as err:  # noqa: BLE001 - the test reads what each rank saw
        failure = f"{type(err).__name__}: {err}"
    return grads, routes, failure, streams


scenario(2, "executor_side_channel", _side_channel_worker)


def _replays(per_rank: list[dict]) -> None:
    """Every transfer the ranks recorded runs when replayed in NCCL's order (tests/nccl_order.py)."""
    posted = sum(len(ops) for streams in per_rank for batches in streams.values() for ops in batches)
    assert posted > 0 and run_in_order(dict(enumerate(per_rank))) == posted


def test_headers_over_a_side_channel(launched) -> None:
    # With tensors on NCCL, headers go over a gloo group so that reading one never waits on the
    # GPU. Forced on here (gloo both): same gradients as one process while shapes change (so
    # placeholders are sent too), every header on the side group and every tensor on the group
    # of its link and direction, which replayed in NCCL's order runs through, and a failure's
    # notice still reaches the other rank.
    out = launched(2)["executor_side_channel"]
    assert all(status == "ok" for status, _ in out), out
    torch.manual_seed(0)
    reference = ToyChain()
    for step, size in enumerate(SIZES):
        got = {**out[0][1][0][step], **out[1][1][0][step]}
        assert_close_dicts(got, reference_grads(reference, make_data(size, seed=step)), rtol=1e-5)
    for _, (_, routes, _, _) in out:
        assert routes and all(header == on_side and header != on_link for header, on_side, on_link in routes), routes
        assert sum(header for header, _, _ in routes) * 2 <= len(routes)  # a header, then at least one tensor
    _replays([value[3] for _, value in out])
    assert out[1][1][2] == "RuntimeError: loss exploded"
    assert out[0][1][2].startswith("PipelineAbortedError") and "loss exploded" in out[0][1][2], out[0][1][2]


# Rank 0 runs its backwards in the other order: it reads mb 1's gradient before mb 0's, which
# rank 1 sends first, and rank 1 reads rank 0's the same way round. Each rank must read its
# neighbour's messages in the order they were sent and keep the early one until its action.
OUT_OF_ORDER = ["0F0 0F1 2F0 2F1 2B1 2B0 0B1 0B0", "1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1"]


def _out_of_order_program() -> list:
    from lightning_pipe.schedules import parse_actions, verify
    from lightning_pipe.schedules.passes import add_communication, add_optimizer

    program = [add_optimizer(add_communication(parse_actions(text), 4), r) for r, text in enumerate(OUT_OF_ORDER)]
    verify(program, 2, virtual=2)
    return program


def _interleaved(rank: int, world: int, microbatches: int) -> tuple[ToyChain, Any]:
    """ToyChain with 6 residual blocks over 2 ranks, two stages each (interleaved 1F1B)."""
    groups = PipelineGroups.build(Topology(world, world), rank)
    torch.manual_seed(0)
    model = ToyChain(6)
    plan = PipelinePlan(1, 2, microbatches, "1f1b", partition="uniform", virtual_stages=2)
    return model, place(model, plan, rank, groups=groups)


def _out_of_order_worker(rank: int, world: int) -> dict:
    from lightning_pipe.schedules import receive_order

    model, engine = _interleaved(rank, world, 2)
    program = _out_of_order_program()
    engine._programs[(True, 2)] = (
        program[rank],
        {1 - rank: receive_order(program, rank)[1 - rank]},
    )  # this step runs it
    engine.train_step(make_data(8, seed=0), _frozen(engine))
    return {n: p.grad.clone() for n, p in model.named_parameters()}


scenario(2, "executor_out_of_order", _out_of_order_worker)


def test_messages_read_in_another_order_than_sent(launched) -> None:
    from lightning_pipe.schedules import Kind, receive_order

    program = _out_of_order_program()
    for rank in range(2):  # the case is real: each rank reads in another order than its neighbour sends
        sent = receive_order(program, rank)[1 - rank]
        read = [a for a in program[rank] if a.kind in (Kind.RECV_ACT, Kind.RECV_GRAD)]
        assert sorted(map(str, sent)) == sorted(map(str, read)) and sent != read
    out = launched(2)["executor_out_of_order"]
    assert all(status == "ok" for status, _ in out), out
    torch.manual_seed(0)
    assert_close_dicts({**out[0][1], **out[1][1]}, reference_grads(ToyChain(6), make_data(8, seed=0)), rtol=1e-5)


def _link_worker(rank: int, world: int) -> tuple[int, int, int]:
    """Messages sent after the first step that did not match the receives their reader posted
    ahead; the sends those steps posted; and their programs' send actions."""
    import torch.distributed as dist

    from lightning_pipe.runtime.comm import p2p
    from lightning_pipe.schedules.actions import Kind

    _, engine = _interleaved(rank, world, 4)
    engine.train_step(make_data(8, seed=0), _frozen(engine))
    mismatched, posted, original, isend = [0], [0], p2p._unexpected, dist.isend

    def counting(posted: Any, specs: Any) -> bool:
        unexpected = original(posted, specs)
        mismatched[0] += unexpected
        return unexpected

    def sending(*args: Any, **kwargs: Any) -> Any:
        posted[0] += 1
        return isend(*args, **kwargs)

    p2p._unexpected, dist.isend = counting, sending
    try:
        for step in range(1, 3):
            engine.train_step(make_data(8, seed=step), _frozen(engine))
    finally:
        p2p._unexpected, dist.isend = original, isend
    sends = sum(a.kind in (Kind.SEND_ACT, Kind.SEND_GRAD) for a in engine.train_program(4))
    return mismatched[0], posted[0], 2 * sends


scenario(2, "executor_link_specs", _link_worker)


def test_links_carrying_activations_and_gradients_post_receives_that_fit(launched) -> None:
    # Interleaved at d = 2 the two ranks send each other both kinds; ToyChain's activations are
    # (hidden, mask), its gradients (hidden,). Expecting each message to look like the message
    # of its name in the step before, every receive posted ahead fits (by the last message on the
    # link alone, 12 of each rank's messages in steps 2 and 3 would not, and each would go as a
    # padded header and its tensors apart). Once shapes are known every transfer is one message,
    # header and tensors packed.
    out = launched(2)["executor_link_specs"]
    assert all(
        status == "ok" and mismatched == 0 and posted == sends > 0 for status, (mismatched, posted, sends) in out
    ), out


# (schedule, split, virtual stages, microbatches) at d = 4
ORDERED = [
    ("gpipe", False, 1, 4),
    ("gpipe", True, 1, 4),
    ("1f1b", False, 1, 4),
    ("1f1b", True, 1, 4),
    ("1f1b", False, 2, 4),
    ("1f1b", False, 2, 8),
    ("1f1b", True, 2, 8),
    ("2bw", False, 1, 4),
    ("2bw", True, 1, 4),
]
ORDERED_SIZES = [16, 16, 12]  # the last batch's microbatches are smaller: new shapes mid-run


def _ordered_run(rank: int, world: int, groups: PipelineGroups, combo: tuple) -> tuple[dict, dict]:
    """Three Adam steps of ``combo`` (see :data:`ORDERED`): this rank's weights, and the transfers
    each of its groups carried (headers aside)."""
    schedule, split, virtual, m = combo
    torch.manual_seed(0)
    model = ToyChain(depth=6)
    plan = PipelinePlan(1, world, m, schedule, split, partition="uniform", virtual_stages=virtual)
    engine = place(model, plan, rank, groups=groups)
    opt = torch.optim.Adam(model.parameters(), lr=model.lr)
    with record(skip=groups.headers) as streams:
        for step, size in enumerate(ORDERED_SIZES):
            engine.train_step(make_data(size, seed=step), opt)
        engine.drain()
    engine.close()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, streams


def _ordered_worker(rank: int, world: int) -> dict[tuple, tuple[dict, dict]]:
    """Every schedule of :data:`ORDERED` with headers on a side channel (tensors as on NCCL)."""
    groups = PipelineGroups.build(Topology(world, world), rank, side_channel=True)
    return {combo: _ordered_run(rank, world, groups, combo) for combo in ORDERED}


scenario(4, "executor_ordered_channel", _ordered_worker)


def _check_ordered(combo: tuple, per_rank: list[tuple[dict, dict]]) -> None:
    """Weights as one process trains them (2BW: its rule), and transfers that run in NCCL's order."""
    _replays([streams for _, streams in per_rank])
    torch.manual_seed(0)
    want = reference_train(
        ToyChain(depth=6),
        [make_data(n, seed=s) for s, n in enumerate(ORDERED_SIZES)],
        delay=1 if combo[0] == "2bw" else 0,
    )
    assert_close_dicts({k: v for weights, _ in per_rank for k, v in weights.items()}, want, rtol=1e-5)


def _ordered_pair_worker(rank: int, world: int) -> tuple[dict, dict]:
    """Interleaved 1F1B at d = 2, m = 4, side channel on: each rank sends the other both
    activations and gradients, read in another order than they are sent."""
    groups = PipelineGroups.build(Topology(world, world), rank, side_channel=True)
    return _ordered_run(rank, world, groups, ORDERED_PAIR)


ORDERED_PAIR = ("1f1b", True, 2, 4)
scenario(2, "executor_ordered_pair", _ordered_pair_worker)


def test_interleaved_between_two_ranks_keeps_to_nccls_order(launched) -> None:
    _check_ordered(ORDERED_PAIR, launched(2).ok("executor_ordered_pair"))


@pytest.mark.parametrize("combo", ORDERED, ids=lambda c: f"{c[0]}{'+split' if c[1] else ''}-v{c[2]}-m{c[3]}")
def test_every_schedule_keeps_to_nccls_order(launched, combo: tuple) -> None:
    # d = 4, side channel on: each link's direction has a group (a stream) of its own, so a
    # receive posted ahead holds back no send and neighbours that send each other both ways
    # never wait for each other. Replayed in NCCL's order, every transfer runs.
    out = launched(4)["executor_ordered_channel"]
    assert all(status == "ok" for status, _ in out), [v for s, v in out if s != "ok"]
    _check_ordered(combo, [value[combo] for _, value in out])


def test_the_nccl_replay_finds_hangs_and_mismatched_sizes() -> None:
    # Two ranks that each send, then receive, on one group (one stream a rank): each send waits
    # for a receive queued behind the other's send. Batched together they run; so they do on a
    # group for each direction (each stream carries one direction of the link).
    apart = {0: {"g": [[("send", 1, 4)], [("recv", 1, 4)]]}, 1: {"g": [[("send", 0, 4)], [("recv", 0, 4)]]}}
    with pytest.raises(AssertionError, match="would hang"):
        run_in_order(apart)
    assert (
        run_in_order({0: {"g": [[("send", 1, 4), ("recv", 1, 4)]]}, 1: {"g": [[("recv", 0, 4), ("send", 0, 4)]]}}) == 4
    )
    by_direction = {
        0: {"01": [[("send", 1, 4)]], "10": [[("recv", 1, 4)]]},
        1: {"10": [[("send", 0, 4)]], "01": [[("recv", 0, 4)]]},
    }
    assert run_in_order(by_direction) == 4
    # In a ring on one group, a receive posted first holds back the rank's send to the other
    # side, and a send posted first the receive: both hang.
    ring = {r: {"g": [[("recv", (r + 1) % 3, 4)], [("send", (r - 1) % 3, 4)]]} for r in range(3)}
    for streams in (ring, {r: {"g": ring[r]["g"][::-1]} for r in range(3)}):
        with pytest.raises(AssertionError, match="would hang"):
            run_in_order(streams)
    with pytest.raises(AssertionError, match="would hang"):  # a send with no receive
        run_in_order({0: {"g": [[("send", 1, 4)]]}, 1: {}})
    with pytest.raises(AssertionError, match="carries 4 bytes, its counterpart 8"):
        run_in_order({0: {"g": [[("send", 1, 4)]]}, 1: {"g": [[("recv", 0, 8)]]}})
