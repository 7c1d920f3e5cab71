"""Character-level GPT trained as a pipeline on the Python standard library's own source.

    python examples/gpt.py fit --config configs/gpt_1f1b.yaml

Tokens are bytes (vocabulary 256), so the text needs no tokenizer and no download.
"""

from __future__ import annotations

import math
import os
from functools import partial
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.cli import LightningCLI
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from lightning_pipe import PipelineMixin


def stdlib_text(max_bytes: int) -> bytes:
    """Concatenated source of the standard library's top-level modules, in sorted order."""
    chunks, total = [], 0
    for path in sorted(Path(os.__file__).parent.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"".join(chunks)[:max_bytes]


class Windows(Dataset):
    """Non-overlapping windows of ``block_size + 1`` bytes: input and next-byte targets."""

    def __init__(self, data: Tensor, block_size: int) -> None:
        self.data, self.block_size = data, block_size

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        chunk = self.data[i * self.block_size : (i + 1) * self.block_size + 1].long()
        return chunk[:-1], chunk[1:]


class StdlibText(L.LightningDataModule):
    """Bytes of the standard library source, split 90/10 into train and validation.

    Args:
        block_size: context length in bytes.
        batch_size: samples per batch on each data-parallel replica.
        max_bytes: how much source text to read.
    """

    def __init__(self, block_size: int = 64, batch_size: int = 32, max_bytes: int = 2_000_000) -> None:
        super().__init__()
        self.block_size, self.batch_size, self.max_bytes = block_size, batch_size, max_bytes

    def setup(self, stage: str) -> None:
        data = torch.frombuffer(bytearray(stdlib_text(self.max_bytes)), dtype=torch.uint8)
        split = int(0.9 * len(data))
        self.train_set = Windows(data[:split], self.block_size)
        self.val_set = Windows(data[split:], self.block_size)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, drop_last=True)


class Embedding(nn.Module):
    """Token plus learned position embeddings."""

    def __init__(self, vocab: int, block_size: int, dim: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(block_size, dim)

    def forward(self, idx: Tensor) -> Tensor:
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and an MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def attention(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    """Final layer norm and the projection to byte logits."""

    def __init__(self, dim: int, vocab: int) -> None:
        super().__init__()
        self.ln, self.out = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.ln(x))


class GPT(PipelineMixin, L.LightningModule):
    """A small GPT whose chain (embedding, blocks, head) is split over pipeline stages.

    Args:
        n_layer: transformer blocks.
        n_embd: model width.
        n_head: attention heads.
        block_size: context length.
        vocab_size: 256 for bytes.
        lr: peak AdamW learning rate (warm-up, then cosine decay to 10% over ``max_steps``).
    """

    def __init__(
        self,
        n_layer: int = 4,
        n_embd: int = 128,
        n_head: int = 4,
        block_size: int = 64,
        vocab_size: int = 256,
        lr: float = 3e-3,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.embed = Embedding(vocab_size, block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.head = Head(n_embd, vocab_size)

    def pipeline_blocks(self) -> list[nn.Module]:
        return [self.embed, *self.blocks, self.head]

    def pipeline_loss(self, output: Tensor, batch: Any) -> Tensor:
        return F.cross_entropy(output.flatten(0, 1).float(), batch[1].flatten())

    def training_step(self, batch: Any, batch_idx: int) -> None:
        loss = self.pipeline_step(batch)
        self.log("train_loss", loss, prog_bar=True)
        self.log("lr", self.optimizers().param_groups[0]["lr"])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.pipeline_forward(batch, with_loss=True), prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> Any:
        return adamw_warmup_cosine(self)


def adamw_warmup_cosine(module: L.LightningModule) -> dict[str, Any]:
    """AdamW at ``module.hparams.lr`` (weight decay 0.01) under :func:`warmup_cosine` over ``max_steps``, per step."""
    opt = torch.optim.AdamW(module.parameters(), lr=module.hparams.lr, weight_decay=0.01)
    schedule = partial(warmup_cosine, total=max(module.trainer.max_steps, 1))
    return {
        "optimizer": opt,
        "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, schedule), "interval": "step"},
    }


def warmup_cosine(step: int, total: int) -> float:
    """LR factor: linear warm-up over the first 10% of steps, then cosine decay to 10%."""
    warmup = max(1, total // 10)
    if step < warmup:
        return (step + 1) / warmup
    progress = min((step - warmup) / max(total - warmup, 1), 1.0)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def main(args: Optional[list[str]] = None) -> None:
    """LightningCLI entry point (``args`` in place of the command line): ``fit`` or ``validate`` with a config."""
    LightningCLI(GPT, StdlibText, save_config_kwargs={"overwrite": True}, args=args)


if __name__ == "__main__":
    main()
