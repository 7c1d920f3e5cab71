"""Start a pipeline run that is set up wrongly (or fails mid-step) and let it raise.

``python misuse.py CASE [DEVICES]``; tests/test_errors.py checks the error and that no rank hangs.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_pipe import PipelineStrategy  # noqa: E402
from tests.models import ToyChain, make_data  # noqa: E402


class AutoOpt(ToyChain):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = True


class NoBlocks(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net = nn.Linear(6, 5)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        self.pipeline_step(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Boom(nn.Module):
    """Raises on the third call: fails in the middle of the first step's forwards."""

    calls = 0

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        Boom.calls += 1
        if Boom.calls == 3:
            raise RuntimeError("boom in block")
        return h, mask


class FailsMidStep(ToyChain):
    def __init__(self) -> None:
        super().__init__(depth=3)
        self.blocks.insert(2, Boom())


CASES: dict[str, Any] = {"auto_opt": AutoOpt, "no_blocks": NoBlocks, "indivisible": ToyChain, "mid_step": FailsMidStep}


def fit_case(case: str, devices: int = 1) -> None:
    """Fit the model of ``case`` on ``devices`` processes (more than one start through Lightning's launcher)."""
    x, y = make_data(64)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=PipelineStrategy(
            pipeline_depth=2 if case == "indivisible" else None,
            microbatches=4,
            partition="uniform",
            timeout=timedelta(seconds=30),
        ),
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(CASES[case](), DataLoader(TensorDataset(x, y), batch_size=8))


def main() -> None:
    fit_case(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1)


if __name__ == "__main__":
    main()
