"""Misuse raises clear errors before any process can hang; a failing rank takes every rank down."""

from __future__ import annotations

import os
import re
import time
from typing import Any, Optional
from unittest import mock

import pytest
import torch
from torch import nn

from lightning_pipe import PipelineGroups, PipelinePlan, PipelineStrategy, Topology, place
from tests.distributed import free_port, run_workers
from tests.models import ToyChain, make_data
from tests.models import frozen as _frozen
from tests.shared import scenario


def test_unknown_schedule() -> None:
    with pytest.raises(ValueError, match="unknown pipeline schedule 'pipedream-9'"):
        PipelineStrategy(schedule="pipedream-9")


def test_unknown_loss_mode() -> None:
    with pytest.raises(ValueError, match="loss must be one of"):
        PipelineStrategy(loss="last")


def test_more_stages_than_blocks() -> None:
    with pytest.raises(ValueError, match="cannot split 6 pipeline blocks over pipeline_depth=8"):
        place(ToyChain(depth=4), PipelinePlan(depth=8), rank=0)


def test_module_without_pipeline_blocks() -> None:
    with pytest.raises(TypeError, match="has no pipeline_blocks"):
        place(nn.Linear(2, 2), PipelinePlan(), rank=0)


def test_batch_smaller_than_microbatches() -> None:
    engine = place(ToyChain(), PipelinePlan(microbatches=4), rank=0)
    with pytest.raises(ValueError, match="batch of 3 samples cannot be split into microbatches=4"):
        engine.train_step(make_data(3), _frozen(engine))


def test_uneven_batch_is_split_and_weighted() -> None:
    # 7 samples over 3 microbatches: sizes 3, 2, 2, each loss weighted by its share.
    torch.manual_seed(0)
    model = ToyChain()
    engine = place(model, PipelinePlan(microbatches=3), rank=0)
    batch = make_data(7)
    loss = engine.train_step(batch, _frozen(engine))
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    torch.manual_seed(0)
    ref = ToyChain()
    want_loss = ref.pipeline_loss(ref(batch[0]), batch)
    want_loss.backward()
    assert float(loss) == pytest.approx(float(want_loss.detach()), rel=1e-6)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-5, atol=1e-7)


class _Dict(nn.Module):
    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> dict:
        return {"h": h}


def test_interleaved_layout_misuse() -> None:
    with pytest.raises(ValueError, match="virtual_stages=2 runs interleaved 1F1B: use schedule='1f1b'"):
        PipelineStrategy(schedule="gpipe", pipeline_depth=2, virtual_stages=2)
    with pytest.raises(ValueError, match=r"microbatches \(6\) must be a multiple of it"):
        PipelineStrategy(pipeline_depth=4, microbatches=6, virtual_stages=2)
    with pytest.raises(ValueError, match=r"partition \[2, 2\] must list 4 positive block counts"):
        PipelineStrategy(pipeline_depth=2, microbatches=2, virtual_stages=2, partition=[2, 2])
    with pytest.raises(ValueError, match="cannot split 6 pipeline blocks over"):
        place(ToyChain(), PipelinePlan(1, 4, 4, virtual_stages=2), rank=0)


def test_split_placement_misuse() -> None:
    with pytest.raises(ValueError, match="split_placement only applies with split_backward=True"):
        PipelineStrategy(pipeline_depth=2, split_placement="drain")
    with pytest.raises(ValueError, match="unknown split_placement 'later'"):
        PipelineStrategy(pipeline_depth=2, split_backward=True, split_placement="later")
    for placement in ("drain", "zb-h1"):
        with pytest.raises(ValueError, match="does not apply to schedule '2bw'"):
            PipelinePlan(1, 2, 4, "2bw", True, split_placement=placement)
    with pytest.raises(ValueError, match="split_max_pending does not apply to schedule '2bw'"):  # it was ignored
        PipelinePlan(1, 2, 4, "2bw", True, 1)
    for schedule, virtual in (("gpipe", 1), ("1f1b", 2)):
        with pytest.raises(ValueError, match="split_placement='drain' is for 1F1B with one stage per rank"):
            PipelinePlan(1, 2, 4, schedule, True, split_placement="drain", virtual_stages=virtual)
    with pytest.raises(ValueError, match="split_max_pending does not apply with split_placement='drain'"):
        PipelinePlan(1, 2, 4, "1f1b", True, 1, split_placement="drain")
    assert "split backward (drain)" in PipelinePlan(1, 2, 4, "1f1b", True, split_placement="drain").describe()
    for schedule, own in (
        ("1f1b", "zb-h1"),
        ("gpipe", "bounded"),
        ("2bw", "carry"),
    ):  # the schedule's own is the default
        assert PipelinePlan(1, 2, 4, schedule, True, split_placement=own) == PipelinePlan(1, 2, 4, schedule, True)


def test_block_returning_non_tensor() -> None:
    model = ToyChain()
    model.blocks[1] = _Dict()
    engine = place(model, PipelinePlan(microbatches=2), rank=0)
    with pytest.raises(TypeError, match=r"pipeline block 2 \(_Dict\) returned dict"):
        engine.train_step(make_data(4), _frozen(engine))


def test_autoplanner_without_pipeline_strategy_is_refused() -> None:
    import lightning as L

    from lightning_pipe import AutoPlanner

    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[AutoPlanner()],
    )
    x, y = make_data(16)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    with pytest.raises(TypeError, match=r"AutoPlanner needs Trainer\(strategy=PipelineStrategy\(...\)\), got \w+"):
        trainer.fit(ToyChain(), loader)


def test_autoplanner_refuses_a_fit_shorter_than_its_profiling() -> None:
    # max_steps is checked at setup (tests/test_reconfigure.py, a shared launch); an epoch-bounded fit at train start.
    from types import SimpleNamespace

    from lightning_pipe import AutoPlanner

    short = SimpleNamespace(estimated_stepping_batches=4, global_step=0)
    with pytest.raises(ValueError, match=r"AutoPlanner\(profile_steps=5\) profiles .* but the fit has only 4"):
        AutoPlanner(profile_steps=5).on_train_start(short, None)  # type: ignore[arg-type]
    endless = SimpleNamespace(estimated_stepping_batches=float("inf"), global_step=0)
    AutoPlanner(profile_steps=5).on_train_start(endless, None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "case,error,message",
    [
        ("auto_opt", ValueError, "needs manual optimization"),
        ("no_blocks", TypeError, "has no pipeline_blocks"),
    ],
)
def test_trainer_refuses_misuse_in_one_process(case: str, error: type, message: str) -> None:
    from tests.scripts.misuse_cases import fit_case

    # Lightning writes MASTER_ADDR/MASTER_PORT into the environment: later launches must not inherit them.
    with mock.patch.dict(os.environ, MASTER_PORT=str(free_port())):
        try:
            with pytest.raises(error, match=message):
                fit_case(case)
        finally:
            if torch.distributed.is_initialized():  # the strategy's one-process group, left as Lightning leaves it
                torch.distributed.destroy_process_group()


def _fit_indivisible(rank: int, world: int) -> str:
    """Fit ToyChain on ``world`` processes with a pipeline depth that does not divide it; the error."""
    from datetime import timedelta

    import lightning as L

    from lightning_pipe import PipelineStrategy
    from tests.models import ToyChain, make_data

    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=PipelineStrategy(pipeline_depth=3, microbatches=4, timeout=timedelta(seconds=30)),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    try:
        trainer.fit(ToyChain(), make_data(16))
    except ValueError as err:
        return str(err)
    return "no error"


scenario(4, "indivisible_world", _fit_indivisible)


def test_trainer_refuses_a_world_the_depth_does_not_divide(launched) -> None:
    for message in launched(4).ok("indivisible_world"):
        assert "world size 4 is not divisible by pipeline_depth=3" in message, message


class _FailingBlock(nn.Module):
    def __init__(self, at_call: int) -> None:
        super().__init__()
        self.at_call, self.calls = at_call, 0

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls += 1
        if self.calls == self.at_call:
            raise RuntimeError("boom on stage 2")
        return h, mask


#: Hang guard of the multi-process failure tests, far above what they need even on a loaded machine
#: (a few seconds here): a run still going then fails the test as a hang. No test asserts a duration.
HANG_GUARD = 300


def _fail_mid_step(rank: int, world: int, depth: int, virtual: int) -> None:
    from lightning_pipe.runtime.comm import abort

    deliver = abort._deliver

    def deliver_without_deadline(posted: Any, incoming: Any, deadline: float) -> None:
        # An abort must settle on events only (each notice delivered, or the neighbour's own
        # notice received), never on abort_timeout running out: with no deadline within the
        # hang guard, a rank that waited for it would keep the run going until the guard fails it.
        # The deadline is a time.monotonic() reading, not a duration: a duration there is a
        # deadline already past on a host up longer than it, and every wait then lasts 10 ms.
        deliver(posted, incoming, time.monotonic() + 100 * HANG_GUARD)

    abort._deliver = deliver_without_deadline  # this worker process's own copy of the module
    topo = Topology(world, depth)
    groups = PipelineGroups.build(topo, rank)
    model = ToyChain(depth=3 if virtual == 1 else 5)
    model.blocks.insert(2, _FailingBlock(at_call=7 if topo.replica_of(rank) == 0 else 0))
    partition = [2, 1, 2, 1] if (depth, virtual) == (4, 1) else "uniform"
    plan = PipelinePlan(topo.width, depth, 4, "1f1b", partition=partition, virtual_stages=virtual)
    engine = place(model, plan, rank, groups=groups)
    for step in range(3):  # fails in step 2, microbatch 2
        engine.train_step(make_data(8, seed=step), _frozen(engine))


@pytest.mark.parametrize("width,depth,virtual,failing", [(1, 4, 2, 3), (2, 2, 1, 1)])
def test_rank_failing_mid_step_stops_every_rank(width: int, depth: int, virtual: int, failing: int) -> None:
    # The failing block is the chain's fourth (embed, two blocks, it): on (1, 4) interleaved, 8
    # stages of one block, stage 3 on rank 3, whose notice also crosses back to rank 0; on (2, 2),
    # uniform 3 + 3 blocks, stage 1 on rank 1. Only replica 0's copy fails.
    try:
        out = run_workers(_fail_mid_step, width * depth, depth, virtual, timeout=HANG_GUARD, pg_timeout=20)
    except TimeoutError as err:
        pytest.fail(f"the ranks did not all stop after one failed (an abort waiting on a deadline, or a hang): {err}")
    assert all(status == "error" for status, _ in out), out
    firsts = [msg.splitlines()[0] for _, msg in out]
    # The failing rank ends with its own error; its pipeline's other ranks with the abort notice
    # naming it, not with a timeout of their own nor with gloo's closed link ("Connection closed
    # by peer": the failing rank exited before its notice was read).
    assert firsts[failing] == "RuntimeError: boom on stage 2", firsts
    for rank in set(range(depth)) - {failing}:
        assert (
            firsts[rank].startswith("PipelineAbortedError: ")
            and f"(rank {failing}) failed: RuntimeError: boom on stage 2" in firsts[rank]
        ), firsts
    # The other replica's ranks fail in the gradient all-reduce, its peers gone: not by waiting it out.
    raised = [line for _, msg in out for line in re.findall(r"^[\w.]+(?:Error|Exception): .*$", msg, re.MULTILINE)]
    assert not [line for line in raised if re.search("timed out|timeout", line, re.IGNORECASE)], raised


def _fail_in_a_send(rank: int, world: int) -> None:
    """Interleaved at d = 2 (activations and gradients on one link both ways): rank 1's third
    gradient send of step 2 fails before it is posted, with an activation send next in its program."""
    from lightning_pipe.runtime.executor import Executor
    from lightning_pipe.schedules.actions import Kind

    groups = PipelineGroups.build(Topology(world, world), rank)
    model = ToyChain(6)
    engine = place(model, PipelinePlan(1, 2, 4, "1f1b", partition="uniform", virtual_stages=2), rank, groups=groups)
    original, calls = Executor._send_grad, [0]

    def failing(self: Any, a: Any, st: Any) -> None:
        calls[0] += 1
        later = self._actions[self._at + 1 :]
        if (
            rank == 1
            and calls[0] > 8
            and later
            and next(x for x in later if x.kind in (Kind.SEND_ACT, Kind.SEND_GRAD)).kind is Kind.SEND_ACT
        ):
            raise RuntimeError("send failed before posting")
        original(self, a, st)

    Executor._send_grad = failing
    try:
        for step in range(2):
            engine.train_step(make_data(8, seed=step), _frozen(engine))
    finally:
        Executor._send_grad = original


def test_a_send_that_fails_before_posting_aborts_its_peer_with_a_notice_that_fits() -> None:
    # The notice takes the place of the failed message: sized for the activations that come
    # next instead (the old scan began after the failed action), it is larger than the gradient
    # receive the peer posted, and gloo kills the peer (SIGABRT) instead of raising there.
    try:
        out = run_workers(_fail_in_a_send, 2, timeout=HANG_GUARD, pg_timeout=20)
    except TimeoutError as err:
        pytest.fail(f"a rank did not stop after the failed send (a hang): {err}")
    assert [status for status, _ in out] == ["error", "error"], out
    assert all("send failed before posting" in msg for _, msg in out), out


def test_autoplanner_arguments_are_checked_when_it_is_made() -> None:
    from lightning_pipe import AutoPlanner

    for kwargs, message in (
        ({"profile_steps": 1}, "profile_steps must be >= 2"),
        ({"min_gain": -0.1}, "min_gain must be >= 0"),
        ({"headroom": 1.0}, r"headroom must be in \[0, 1\)"),
        ({"virtual_stages": ()}, "virtual_stages must list stage counts >= 1"),
        ({"virtual_stages": (0, 1)}, "virtual_stages must list stage counts >= 1"),
        ({"revert_factor": 0.5}, "revert_factor must be >= 1 or None"),
    ):
        with pytest.raises(ValueError, match=message):
            AutoPlanner(**kwargs)


@pytest.mark.parametrize(("after", "factor", "reverted"), [(0.25, 2.0, True), (0.15, 2.0, False), (0.25, None, False)])
def test_autoplanner_goes_back_when_the_new_plan_measures_revert_factor_times_slower(
    monkeypatch: pytest.MonkeyPatch, after: float, factor: Optional[float], reverted: bool
) -> None:
    from types import SimpleNamespace

    from lightning_pipe import AutoPlanner
    from lightning_pipe.lightning import autoplan

    # Two ranks: this one's three timed steps after the switch, the other's, slower (the slowest counts).
    monkeypatch.setattr(autoplan.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(
        autoplan.dist, "all_gather_object", lambda out, mine: out.__setitem__(slice(None), [mine, after])
    )
    moved: list[Any] = []
    strategy = SimpleNamespace(reconfigure=moved.append, loss="current")
    trainer = SimpleNamespace(strategy=strategy, global_step=9, is_global_zero=False, loggers=[])
    before, switched = PipelinePlan(1, 2, 1, "gpipe"), PipelinePlan(2, 1, 1, "gpipe")
    old, new = SimpleNamespace(plan=before, step_time=0.1), SimpleNamespace(plan=switched, step_time=0.1)
    auto = AutoPlanner(revert_factor=factor)
    auto.decisions = [
        {"current": old, "chosen": new, "current_measured_step_s": 0.1, "calibrated_step_s": None, "reverted": False}
    ]
    auto._after = []
    for seconds in (1.0, 0.1, 0.1, 0.1):  # a warm-up, then three steps
        auto._record_after(trainer, seconds)  # type: ignore[arg-type]
    assert auto.decisions[0]["measured_step_s"] == after
    assert auto.decisions[0]["reverted"] is reverted
    assert moved == ([before] if reverted else [])


def test_autoplanner_runs_two_bw_with_the_previous_loss_and_gives_the_users_mode_back() -> None:
    # The planner prices 2BW as its never-flushed stream: a move into 2BW sets loss="previous"
    # before the new engine is placed; a move (or a revert) out of it restores the configured mode.
    from types import SimpleNamespace

    from lightning_pipe import AutoPlanner

    placed: list[tuple[str, str]] = []
    strategy = SimpleNamespace(loss="current")
    strategy.reconfigure = lambda plan: placed.append((plan.schedule, strategy.loss))
    auto = AutoPlanner(allow_stale=True)
    flushed, stale = PipelinePlan(1, 2, 2, "1f1b"), PipelinePlan(1, 2, 2, "2bw")
    for plan in (stale, flushed, stale):
        auto._set_loss_mode(strategy, plan)
        strategy.reconfigure(plan)
    assert placed == [("2bw", "previous"), ("1f1b", "current"), ("2bw", "previous")]
    mine = SimpleNamespace(loss="previous")  # a user who asked for it keeps it on any plan
    auto = AutoPlanner(allow_stale=True)
    auto._set_loss_mode(mine, flushed)
    assert mine.loss == "previous"
