"""Tensor parallel inside pipeline stages: a chain of MLP blocks, 2 stages x 2 tensor-parallel ranks.

Each MLP block's first linear layer is split by columns and its second by rows over the two
ranks of its stage (Megatron-LM's MLP partition: Shoeybi et al., "Megatron-LM: Training
Multi-Billion Parameter Language Models Using Model Parallelism", section 3): each rank holds
half of ``fc1``'s output features and the matching half of ``fc2``'s input features, and one
all-reduce after ``fc2`` makes the block's output whole again on both ranks, which then send it
to their peers of the next stage. The module says so in ``configure_stage``; the strategy calls it
once per stage, after placing the stage and before ``configure_optimizers``.

Runs on CPU with 4 processes (gloo)::

    python examples/tensor_parallel.py

See docs/tensor_parallel.md.
"""

from __future__ import annotations

import argparse
from typing import Any, Optional, Sequence

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe import PipelineMixin, PipelineStrategy


class MLPBlock(nn.Module):
    """A pre-norm residual MLP: ``x + fc2(gelu(fc1(norm(x))))``."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def tensor_parallel_plan() -> dict[str, Any]:
    """How an :class:`MLPBlock` is split: ``fc1`` by output features (its input replicated, its
    output a shard), ``fc2`` by input features (its input that shard, its output all-reduced whole).
    The norm stays whole on every rank."""
    return {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}


class MLPChain(PipelineMixin, L.LightningModule):
    """Input projection, ``blocks`` MLP blocks, classifier head; cross-entropy; Adam."""

    def __init__(
        self,
        features: int = 6,
        width: int = 16,
        hidden: int = 32,
        blocks: int = 4,
        classes: int = 5,
        lr: float = 1e-2,
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.lr = lr
        self.embed = nn.Linear(features, width)
        self.blocks = nn.ModuleList(MLPBlock(width, hidden) for _ in range(blocks))
        self.head = nn.Linear(width, classes)

    def pipeline_blocks(self) -> list[nn.Module]:
        return [self.embed, *self.blocks, self.head]

    def configure_stage(self, blocks: list[nn.Module], tp_mesh: Optional[DeviceMesh]) -> None:
        """Split every MLP block of this stage over the stage's tensor-parallel ranks; the
        projection and the head stay whole (replicated) on each of them."""
        if tp_mesh is None:
            return
        for block in blocks:
            if isinstance(block, MLPBlock):
                parallelize_module(block, tp_mesh, tensor_parallel_plan())

    def pipeline_loss(self, output: Tensor, batch: Any) -> Tensor:
        return F.cross_entropy(output, batch[1])

    def forward(self, x: Tensor) -> Tensor:
        for block in self.pipeline_blocks():
            x = block(x)
        return x

    def training_step(self, batch: Any, batch_idx: int) -> None:
        self.log("train_loss", self.pipeline_step(batch), prog_bar=True)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.pipeline_forward(batch, with_loss=True), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def random_data(samples: int, features: int = 6, classes: int = 5, seed: int = 0) -> TensorDataset:
    """A random classification problem."""
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(
        torch.randn(samples, features, generator=g), torch.randint(0, classes, (samples,), generator=g)
    )


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline-depth", type=int, default=2)
    parser.add_argument("--tensor-parallel", type=int, default=2)
    parser.add_argument("--devices", type=int, default=4, help="w * pipeline_depth * tensor_parallel processes")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = MLPChain()
    strategy = PipelineStrategy(
        schedule="1f1b",
        pipeline_depth=args.pipeline_depth,
        tensor_parallel=args.tensor_parallel,
        microbatches=4,
        gradient_clip_val=1.0,
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(random_data(512), batch_size=16, shuffle=True))
    mesh = trainer.strategy.device_mesh
    split = [n for n, p in model.named_parameters() if isinstance(p, DTensor)]
    print(
        f"rank {trainer.global_rank}: mesh {mesh.mesh_dim_names} {mesh.mesh.tolist()}, "
        f"loss {float(trainer.callback_metrics['train_loss']):.4f}, {len(split)} tensor-parallel parameters",
        flush=True,
    )


if __name__ == "__main__":
    main()
