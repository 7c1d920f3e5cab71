"""Train the cost-model chain through Trainer.fit with PipelineMonitor; rank 0 dumps what it logged.

    torchrun --nproc_per_node=4 tests/scripts/monitor_sleep.py --out DIR

tests/test_monitor.py runs :func:`fit_monitored` as a scenario of the shared 4-process launch.
"""

from __future__ import annotations

import argparse
import pickle
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.sleep_chain import SleepChain  # noqa: E402
from lightning_pipe import PipelineMixin, PipelineMonitor, PipelineStrategy  # noqa: E402


class SleepModule(PipelineMixin, L.LightningModule):
    """The cost-model chain as a LightningModule."""

    def __init__(self, depth: int, cost: float) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.chain = SleepChain(depth, 2, (cost, cost, cost))

    def pipeline_blocks(self) -> list[torch.nn.Module]:
        return self.chain.pipeline_blocks()

    def pipeline_inputs(self, batch: Any) -> Any:
        return batch[0]

    def pipeline_loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        return self.chain.pipeline_loss(output, batch[0])

    def training_step(self, batch: Any, batch_idx: int) -> None:
        self.pipeline_step(batch)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def fit_monitored(
    out: Path, schedule: str = "1f1b", split: bool = False, microbatches: int = 8, steps: int = 4, cost: float = 0.01
) -> None:
    """Fit the chain on 4 ranks (this process is one of them); rank 0 writes ``out/monitor.pkl``."""
    depth = 4
    data = TensorDataset(torch.randn(2 * microbatches * steps, 16))
    monitor = PipelineMonitor(log_every_n_steps=1, timeline_every_n_steps=steps)  # PNGs under the log dir
    strategy = PipelineStrategy(schedule, depth, microbatches, partition="uniform", split_backward=split)
    loggers = [TensorBoardLogger(out, name="tb"), CSVLogger(out, name="csv")]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=depth,
        strategy=strategy,
        max_steps=steps,
        logger=loggers,
        callbacks=[monitor],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(SleepModule(depth, cost), DataLoader(data, batch_size=2 * microbatches))
    if trainer.is_global_zero:
        (out / "monitor.pkl").write_bytes(
            pickle.dumps(
                {
                    "records": monitor.last_records,
                    "saved": monitor.saved,
                    "csv": loggers[1].log_dir,
                    "tb": loggers[0].log_dir,
                }
            )
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--split", action="store_true")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--cost", type=float, default=0.01)
    args = parser.parse_args()
    fit_monitored(Path(args.out), args.schedule, args.split, args.microbatches, args.steps, args.cost)


if __name__ == "__main__":
    main()
