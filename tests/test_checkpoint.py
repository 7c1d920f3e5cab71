"""Checkpoints keyed by name: resharded resume through Trainer.fit, kill -9, memory, consolidation, clear errors."""

from __future__ import annotations

import ctypes
import re
import runpy
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

from lightning_pipe import PipelineMixin, PipelinePlan, PipelineStrategy, Placement
from lightning_pipe.lightning.checkpoint import IncompleteCheckpointError
from tests.launch import SCRIPTS, launch
from tests.models import ToyChain, assert_close_dicts, make_data, make_optimizer, reference_train
from tests.scripts.resume_toy import GLOBAL_BATCH, SAMPLES, fit_resumable
from tests.scripts.train_toy import Indexed
from tests.shared import launch_root, saved, scenario, scenario_dir

# -- resharded resume ----------------------------------------------------------------------

#: name: (world, depth, schedule, microbatches, partition, steps, resume from (world, name), sharded)
RUNS: dict[str, tuple] = {
    "reshard_save_1x4_1f1b": (4, 4, "1f1b", 4, "uniform", 2, None, True),
    "reshard_resume_2x2_gpipe": (4, 2, "gpipe", 2, "uniform", 4, (4, "reshard_save_1x4_1f1b"), True),
    "reshard_save_1x2_file": (2, 2, "1f1b", 4, [3, 3], 2, None, False),
    "reshard_resume_1x4_partition": (4, 4, "1f1b", 4, [1, 2, 2, 1], 4, (2, "reshard_save_1x2_file"), True),
    "reshard_save_2x2_2bw": (4, 2, "2bw", 4, "uniform", 2, None, True),
    "reshard_resume_2x2_2bw": (4, 2, "2bw", 4, "uniform", 4, (4, "reshard_save_2x2_2bw"), True),
    "uninterrupted_1x2_1f1b": (2, 2, "1f1b", 4, "uniform", 6, None, True),  # the kill tests' reference
}
#: Each resumed run's partition of ToyChain's 6 pipeline blocks (embed, 4 residuals, head), resolved:
#: "uniform" over 2 stages is 3 + 3; a list is kept as given.
RESOLVED = {
    "reshard_resume_2x2_gpipe": (3, 3),
    "reshard_resume_1x4_partition": (1, 2, 2, 1),
    "reshard_resume_2x2_2bw": (3, 3),
}


def _fit_run(rank: int, world: int, name: str) -> dict[str, Any]:
    _, depth, schedule, m, partition, steps, source, sharded = RUNS[name]
    ckpt = None
    if source is not None:
        ckpt = str(saved(*source) / "ckpt" / "epoch=0-step=2.ckpt")
    return fit_resumable(rank, world, depth, schedule, m, partition, steps, scenario_dir(), ckpt, sharded)


for _name, _run in RUNS.items():
    scenario(_run[0], _name, _fit_run, _name, reads=_run[6])


def _epoch_batches(epoch: int = 0) -> list[set[int]]:
    """The global batches of an epoch, from DistributedSampler's shuffle written out: a
    permutation seeded with ``seed + epoch``; step t's global batch is its t-th slice of 16."""
    g = torch.Generator()
    g.manual_seed(0 + epoch)
    order = torch.randperm(SAMPLES, generator=g).tolist()
    return [set(order[t * GLOBAL_BATCH : (t + 1) * GLOBAL_BATCH]) for t in range(SAMPLES // GLOBAL_BATCH)]


def _global_steps(ranks: list[dict], world: int, depth: int) -> list[list[int]]:
    """Sample indices of each step over all replicas (read from each replica's stage 0)."""
    replicas = [ranks[r]["indices"] for r in range(0, world, depth)]
    return [sum((rep[t] for rep in replicas), []) for t in range(len(replicas[0]))]


def _merged_params(ranks: list[dict], depth: int) -> dict[str, torch.Tensor]:
    return {k: v for r in range(depth) for k, v in ranks[r]["params"].items()}


@pytest.mark.parametrize(
    "saved,resumed,delay",
    [
        ("reshard_save_1x4_1f1b", "reshard_resume_2x2_gpipe", 0),
        ("reshard_save_1x2_file", "reshard_resume_1x4_partition", 0),
        ("reshard_save_2x2_2bw", "reshard_resume_2x2_2bw", 1),
    ],
)
def test_resume_under_another_layout_matches_single_process(launched, saved: str, resumed: str, delay: int) -> None:
    first = launched(RUNS[saved][0]).ok(saved)
    second = launched(RUNS[resumed][0]).ok(resumed)
    assert second[0]["global_step"] == 4
    steps = _global_steps(first, RUNS[saved][0], RUNS[saved][1]) + _global_steps(
        second, RUNS[resumed][0], RUNS[resumed][1]
    )
    # The resumed run trains exactly the batches an uninterrupted run would: steps 3 and 4 of the epoch.
    assert [set(s) for s in steps] == _epoch_batches()[:4]
    assert all(len(s) == GLOBAL_BATCH for s in steps)
    data = Indexed(SAMPLES, 0)
    x, y = data.x, data.y
    batches = [(x[torch.tensor(s)], y[torch.tensor(s)]) for s in steps]
    torch.manual_seed(0)
    model = ToyChain()
    opt = make_optimizer(model.parameters(), "adam", model.lr)
    # 2BW: the save drains (all updates applied); the resumed stream restarts from those weights.
    reference_train(model, batches[:2], delay=delay, opt=opt)
    want = reference_train(model, batches[2:], delay=delay, opt=opt)
    got = _merged_params(second, RUNS[resumed][1])
    assert_close_dicts(got, want, rtol=1e-5)
    world, depth = RUNS[resumed][:2]
    for rank in second:  # every rank resumed under the requested layout, its partition resolved
        plan = rank["plan"]
        assert (plan.width, plan.depth, plan.schedule, plan.partition) == (
            world // depth,
            depth,
            RUNS[resumed][2],
            RESOLVED[resumed],
        ), plan


# -- kill -9 -------------------------------------------------------------------------------

#: Hang guard of each kill-test launch, far above a run's need (about 15 s here): no duration is asserted.
KILL_HANG_GUARD = 300


def _kill_launch(folder: Path, world: int, extra: list[str]) -> subprocess.CompletedProcess:
    script = [str(SCRIPTS / "resume_toy.py"), str(folder), "--depth=2", "--steps=6", *extra]
    try:
        return launch(script, timeout=KILL_HANG_GUARD, torchrun=world, check=False)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"run {extra} on {world} ranks: some rank never exited (a hang): {err}")


@pytest.fixture(scope="session")  # its tests run apart (one reads the shared launches: conftest)
def killed_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Three launches of 1F1B over 2 stages, 6 steps, checkpoints every 2 steps:
    A, (2,2) on 4 ranks, has rank 1 killed as step 3 starts (its pipeline and replica peers in
    flight); B, (1,2) on 2 ranks, has rank 1 killed inside its step-4 save (after the step-2
    checkpoint); C resumes B's folder from "last" to the end. A runs beside B and C."""
    with ThreadPoolExecutor(1) as pool:
        a = pool.submit(_kill_launch, tmp_path_factory.mktemp("killed_mid_step"), 4, ["--kill=train:1:2"])
        folder = tmp_path_factory.mktemp("killed_in_save")
        runs: dict[str, Any] = {"B": _kill_launch(folder, 2, ["--kill=save:1:4"])}
        runs["last_after_B"] = torch.load(folder / "ckpt" / "last.ckpt" / "meta.pt", weights_only=False)["global_step"]
        runs["partial_after_B"] = sorted(p.name for p in (folder / "ckpt").iterdir() if p.name.startswith("."))
        runs["step4_after_B"] = (folder / "ckpt" / "epoch=0-step=4.ckpt").exists()
        runs["C"] = _kill_launch(folder, 2, ["--ckpt=last"])
        runs["A"] = a.result()
    runs["C_result"] = (
        [torch.load(folder / f"result_rank{r}.pt", weights_only=False) for r in range(2)]
        if runs["C"].returncode == 0
        else None
    )
    return runs


def _exit_codes(stderr: str) -> dict[int, int]:
    """Each failed rank's exit code, from torchrun's failure report (a signal as its negative)."""
    report = stderr[stderr.rfind("Failures:") :]
    return {
        int(rank): int(code)
        for rank, code in re.findall(r"rank\s*: (\d+) \(local_rank: \d+\)\s*exitcode\s*: (-?\d+)", report)
    }


def _exited_on_kill(proc: Any, killed: int, world: int) -> None:
    """The run failed, every rank with it, and only the rank the script killed died by SIGKILL.

    A rank that hung after the kill would be left to torchrun, whose teardown sends SIGTERM and,
    to a rank still there 30 s later, SIGKILL: so no other rank may show -9."""
    assert proc.returncode != 0, "the killed run must fail"
    codes = _exit_codes(proc.stderr)
    assert sorted(codes) == list(range(world)) and all(code != 0 for code in codes.values()), (
        codes,
        proc.stderr[-3000:],
    )
    assert [rank for rank, code in codes.items() if code == -signal.SIGKILL] == [killed], (codes, proc.stderr[-3000:])


def test_kill_mid_step_ends_every_rank(killed_runs: dict[str, Any]) -> None:
    _exited_on_kill(killed_runs["A"], killed=1, world=4)  # --kill=train:1:2


def test_kill_during_save_keeps_the_previous_checkpoint(killed_runs: dict[str, Any]) -> None:
    _exited_on_kill(killed_runs["B"], killed=1, world=2)  # --kill=save:1:4
    assert killed_runs["last_after_B"] == 2, "the step-4 save never finished, so 'last' is still step 2's"
    assert any(name.startswith(".pipeline-partial-") for name in killed_runs["partial_after_B"])
    assert not killed_runs["step4_after_B"], "the checkpoint whose save was killed must not be visible"


def test_resume_after_a_kill_is_bit_identical(launched, killed_runs: dict[str, Any]) -> None:
    proc = killed_runs["C"]
    assert proc.returncode == 0, proc.stderr[-6000:]
    uninterrupted = launched(2).ok("uninterrupted_1x2_1f1b")
    for resumed, straight in zip(killed_runs["C_result"], uninterrupted, strict=True):
        assert resumed["global_step"] == straight["global_step"] == 6
        assert sorted(resumed["params"]) == sorted(straight["params"])
        for name, value in straight["params"].items():
            assert torch.equal(resumed["params"][name], value), name
    # C trained steps 3..6 (from the step-2 checkpoint, past the partial step-4 save) on the
    # uninterrupted run's samples.
    assert killed_runs["C_result"][0]["indices"] == uninterrupted[0]["indices"][2:]


# -- memory --------------------------------------------------------------------------------

WIDTH_BIG, BLOCKS_BIG = 1024, 8


class BigChain(PipelineMixin, L.LightningModule):
    """Eight 1024 x 1024 linear blocks (4 MiB of weights each): the whole model is 4 stages' worth."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.blocks = nn.ModuleList(nn.Linear(WIDTH_BIG, WIDTH_BIG) for _ in range(BLOCKS_BIG))

    def pipeline_blocks(self) -> list[nn.Module]:
        return list(self.blocks)

    def pipeline_loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        return output.pow(2).mean()

    def training_step(self, batch: Any, batch_idx: int) -> None:
        self.pipeline_step(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-4)


def _rss() -> tuple[int, int]:
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def _peak_increase(fn: Any) -> int:
    """Bytes by which this process's resident peak rose above its size before ``fn`` ran.

    Freed heap memory is first returned to the system: glibc keeps what an earlier save freed
    resident, and ``fn`` reusing it would raise no peak (rank 0's one-file gather then measured
    20-44 MB instead of its 96 MB model)."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    before, _ = _rss()
    fn()
    return _rss()[1] - before


def _memory(rank: int, world: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for sharded in (True, False):
        torch.manual_seed(0)
        model = BigChain()
        trainer = L.Trainer(
            accelerator="cpu",
            devices=world,
            max_steps=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            strategy=PipelineStrategy(pipeline_depth=world, partition="uniform", save_distributed_checkpoint=sharded),
        )
        trainer.fit(model, torch.utils.data.DataLoader(torch.randn(8, WIDTH_BIG), batch_size=8))
        path = scenario_dir() / f"big_{sharded}.ckpt"
        trainer.save_checkpoint(path)  # warm-up: lazy imports and first-touch allocations
        own = sum(
            t.numel() * t.element_size()
            for t in trainer.strategy.placement.export_state(trainer.optimizers[0])["optimizer"].values()
            if isinstance(t, torch.Tensor)
        ) + sum(p.numel() * 4 for p in model.parameters())
        saved = _peak_increase(lambda: trainer.save_checkpoint(path))
        loaded = _peak_increase(lambda: trainer.strategy.load_checkpoint(path))
        results[sharded] = {"own_state": own, "save": saved, "load": loaded}
    return results


scenario(4, "checkpoint_memory", _memory)


def test_saving_and_loading_hold_one_stage_plus_a_bounded_buffer(launched) -> None:
    ranks = launched(4).ok("checkpoint_memory")
    stage = ranks[0][True]["own_state"]
    whole = 4 * stage
    # The buffer: DCP reads each tensor into a temporary before copying it into place (the
    # largest here is 4 MiB), plus file pages and allocator slack; loads measured 8.1-8.5 MB.
    buffer = 16 * 2**20
    for rank, result in enumerate(ranks):
        sharded, single = result[True], result[False]
        assert sharded["own_state"] == stage
        assert sharded["save"] < stage + buffer, (rank, sharded)
        assert sharded["load"] < stage + buffer, (rank, sharded)
        if rank > 0:  # one file: gathered on rank 0 only; the others send their own stage
            assert single["save"] < stage + buffer, (rank, single)
            assert single["load"] < stage + buffer, (rank, single)
    assert ranks[0][False]["save"] > whole / 2  # rank 0 does hold the whole model for one file


# -- consolidation and errors --------------------------------------------------------------


def test_consolidated_checkpoint_predicts_like_the_pipeline(
    launched, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ranks = launched(4).ok("toy_1x4_gpipe_plain")
    folder = launched(4).dir("toy_1x4_gpipe_plain") / "ckpt" / "last.ckpt"
    assert folder.is_dir()
    out = tmp_path / "consolidated.ckpt"
    # ``python -m lightning.pytorch.utilities.consolidate_checkpoint FOLDER --output_file OUT``, run in this process
    monkeypatch.setattr(sys, "argv", ["consolidate_checkpoint", str(folder), "--output_file", str(out)])
    runpy.run_module("lightning.pytorch.utilities.consolidate_checkpoint", run_name="__main__")
    model = ToyChain.load_from_checkpoint(out).eval()
    x, _ = make_data(10, 7)  # as train_toy predicts: a batch of 8, then one of 2
    with torch.no_grad():
        want = model(x)
    for rank in ranks:
        torch.testing.assert_close(torch.cat(rank["predictions"]), want, rtol=1e-6, atol=1e-7)


class Wider(ToyChain):
    """ToyChain whose head predicts one more class: same names, another shape."""

    def __init__(self) -> None:
        super().__init__()
        self.head.out = nn.Linear(self.head.out.in_features, self.head.out.out_features + 1)


def _refused(rank: int, world: int) -> dict[str, dict[str, Any]]:
    saved = launch_root() / "world2" / "reshard_save_1x2_file" / "ckpt" / "epoch=0-step=2.ckpt"
    sharded = launch_root() / "world4" / "reshard_save_1x4_1f1b" / "ckpt" / "epoch=0-step=2.ckpt"
    incomplete = scenario_dir() / "incomplete.ckpt"
    if rank == 0:
        import shutil

        shutil.copytree(sharded, incomplete, dirs_exist_ok=True)
        (incomplete / "meta.pt").unlink()
    torch.distributed.barrier()
    messages, raised = {}, {}
    for case, model, path in (
        ("fewer", ToyChain(depth=2), saved),
        ("shape", Wider(), saved),
        ("incomplete", ToyChain(), incomplete),
        ("more", ToyChain(depth=6), sharded),
    ):
        trainer = L.Trainer(
            accelerator="cpu",
            devices=world,
            max_steps=4,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            strategy=PipelineStrategy(pipeline_depth=world, partition="uniform"),
        )
        try:
            trainer.fit(model, torch.utils.data.DataLoader(Indexed(32, 0), batch_size=8), ckpt_path=str(path))
            messages[case] = "loaded"
        except Exception as err:  # noqa: BLE001 - the test reads the message
            messages[case] = f"{type(err).__name__}: {err}"
            # What ``except IncompleteCheckpointError`` and ``except RuntimeError`` would each catch.
            raised[case] = (isinstance(err, IncompleteCheckpointError), isinstance(err, RuntimeError))
    return {"messages": messages, "raised": raised}


scenario(4, "checkpoint_refused", _refused)


def test_wrong_or_incomplete_checkpoints_are_refused_naming_the_weights(launched) -> None:
    for rank in launched(4).ok("checkpoint_refused"):
        messages = rank["messages"]
        assert "holds 8 weights this model does not have, first: ['blocks.2.fc.bias'" in messages["fewer"], messages[
            "fewer"
        ]
        assert "another shape, first: ['head.out.weight: (5, 16) here (6, 16)'" in messages["shape"], messages["shape"]
        assert "IncompleteCheckpointError" in messages["incomplete"] and "no meta.pt" in messages["incomplete"]
        assert "lacks" in messages["more"] and "blocks.4." in messages["more"], messages["more"]
        # Only the incomplete checkpoint's refusal is the package's IncompleteCheckpointError (so
        # ``except IncompleteCheckpointError`` catches it and not the others), and an ``except
        # RuntimeError`` written before that class existed still catches it.
        assert rank["raised"]["incomplete"] == (True, True), rank["raised"]
        assert not any(rank["raised"][case][0] for case in ("fewer", "shape", "more")), rank["raised"]


def test_plan_validates_once_and_the_strategy_takes_it() -> None:
    plan = PipelinePlan(width=2, depth=2, microbatches=4, schedule="2bw", recompute=[True, False], partition=[2, 4])
    assert plan.recompute == (True, False) and plan.partition == (2, 4) and plan.world_size == 4
    assert plan.resolve([1.0] * 6) == plan
    assert PipelinePlan(depth=2, partition="uniform").resolve([1.0] * 5).partition == (3, 2)
    for bad, message in (
        (dict(depth=4, schedule="2bw", microbatches=2), "needs microbatches >= pipeline_depth"),
        (dict(depth=2, recompute=[True]), "one flag per stage"),
        (dict(depth=2, partition=[3]), "must list 2 positive block counts"),
        (dict(split_max_pending=2), "only applies with split_backward"),
        (dict(schedule="zb"), "unknown pipeline schedule"),
    ):
        with pytest.raises(ValueError, match=message):
            PipelinePlan(**bad)
    with pytest.raises(ValueError, match="either as plan= or as arguments"):
        PipelineStrategy(plan=plan, microbatches=8)
    assert PipelineStrategy(plan=plan)._requested_plan is plan


def test_placement_is_reversible_and_moves_state_by_name() -> None:
    torch.manual_seed(0)
    reference = ToyChain()
    reference.blocks[3].register_buffer("scale", torch.arange(3.0))  # buffers move by name too
    want = {k: v.clone() for k, v in reference.state_dict().items()}
    x, _ = make_data(4)
    with torch.no_grad():
        expected = reference(x)
    model = ToyChain()
    model.blocks[3].register_buffer("scale", torch.zeros(3))
    model.load_state_dict(want)
    placement = Placement(model)
    placement.apply(PipelinePlan(depth=2, partition=[4, 2]), rank=1)  # stage 1: blocks 4-5
    assert sorted(placement.export_state()["model"]) == sorted(k for k in want if k.startswith(("blocks.3", "head")))
    assert "blocks.3.scale" in placement.export_state()["model"]
    assert all(p.is_meta for b in placement.blocks[:4] for p in b.parameters()), "other stages' weights are dropped"
    with pytest.raises(RuntimeError, match="already placed"):
        placement.apply(PipelinePlan(), rank=0)
    placement.undo()
    assert [m for _, m in model.named_children()][0] is placement.blocks[0]  # the original blocks are back
    (stage,) = placement.apply(PipelinePlan(), rank=0)  # one stage: this rank now owns blocks it had dropped
    assert placement.unfilled == {0, 1, 2, 3}
    opt = make_optimizer(model.parameters(), "adam", 1e-2)
    with pytest.raises(KeyError, match="lacks 2 weights of this stage, first: \\['embed.proj.weight'"):
        placement.import_state({"model": {k: v for k, v in want.items() if not k.startswith("embed")}})
    model.blocks[3].scale.zero_()
    placement.import_state({"model": want}, opt)
    assert not placement.unfilled
    assert torch.equal(model.blocks[3].scale, torch.arange(3.0))
    with torch.no_grad():
        torch.testing.assert_close(stage((x,))[0], expected, rtol=0, atol=0)
