"""The pipeline runs tests/scripts/misuse.py starts: set up wrongly, failing mid-step, or hanging."""

from __future__ import annotations

import os
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe import PipelineStrategy
from tests.models import ToyChain, make_data


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


class Returns(nn.Module):
    """A block that returns ``value`` (not a Tensor or a tuple of Tensors) in place of its input."""

    def __init__(self, value: Any) -> None:
        super().__init__()
        self.value = value

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> Any:
        return self.value


class StuckUntilRankZeroEnds(nn.Module):
    """User code that hangs: sleeps until rank 0 (the launcher: ``MISUSE_LAUNCHER_PID``, else
    this process's parent) has ended, at most five minutes, then passes its input on."""

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pid = int(os.environ.get("MISUSE_LAUNCHER_PID", os.getppid()))
        deadline = time.monotonic() + 300
        while _running(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        return h, mask


def _running(pid: int) -> bool:
    """Whether process ``pid`` runs (exists and is not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _with_block(block: nn.Module, at: int) -> ToyChain:
    """A ToyChain with ``block`` inserted before residual block ``at`` (1: on stage 0 of 2; 4: on stage 1 of 2)."""
    model = ToyChain()
    model.blocks.insert(at, block)
    return model


CASES: dict[str, Any] = {
    "auto_opt": AutoOpt,
    "no_blocks": NoBlocks,
    "indivisible": ToyChain,
    "mid_step": FailsMidStep,
    "clean": ToyChain,
    "none_first": lambda: _with_block(Returns(None), 1),
    "dict_last": lambda: _with_block(Returns({"h": 1}), 4),
    "hang": lambda: _with_block(StuckUntilRankZeroEnds(), 4),
}
TIMEOUT = {"hang": 5}  # seconds of every collective and transfer; the rest: 30
TOGETHER = {"clean", "none_first", "dict_last", "hang"}  # cases whose ranks connect together (ConnectsTogether)


class ConnectsTogether(PipelineStrategy):
    """Rank 0 connects the processes only once every other rank is about to (a file each, in
    ``MISUSE_READY``): a short timeout then bounds the pipeline's waits, not how long a loaded
    machine takes to start a process."""

    def setup_environment(self) -> None:
        folder = Path(os.environ["MISUSE_READY"])
        if self.global_rank == 0:
            deadline = time.monotonic() + 300
            while len(list(folder.iterdir())) < self.world_size - 1 and time.monotonic() < deadline:
                time.sleep(0.1)
        else:
            (folder / str(self.global_rank)).touch()
        super().setup_environment()


def fit_case(case: str, devices: int = 1) -> None:
    """Fit the model of ``case`` on ``devices`` processes (more than one start through Lightning's launcher)."""
    x, y = make_data(64)
    if case in TOGETHER:
        os.environ.setdefault("MISUSE_READY", tempfile.mkdtemp())  # before the launcher copies the environment
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=(ConnectsTogether if case in TOGETHER else PipelineStrategy)(
            pipeline_depth=2 if case == "indivisible" else None,
            microbatches=4,
            partition="uniform",
            timeout=timedelta(seconds=TIMEOUT.get(case, 30)),
        ),
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(CASES[case](), DataLoader(TensorDataset(x, y), batch_size=8))
