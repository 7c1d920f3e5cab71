"""Trainer.fit through torchrun and Lightning's launcher: parity, sampler, logging, validation,
predict, LR schedulers, checkpoints and bf16, all against a single-process reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.launch import SCRIPTS, launch
from tests.models import ToyChain, assert_close_dicts, make_data, reference_grads, reference_train

BATCH, STEPS, M = 8, 5, 4
SCRIPT = str(SCRIPTS / "train_toy.py")


def _load(out: Path, tag: str, world: int) -> list[dict]:
    return [torch.load(out / f"{tag}_rank{r}.pt", weights_only=False) for r in range(world)]


def _global_batches(ranks: list[dict], width: int, depth: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # Lightning's DistributedSampler shuffles training data: step t's global batch is the union
    # of the samples every replica recorded at step t.
    x, y = make_data(BATCH * width * STEPS, 0)
    idx = [torch.tensor(sum((ranks[rep * depth]["indices"][t] for rep in range(width)), [])) for t in range(STEPS)]
    return [(x[i], y[i]) for i in idx]


def _merged(ranks: list[dict], key: str, depth: int) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for r in range(depth):
        merged.update(ranks[r][key])
    return merged


def _check_run(ranks: list[dict], width: int, depth: int, step_lr: bool = False, delay: int = 0) -> dict[str, torch.Tensor]:
    batches = _global_batches(ranks, width, depth)
    if delay == 0:  # under 2BW the first batch's gradient is still being accumulated after step 1
        torch.manual_seed(0)
        assert_close_dicts(_merged(ranks, "grads", depth), reference_grads(ToyChain(), batches[0]), rtol=1e-5)
    torch.manual_seed(0)
    model, losses = ToyChain(), []
    want = reference_train(model, batches, losses, step_lr=step_lr, delay=delay)
    assert_close_dicts(_merged(ranks, "params", depth), want, rtol=1e-5)
    for r, rank in enumerate(ranks):  # every replica of a stage holds the same weights
        assert_close_dicts(rank["params"], {k: want[k] for k in rank["params"]}, rtol=1e-5)
        assert rank["global_step"] == STEPS
    # Sampler: all stages of one pipeline read the same samples; replicas read disjoint shards.
    for replica in range(width):
        seen = [ranks[replica * depth + s]["indices"] for s in range(depth)]
        assert all(s == seen[0] for s in seen)
    shards = [{i for batch in ranks[rep * depth]["indices"] for i in batch} for rep in range(width)]
    assert sum(len(s) for s in shards) == len(set().union(*shards)) == BATCH * width * STEPS
    # Validation: the logged val_loss is the mean loss of the final model over the val set.
    with torch.no_grad():
        xv, yv = make_data(BATCH * width * 2, 99)
        val = float(F.cross_entropy(model(xv), yv))
        for rank in ranks:
            assert rank["val_loss"] == pytest.approx(val, rel=1e-5)
        # Test: the same forward-only path, on its own data.
        xt, yt = make_data(8 * width * 2, 5)
        for rank in ranks:
            assert rank["test_loss"] == pytest.approx(float(F.cross_entropy(model(xt), yt)), rel=1e-5)
        # Predict: each rank returns its replica's shard of outputs, computed through the pipeline.
        xp, _ = make_data(8 * width, 7)
        for r, rank in enumerate(ranks):
            replica = r // depth
            got = torch.cat(rank["predictions"])
            torch.testing.assert_close(got, model(xp[replica::width]), rtol=1e-5, atol=1e-6)
    if width == 1:
        for rank in ranks:
            assert rank["losses"] == pytest.approx(losses, rel=1e-5)
    return want


@pytest.mark.parametrize("width,depth", [(1, 2), (1, 4), (2, 2)])
def test_fit_through_torchrun_matches_single_process(tmp_path: Path, width: int, depth: int) -> None:
    world = width * depth
    launch([SCRIPT, f"--devices={world}", f"--depth={depth}", f"--out={tmp_path}"], timeout=400, torchrun=world)
    for schedule in ("gpipe", "1f1b"):
        for recompute in (False, True):
            tag = f"{schedule}_{recompute}"
            want = _check_run(_load(tmp_path, tag, world), width, depth)
            # ModelCheckpoint wrote one consolidated file that the plain module loads in one process.
            restored = ToyChain.load_from_checkpoint(tmp_path / f"ckpt_{tag}" / "last.ckpt")
            assert_close_dicts(dict(restored.named_parameters()), want, rtol=1e-5)


def test_fit_through_lightning_launcher_with_scheduler_logs_loss(tmp_path: Path) -> None:
    launch([SCRIPT, "--devices=2", "--depth=2", "--scheduler", "--schedules=1f1b", "--recompute=false", f"--out={tmp_path}"], timeout=300)
    ranks = _load(tmp_path, "1f1b_False", 2)
    _check_run(ranks, 1, 2, step_lr=True)
    assert ranks[0]["lrs"] == pytest.approx([1e-2 * 0.5 ** (k // 2) for k in range(1, STEPS + 1)])
    # The loss reached rank 0's progress bar and TensorBoard, at every step.
    assert ranks[0]["progress_bar"]["train_loss"] == pytest.approx(ranks[0]["losses"][-1])
    accumulators = [EventAccumulator(str(f)) for f in (tmp_path / "tb").rglob("events.out.tfevents.*")]
    for acc in accumulators:
        acc.Reload()
    training = [acc for acc in accumulators if "train_loss" in acc.Tags()["scalars"]]
    assert len(training) == 1, "only rank 0 writes TensorBoard logs"  # trainer.test adds its own file
    logged = [e.value for e in training[0].Scalars("train_loss")]
    assert logged == pytest.approx(ranks[0]["losses"], rel=1e-6)


@pytest.mark.parametrize("width,depth", [(1, 2), (2, 2)])
def test_fit_two_bw_follows_delayed_rule(tmp_path: Path, width: int, depth: int) -> None:
    world = width * depth
    launch([SCRIPT, f"--devices={world}", f"--depth={depth}", "--schedules=2bw", "--scheduler", f"--out={tmp_path}"], timeout=400, torchrun=world)
    for recompute in (False, True):
        ranks = _load(tmp_path, f"2bw_{recompute}", world)
        # Parameters after fit (drained at the end), validation, predict, loss per step and
        # global_step all follow W(t+1) = W(t) - lr * grad f(W(t-1)).
        want = _check_run(ranks, width, depth, step_lr=True, delay=1)
        # StepLR is stepped with each applied update: after step t, t updates were applied.
        assert ranks[0]["lrs"] == pytest.approx([1e-2 * 0.5 ** (t // 2) for t in range(STEPS)])
        restored = ToyChain.load_from_checkpoint(tmp_path / f"ckpt_2bw_{recompute}" / "last.ckpt")
        assert_close_dicts(dict(restored.named_parameters()), want, rtol=1e-5)


@pytest.mark.parametrize("width,depth", [(1, 2), (1, 4), (2, 2)])
def test_fit_with_split_backward_matches_without(tmp_path: Path, width: int, depth: int) -> None:
    world = width * depth
    launch([SCRIPT, f"--devices={world}", f"--depth={depth}", "--schedules=gpipe,1f1b,2bw", "--recompute=false",
            "--split=false,true", f"--out={tmp_path}"], timeout=400, torchrun=world)  # fmt: skip
    for schedule in ("gpipe", "1f1b", "2bw"):
        plain = _load(tmp_path, f"{schedule}_False", world)
        split = _load(tmp_path, f"{schedule}_False_split", world)
        _check_run(split, width, depth, delay=int(schedule == "2bw"))
        for p, s in zip(plain, split):
            for name, value in p["params"].items():  # same sums in another order: 1e-6, 1e-8 near 0
                torch.testing.assert_close(s["params"][name], value, rtol=1e-6, atol=1e-8)
            if schedule != "2bw":
                for name, value in p["grads"].items():
                    torch.testing.assert_close(s["grads"][name], value, rtol=1e-6, atol=1e-8)


def test_bf16_mixed_on_cpu(tmp_path: Path) -> None:
    launch([SCRIPT, "--devices=2", "--depth=2", "--precision=bf16-mixed", "--schedules=gpipe,2bw", "--recompute=true", f"--out={tmp_path}"], timeout=300, torchrun=2)
    ranks = _load(tmp_path, "gpipe_True", 2)
    batch = _global_batches(ranks, 1, 2)[0]
    torch.manual_seed(0)
    model = ToyChain()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = reference_grads(model, batch)
    # bf16 keeps 8 mantissa bits (~3 significant digits) and microbatches round differently
    # from the whole batch, so compare at bf16 resolution rather than float32's 1e-5.
    assert_close_dicts(_merged(ranks, "grads", 2), want, rtol=3e-2, atol=2e-3)
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in ranks)
    assert ranks[0]["losses"][-1] < ranks[0]["losses"][0]
    # 2BW under bf16-mixed: the first step's loss (on W(0)) matches float32 at bf16 resolution,
    # and training makes progress without non-finite values.
    two_bw = _load(tmp_path, "2bw_True", 2)
    x, y = _global_batches(two_bw, 1, 2)[0]
    torch.manual_seed(0)
    with torch.no_grad():
        first = float(F.cross_entropy(ToyChain()(x), y))
    assert two_bw[0]["losses"][0] == pytest.approx(first, rel=2e-2)
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in two_bw)
    assert two_bw[0]["losses"][-1] < two_bw[0]["losses"][0]


@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
def test_resume_from_checkpoint_matches_uninterrupted_run(tmp_path: Path, schedule: str) -> None:
    # Each stage gets its own optimizer state back from the consolidated checkpoint.
    script = str(SCRIPTS / "resume_toy.py")
    launch([script, str(tmp_path), schedule], timeout=300, torchrun=2)
    first_epoch = tmp_path / "ckpt" / "epoch=0-step=3.ckpt"
    launch([script, str(tmp_path / "again"), schedule, str(first_epoch)], timeout=300, torchrun=2)
    for rank in range(2):
        straight = torch.load(tmp_path / f"straight_rank{rank}.pt", weights_only=False)
        resumed = torch.load(tmp_path / "again" / f"resumed_rank{rank}.pt", weights_only=False)
        assert straight["step"] == resumed["step"] == 6
        assert_close_dicts(resumed["params"], straight["params"], rtol=1e-6)
