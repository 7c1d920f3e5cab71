"""Fit ToyChain on a shuffled loader with checkpoints every 2 steps; optionally resume, or SIGKILL a rank.

``fit_resumable`` runs inside the shared launches (tests/test_checkpoint.py). The script form is
for runs that kill a rank (they need launches of their own)::

    torchrun --nproc_per_node 4 resume_toy.py FOLDER --depth 2 --steps 6 [--ckpt last] [--kill train:1:2]

``--kill train:R:S`` kills rank R when step S+1 starts; ``--kill save:R:S`` kills rank R inside
the checkpoint save at step S, after its shard's data is written.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import lightning as L
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_pipe import PipelineStrategy  # noqa: E402
from tests.models import ToyChain  # noqa: E402
from tests.scripts.train_toy import Indexed  # noqa: E402

GLOBAL_BATCH, SAMPLES = 16, 96  # 6 steps an epoch: a resume at step 2 or 4 is mid-epoch


class Record(L.Callback):
    """Keeps the sample indices of every step this run trained; optionally SIGKILLs this rank."""

    def __init__(self, kill: Optional[tuple[str, int, int]] = None) -> None:
        self.indices: list[list[int]] = []
        self.kill = kill

    def _due(self, trainer: L.Trainer, when: str) -> bool:
        return (
            self.kill is not None
            and self.kill[0] == when
            and self.kill[1:] == (trainer.global_rank, trainer.global_step)
        )

    def on_train_batch_start(self, trainer: L.Trainer, module: Any, batch: Any, batch_idx: int) -> None:
        if self._due(trainer, "train"):
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.indices.append(batch[2].tolist())
        if self._due(trainer, "save"):
            _kill_inside_next_write()


def _kill_inside_next_write() -> None:
    """SIGKILL this process right after it writes its checkpoint shard (mid-save)."""
    from torch.distributed.checkpoint import FileSystemWriter

    write = FileSystemWriter.write_data

    def write_then_die(self: Any, plan: Any, planner: Any) -> Any:
        future = write(self, plan, planner)
        future.wait()
        os.kill(os.getpid(), signal.SIGKILL)

    FileSystemWriter.write_data = write_then_die  # type: ignore[method-assign]


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor shard gathered whole (a collective over its mesh); a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def fit_resumable(
    rank: int,
    world: int,
    depth: int,
    schedule: str,
    microbatches: int,
    partition: Union[str, Sequence[int]],
    steps: int,
    folder: Path,
    ckpt: Optional[str] = None,
    sharded: bool = True,
    kill: Optional[tuple[str, int, int]] = None,
    data_parallel: str = "ddp",
) -> dict[str, Any]:
    """Fit to ``steps`` (resuming from ``ckpt`` if given), checkpointing every 2 steps under ``folder/ckpt``;
    ``data_parallel``: the replicas' kind (FSDP's weights are returned gathered whole).

    Returns:
        This rank's parameters, the sample indices of each step it trained, global step and plan.
    """
    torch.manual_seed(0)
    model, record = ToyChain(), Record(kill)
    strategy = PipelineStrategy(
        schedule=schedule,
        pipeline_depth=depth,
        microbatches=microbatches,
        partition=partition,
        save_distributed_checkpoint=sharded,
        data_parallel=data_parallel,
        global_batch_size=GLOBAL_BATCH,
        timeout=timedelta(seconds=30),
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=steps,
        max_epochs=-1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[
            record,
            L.pytorch.callbacks.ModelCheckpoint(
                dirpath=folder / "ckpt", every_n_train_steps=2, save_top_k=-1, save_last=True
            ),
        ],
    )
    loader = DataLoader(Indexed(SAMPLES, 0), batch_size=4, shuffle=True)  # the strategy sets 16 / w
    trainer.fit(model, loader, ckpt_path=ckpt)
    params = {n: _whole(p.detach()).clone() for n, p in model.named_parameters()}
    return {"params": params, "indices": record.indices, "global_step": trainer.global_step, "plan": strategy.plan}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", type=Path)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--kill", default=None)
    args = parser.parse_args()
    kill = None
    if args.kill:
        when, rank, step = args.kill.split(":")
        kill = (when, int(rank), int(step))
    world = int(os.environ["WORLD_SIZE"])
    out = fit_resumable(
        int(os.environ["RANK"]),
        world,
        args.depth,
        args.schedule,
        args.microbatches,
        "uniform",
        args.steps,
        args.folder,
        args.ckpt,
        kill=kill,
    )
    torch.save(out, args.folder / f"result_rank{os.environ['RANK']}.pt")


if __name__ == "__main__":
    main()
