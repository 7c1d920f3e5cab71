"""Train ToyChain through Trainer.fit on every rank and dump what each rank saw (for the tests).

Run with torchrun or plain python (Lightning's default launcher); see tests/test_trainer.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_pipe import PipelineStrategy  # noqa: E402
from tests.models import ToyChain, make_data  # noqa: E402


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
        if not self.grads:
            self.grads = {n: p.grad.clone() for n, p in module.named_parameters()}
        self.indices.append(batch[2].tolist())
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


class WithScheduler(ToyChain):
    """ToyChain with a step LR scheduler, to check the mixin steps it."""

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=self.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def run(args: argparse.Namespace, schedule: str, recompute: bool, split: bool = False) -> None:
    torch.manual_seed(0)
    model = (WithScheduler if args.scheduler else ToyChain)()
    recorder = Recorder()
    out = Path(args.out)
    tag = f"{schedule}_{recompute}" + ("_split" if split else "")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=PipelineStrategy(schedule=schedule, pipeline_depth=args.depth, microbatches=args.microbatches,
                                  partition="uniform", recompute=recompute, split_backward=split,
                                  timeout=__import__("datetime").timedelta(seconds=60)),
        precision=args.precision,
        max_steps=args.steps,
        max_epochs=-1,
        limit_val_batches=2,
        val_check_interval=args.steps,
        num_sanity_val_steps=0,
        callbacks=[recorder, L.pytorch.callbacks.ModelCheckpoint(dirpath=out / f"ckpt_{tag}", save_last=True)],
        log_every_n_steps=1,
        logger=L.pytorch.loggers.TensorBoardLogger(out / "tb", name=tag),
        enable_model_summary=False,
        enable_progress_bar=False,
        use_distributed_sampler=True,
    )  # fmt: skip
    width = args.devices // args.depth
    train = DataLoader(Indexed(args.batch * width * args.steps, 0), batch_size=args.batch)
    val = DataLoader(Indexed(args.batch * width * 2, 99), batch_size=args.batch)
    trainer.fit(model, train, val)
    fit_metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    progress_bar = {k: float(v) for k, v in trainer.progress_bar_metrics.items()}
    predictions = trainer.predict(model, DataLoader(Indexed(8 * width, 7), batch_size=8))
    tested = trainer.test(model, DataLoader(Indexed(8 * width * 2, 5), batch_size=8), verbose=False)
    rank = trainer.global_rank
    torch.save(
        {
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
        },
        out / f"{tag}_rank{rank}.pt",
    )


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
    for schedule in args.schedules.split(","):
        for recompute in args.recompute.split(","):
            for split in args.split.split(","):
                run(args, schedule, recompute == "true", split == "true")


if __name__ == "__main__":
    main()
