"""Fit ToyChain for two epochs, or resume the second epoch from the first epoch's checkpoint.

``torchrun --nproc_per_node 2 resume_toy.py OUT SCHEDULE [CKPT]``; each rank saves its weights.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_pipe import PipelineStrategy  # noqa: E402
from tests.models import ToyChain, make_data  # noqa: E402


def main() -> None:
    out, schedule = Path(sys.argv[1]), sys.argv[2]
    ckpt = sys.argv[3] if len(sys.argv) > 3 else None
    torch.manual_seed(0)
    model = ToyChain()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=PipelineStrategy(schedule=schedule, microbatches=2, partition="uniform"),
        max_epochs=2, logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=out / "ckpt", save_top_k=-1, every_n_epochs=1)],
    )  # fmt: skip
    x, y = make_data(48)
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=16), ckpt_path=ckpt)
    name = "resumed" if ckpt else "straight"
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.save({"params": params, "step": trainer.global_step}, out / f"{name}_rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
