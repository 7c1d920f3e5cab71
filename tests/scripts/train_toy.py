"""Train ToyChain through Trainer.fit on every rank and record what each rank saw (for the tests).

``fit_toy`` runs inside the shared launches (tests/shared.py); the script form runs under plain
python (Lightning's own launcher); see tests/test_trainer.py.
"""

from __future__ import annotations

import argparse
import atexit
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_pipe import PipelineStrategy  # noqa: E402
from tests.models import ToyChain, make_data  # noqa: E402
from tests.shared import scenario_dir  # noqa: E402


class Indexed(Dataset):
    """(x, y, index) triples so the test can see which samples each rank read."""

    def __init__(self, n: int, seed: int) -> None:
        self.x, self.y = make_data(n, seed)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


class Recorder(L.Callback):
    """Keeps the first step's gradients, the indices of every batch and the learning rates."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}
        self.indices: list[list[int]] = []
        self.lrs: list[float] = []
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self.indices:  # the first step's (under interleaved 2BW rank 0 has none yet: all in flight)
            self.grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
        self.indices.append(batch[2].tolist())
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


class WithScheduler(ToyChain):
    """ToyChain with a step LR scheduler, to check the mixin steps it."""

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=self.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


#: fit_toy's keyword arguments after ``depth``, in order, with their defaults.
FIT_DEFAULTS: dict[str, Any] = dict(
    schedule="1f1b", recompute=False, split=False, scheduler=False, precision="32-true", out=None, sharded=True
)


def fit_toy(
    rank: int,
    world: int,
    depth: int,
    schedule: str,
    recompute: bool = False,
    split: bool = False,
    scheduler: bool = False,
    precision: str = "32-true",
    out: Optional[Path] = None,
    sharded: bool = True,
    microbatches: int = 4,
    batch: int = 8,
    steps: int = 5,
    virtual: int = 1,
    blocks: int = 4,
    placement: Optional[str] = None,
    stage_placement: Optional[str] = None,
) -> dict[str, Any]:
    """Fit, validate, predict and test ToyChain (``blocks`` residual blocks) through the Trainer,
    ``virtual`` stages per rank placed by ``stage_placement`` ("loop" or "v"; ``None``: the
    schedule's own), W's placed by ``placement`` under split; return what this rank saw.

    The checkpoint (``last.ckpt``: a DCP directory if ``sharded``, else one file) goes to ``out/ckpt``.
    """
    out = out or scenario_dir()
    torch.manual_seed(0)
    model = (WithScheduler if scheduler else ToyChain)(depth=blocks)
    recorder = Recorder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=PipelineStrategy(
            schedule=schedule,
            pipeline_depth=depth,
            microbatches=microbatches,
            partition="uniform",
            recompute=recompute,
            split_backward=split,
            virtual_stages=virtual,
            split_placement=placement,
            placement=stage_placement,
            save_distributed_checkpoint=sharded,
            timeout=timedelta(seconds=60),
        ),
        precision=precision,
        max_steps=steps,
        max_epochs=-1,
        limit_val_batches=2,
        val_check_interval=steps,
        num_sanity_val_steps=0,
        callbacks=[recorder, L.pytorch.callbacks.ModelCheckpoint(dirpath=out / "ckpt", save_last=True)],
        log_every_n_steps=1,
        logger=L.pytorch.loggers.TensorBoardLogger(out / "tb", name="run"),
        enable_model_summary=False,
        enable_progress_bar=False,
        use_distributed_sampler=True,
    )
    width = world // depth
    train = DataLoader(Indexed(batch * width * steps, 0), batch_size=batch)
    val = DataLoader(Indexed(batch * width * 2, 99), batch_size=batch)
    trainer.fit(model, train, val)
    fit_metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    progress_bar = {k: float(v) for k, v in trainer.progress_bar_metrics.items()}
    # each replica predicts 10 samples: a batch of 8, then one of 2, fewer than the microbatches
    predictions = trainer.predict(model, DataLoader(Indexed(10 * width, 7), batch_size=8))
    tested = trainer.test(model, DataLoader(Indexed(8 * width * 2, 5), batch_size=8), verbose=False)
    return {
        "grads": recorder.grads,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "indices": recorder.indices,
        "lrs": recorder.lrs,
        "losses": recorder.losses,
        "progress_bar": progress_bar,
        "val_loss": fit_metrics["val_loss"],
        "global_step": trainer.global_step,
        "predictions": predictions,
        "test_loss": tested[0]["test_loss"],
        "world_size": trainer.world_size,
        "plan": trainer.strategy.plan,
    }


def run(args: argparse.Namespace, schedule: str, recompute: bool, split: bool = False) -> None:
    """Fit one configuration and save this rank's record as ``<tag>_rank<r>.pt`` under ``--out``."""
    out = Path(args.out)
    tag = f"{schedule}_{recompute}" + ("_split" if split else "")
    record = fit_toy(
        -1,
        args.devices,
        args.depth,
        schedule,
        recompute,
        split,
        args.scheduler,
        args.precision,
        out / tag,
        microbatches=args.microbatches,
        batch=args.batch,
        steps=args.steps,
    )
    torch.save(record, out / f"{tag}_rank{torch.distributed.get_rank()}.pt")


def _record_exit(out: Path) -> None:
    """Registered before fit, so it runs after the strategy's exit handler (atexit runs last in, first out)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"exit_{os.getpid()}.txt").write_text(f"initialized={torch.distributed.is_initialized()}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--schedules", default="gpipe,1f1b")
    parser.add_argument("--recompute", default="false,true")
    parser.add_argument("--scheduler", action="store_true")
    parser.add_argument("--split", default="false")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    atexit.register(_record_exit, Path(args.out))
    for schedule in args.schedules.split(","):
        for recompute in args.recompute.split(","):
            for split in args.split.split(","):
                run(args, schedule, recompute == "true", split == "true")


if __name__ == "__main__":
    main()
