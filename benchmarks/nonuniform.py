"""A non-uniform chain for the planner's user-path benchmark: blocks of very different cost and width.

    python benchmarks/nonuniform.py fit --config benchmarks/nonuniform.yaml
    python -m lightning_pipe.plan --config benchmarks/nonuniform.yaml --script benchmarks/nonuniform.py --devices 2

The chain (about 1M parameters at the defaults): token and position embedding, two MLP blocks
of different hidden widths, an attention block, a block that triples the width, a wide MLP at
the tripled width (most of the parameters and compute), a block that contracts the width back,
a narrow MLP with a very wide hidden layer, and the head. The data are generated token
sequences (a noisy repeating pattern), so nothing is downloaded.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.cli import LightningCLI
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe import PipelineMixin


class Embed(nn.Module):
    """Token plus learned position embeddings."""

    def __init__(self, vocab: int, length: int, dim: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(length, dim)

    def forward(self, idx: Tensor) -> Tensor:
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


class MLP(nn.Module):
    """Pre-norm residual MLP of width ``dim`` and hidden width ``hidden``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x: Tensor) -> Tensor:
        return x + self.net(self.ln(x))


class Attention(nn.Module):
    """Pre-norm residual causal self-attention."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln = nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(y.transpose(1, 2).reshape(b, t, c))


class Resize(nn.Module):
    """A width change (``dim_in`` to ``dim_out``), normalised and activated."""

    def __init__(self, dim_in: int, dim_out: int) -> None:
        super().__init__()
        self.ln, self.linear = nn.LayerNorm(dim_in), nn.Linear(dim_in, dim_out)

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(self.linear(self.ln(x)))


class Head(nn.Module):
    """Final layer norm and the projection to token logits."""

    def __init__(self, dim: int, vocab: int) -> None:
        super().__init__()
        self.ln, self.out = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.ln(x))


class NonUniform(PipelineMixin, L.LightningModule):
    """The non-uniform chain, trained with AdamW.

    Args:
        vocab: token vocabulary.
        length: sequence length.
        dim: the narrow width (the tripled block runs at ``3 * dim``).
        heads: attention heads.
        lr: AdamW learning rate.
    """

    def __init__(self, vocab: int = 256, length: int = 32, dim: int = 64, heads: int = 4, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.chain = nn.ModuleList(
            [
                Embed(vocab, length, dim),
                MLP(dim, 4 * dim),
                MLP(dim, 8 * dim),
                Attention(dim, heads),
                Resize(dim, 3 * dim),
                MLP(3 * dim, 9 * 3 * dim),
                Resize(3 * dim, dim),
                MLP(dim, 16 * dim),
                Head(dim, vocab),
            ]
        )

    def pipeline_blocks(self) -> list[nn.Module]:
        return list(self.chain)

    def pipeline_loss(self, output: Tensor, batch: Any) -> Tensor:
        return F.cross_entropy(output.flatten(0, 1).float(), batch[1].flatten())

    def training_step(self, batch: Any, batch_idx: int) -> None:
        self.log("train_loss", self.pipeline_step(batch), prog_bar=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)


class PatternTokens(L.LightningDataModule):
    """Generated sequences: a repeating pattern with a random phase and 10% random tokens.

    Args:
        vocab: token vocabulary.
        length: sequence length (inputs; targets are shifted by one).
        batch_size: samples per batch on each data-parallel replica.
        samples: sequences generated.
        seed: the generator's seed.
    """

    def __init__(
        self, vocab: int = 256, length: int = 32, batch_size: int = 32, samples: int = 8192, seed: Optional[int] = 0
    ) -> None:
        super().__init__()
        self.vocab, self.length, self.batch_size, self.samples, self.seed = vocab, length, batch_size, samples, seed

    def setup(self, stage: str) -> None:
        g = torch.Generator().manual_seed(self.seed or 0)
        phase = torch.randint(0, self.vocab, (self.samples, 1), generator=g)
        tokens = (phase + 7 * torch.arange(self.length + 1)) % self.vocab
        noise = torch.rand(tokens.shape, generator=g) < 0.1
        tokens = torch.where(noise, torch.randint(0, self.vocab, tokens.shape, generator=g), tokens)
        self.train_set = TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True)


def main(args: Optional[list[str]] = None) -> None:
    """LightningCLI entry point (``args`` in place of the command line)."""
    LightningCLI(NonUniform, PatternTokens, save_config_kwargs={"overwrite": True}, args=args)


if __name__ == "__main__":
    main()
