"""Small chain models shared by the tests, and a single-process reference trainer."""

from __future__ import annotations

import copy
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_pipe import PipelineMixin

IN, HIDDEN, CLASSES = 6, 16, 5


class Embed(nn.Module):
    """First block: projects inputs and derives a bool mask that travels down the chain."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(IN, HIDDEN)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return torch.tanh(self.proj(x)), x[:, 0] > -1.0


class Residual(nn.Module):
    """Middle block: takes (h, mask), returns (h', mask); the mask passes without gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(HIDDEN, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)

    def forward(self, h: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        return h + torch.tanh(self.fc(self.norm(h))) * mask.unsqueeze(-1).to(h.dtype), mask


class Head(nn.Module):
    """Last block: logits from (h, mask)."""

    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(HIDDEN, CLASSES)

    def forward(self, h: Tensor, mask: Tensor) -> Tensor:
        return self.out(h)


class ToyChain(PipelineMixin, L.LightningModule):
    """Embed, ``depth`` residual blocks, head; classification loss; Adam."""

    def __init__(self, depth: int = 4, lr: float = 1e-2) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.embed = Embed()
        self.blocks = nn.ModuleList(Residual() for _ in range(depth))
        self.head = Head()
        self.lr = lr

    def pipeline_blocks(self) -> list[nn.Module]:
        return [self.embed, *self.blocks, self.head]

    def pipeline_loss(self, output: Tensor, batch: Any) -> Tensor:
        return F.cross_entropy(output.float(), batch[1])

    def forward(self, x: Tensor) -> Tensor:
        out: Any = x
        for block in self.pipeline_blocks():
            out = block(*out) if isinstance(out, tuple) else block(out)
        return out

    def training_step(self, batch: Any, batch_idx: int) -> None:
        loss = self.pipeline_step(batch)
        self.log("train_loss", loss, prog_bar=True)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.pipeline_forward(batch, with_loss=True), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self.pipeline_forward(batch, with_loss=True), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self.pipeline_forward(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


class ConvResidual(nn.Module):
    """Middle block of :class:`ConvChain`: a 1-D convolution over the hidden vector cut into 4 channels."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 4, 3, padding=1)
        self.norm = nn.LayerNorm(HIDDEN)

    def forward(self, h: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        y = self.conv(self.norm(h).view(h.shape[0], 4, HIDDEN // 4)).flatten(1)
        return h + torch.tanh(y) * mask.unsqueeze(-1).to(h.dtype), mask


class ConvChain(ToyChain):
    """:class:`ToyChain` with convolutional residual blocks (split backward defers their weight gradients)."""

    def __init__(self, depth: int = 4, lr: float = 1e-2) -> None:
        super().__init__(depth, lr)
        self.blocks = nn.ModuleList(ConvResidual() for _ in range(depth))


def load_plain(cls: Any, path: Any, **init: Any) -> Any:
    """``cls.load_from_checkpoint`` in this one process (``init``: arguments of ``cls``), consolidating
    a sharded (DCP) checkpoint directory first, as
    ``python -m lightning.pytorch.utilities.consolidate_checkpoint`` does."""
    from pathlib import Path

    from lightning.fabric.utilities.load import _load_distributed_checkpoint
    from lightning.pytorch.utilities.consolidate_checkpoint import _format_checkpoint

    path = Path(path)
    if path.is_dir():
        file = path.with_suffix(".consolidated")
        torch.save(_format_checkpoint(_load_distributed_checkpoint(path)), file)
        path = file
    return cls.load_from_checkpoint(path, **init)


def make_data(n: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Inputs and labels of a random classification problem."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, IN, generator=g), torch.randint(0, CLASSES, (n,), generator=g)


def reference_grads(model: ToyChain, batch: tuple[Tensor, Tensor]) -> dict[str, Tensor]:
    """Gradients of the plain (unpipelined) model on the whole batch."""
    model.zero_grad()
    model.pipeline_loss(model(batch[0]), batch).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def make_optimizer(params: Any, kind: str, lr: float) -> torch.optim.Optimizer:
    """The optimizers the parity tests use: "adam" or "sgd" (SGD with momentum)."""
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    return torch.optim.Adam(params, lr=lr)


def reference_train(
    model: ToyChain,
    batches: list[Any],
    losses: list[float] | None = None,
    step_lr: bool = False,
    delay: int = 0,
    optimizer: str = "adam",
    clip: float | None = None,
    history: list[dict[str, Tensor]] | None = None,
    opt: torch.optim.Optimizer | None = None,
) -> dict[str, Tensor]:
    """Single-process training written from the seeds' update rules; returns the final weights.

    ``delay=0`` is vanilla minibatch training (GPipe, PipeDream-Flush):
    ``W(t+1) = W(t) - lr * grad f(W(t))``. ``delay=1`` is PipeDream-2BW (PipeDream-2BW paper, section
    3.1): ``W(t+1) = W(t) - lr * grad f(W(t-1))``, batch t's gradient taken on version
    ``max(t-1, 0)`` and applied by one optimizer (no shadow state) to the newest weights.
    Gradients are clipped to the global norm ``clip`` (torch.nn.utils.clip_grad_norm_), and a
    step whose gradient is not finite is skipped. ``history`` receives ``W(0), W(1), ...``.
    Pass ``opt`` (over ``model``'s parameters) to continue an earlier call's optimizer state.
    """
    opt = opt or make_optimizer(model.parameters(), optimizer, model.lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if step_lr else None
    versions = [{n: p.detach().clone() for n, p in model.named_parameters()}]  # W(0), W(1), ...
    probe = copy.deepcopy(model)
    for t, batch in enumerate(batches):
        probe.load_state_dict(versions[max(t - delay, 0)], strict=False)
        probe.zero_grad()
        loss = probe.pipeline_loss(probe(batch[0]), batch)
        loss.backward()
        for p, q in zip(model.parameters(), probe.parameters()):
            p.grad = q.grad.clone()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip is not None else float("inf"))
        if torch.isfinite(norm):
            opt.step()
        if sched is not None:
            sched.step()
        if losses is not None:
            losses.append(float(loss.detach()))
        versions.append({n: p.detach().clone() for n, p in model.named_parameters()})
    if history is not None:
        history.extend(versions)
    return versions[-1]


def assert_close_dicts(got: dict[str, Tensor], want: dict[str, Tensor], rtol: float, atol: float = 1e-7) -> None:
    """Every key of ``want`` is in ``got`` with a close value."""
    assert sorted(got) == sorted(want), f"keys differ: {sorted(set(got) ^ set(want))}"
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def frozen(engine: Any) -> torch.optim.Optimizer:
    """An optimizer that leaves the stage's weights unchanged, for tests that read gradients."""
    return torch.optim.SGD(engine.parameters(), lr=0.0)


#: :class:`NonUniformChain`'s vocabulary, sequence length and width.
VOCAB, TOKENS, WIDTH = 256, 8, 96


class TokenEmbed(nn.Module):
    """First block of :class:`NonUniformChain`: token embedding and a layer norm."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.norm(self.embed(tokens))


class MLP(nn.Module):
    """Pre-norm residual MLP of hidden width ``hidden`` over ``width`` features."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, h: Tensor) -> Tensor:
        return h + self.down(F.gelu(self.up(self.norm(h))))


class Attention(nn.Module):
    """Pre-norm residual causal self-attention: linear projections, ``F.scaled_dot_product_attention``."""

    def __init__(self, width: int = WIDTH, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, h: Tensor) -> Tensor:
        b, t, c = h.shape
        q, k, v = self.qkv(self.norm(h)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return h + self.out(y.transpose(1, 2).reshape(b, t, c))


class Resize(nn.Module):
    """A block that changes the width: a linear map and an activation (no residual)."""

    def __init__(self, width: int, to: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, to)

    def forward(self, h: Tensor) -> Tensor:
        return torch.tanh(self.fc(h))


class TokenHead(nn.Module):
    """Last block of :class:`NonUniformChain`: a layer norm and per-token logits."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.out = nn.Linear(WIDTH, VOCAB)

    def forward(self, h: Tensor) -> Tensor:
        return self.out(self.norm(h))


class NonUniformChain(PipelineMixin, L.LightningModule):
    """Ten blocks nobody tuned the memory model on, about 0.93M parameters: a token
    embedding; residual MLPs of hidden widths 4x, 2x and 8x; causal self-attention; a block that
    triples the width, an MLP at that width, one that narrows it back, a wide MLP; a per-token
    head with a cross-entropy loss. AdamW. Batches are ``(tokens, targets)``, both ``[n, TOKENS]``."""

    def __init__(self, lr: float = 1e-3) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.chain = nn.ModuleList(
            [
                TokenEmbed(),
                MLP(WIDTH, 4 * WIDTH),
                MLP(WIDTH, 2 * WIDTH),
                Attention(),
                MLP(WIDTH, 8 * WIDTH),
                Resize(WIDTH, 3 * WIDTH),
                MLP(3 * WIDTH, 6 * WIDTH),
                Resize(3 * WIDTH, WIDTH),
                MLP(WIDTH, 10 * WIDTH),
                TokenHead(),
            ]
        )
        self.lr = lr

    def pipeline_blocks(self) -> list[nn.Module]:
        return list(self.chain)

    def pipeline_loss(self, output: Tensor, batch: Any) -> Tensor:
        return F.cross_entropy(output.flatten(0, 1), batch[1].flatten())

    def forward(self, tokens: Tensor) -> Tensor:
        h = tokens
        for block in self.chain:
            h = block(h)
        return h

    def training_step(self, batch: Any, batch_idx: int) -> None:
        self.log("train_loss", self.pipeline_step(batch), prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return adamw(self.parameters(), self.lr)


def adamw(params: Any, lr: float = 1e-3) -> torch.optim.Optimizer:
    """:class:`NonUniformChain`'s optimizer."""
    return torch.optim.AdamW(params, lr=lr)


def token_data(n: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Tokens and next-token-like targets for :class:`NonUniformChain`."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (n, TOKENS), generator=g)
    return tokens, torch.randint(0, VOCAB, (n, TOKENS), generator=g)


#: :class:`LogitsChain`'s vocabulary, sequence length and width: logits twice as wide as the blocks.
LOGITS_VOCAB, LOGITS_TOKENS, LOGITS_WIDTH = 64, 16, 32


class GPTBlock(nn.Module):
    """A pre-norm transformer block: causal self-attention, then an MLP of hidden width 4x."""

    def __init__(self, width: int = LOGITS_WIDTH) -> None:
        super().__init__()
        self.attention, self.mlp = Attention(width, heads=2), MLP(width, 4 * width)

    def forward(self, h: Tensor) -> Tensor:
        return self.mlp(self.attention(h))


class LogitsHead(nn.Module):
    """A layer norm and the projection to :data:`LOGITS_VOCAB` logits."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(LOGITS_WIDTH)
        self.out = nn.Linear(LOGITS_WIDTH, LOGITS_VOCAB)

    def forward(self, h: Tensor) -> Tensor:
        return self.out(self.norm(h))


class LogitsChain(PipelineMixin, L.LightningModule):
    """A tiny GPT (examples/gpt.py at a quarter of its width and context): token and position
    embeddings, four transformer blocks, and a head whose logits, twice as wide as the blocks,
    feed a cross-entropy loss, so the last stage's last block has the largest output and the
    loss saves a tensor of its size. AdamW. Batches are ``(tokens, targets)``, both ``[n, LOGITS_TOKENS]``."""

    def __init__(self, lr: float = 1e-3) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.embed = _Embeddings()
        self.blocks = nn.ModuleList(GPTBlock() for _ in range(4))
        self.head = LogitsHead()
        self.lr = lr

    def pipeline_blocks(self) -> list[nn.Module]:
        return [self.embed, *self.blocks, self.head]

    def pipeline_loss(self, output: Tensor, batch: Any) -> Tensor:
        return F.cross_entropy(output.flatten(0, 1), batch[1].flatten())

    def training_step(self, batch: Any, batch_idx: int) -> None:
        self.log("train_loss", self.pipeline_step(batch), prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return adamw(self.parameters(), self.lr)


class _Embeddings(nn.Module):
    """Token plus position embeddings (:class:`LogitsChain`'s first block)."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(LOGITS_VOCAB, LOGITS_WIDTH)
        self.positions = nn.Embedding(LOGITS_TOKENS, LOGITS_WIDTH)

    def forward(self, idx: Tensor) -> Tensor:
        return self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))


def logits_data(n: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Tokens and targets for :class:`LogitsChain`."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, LOGITS_VOCAB, (n, LOGITS_TOKENS), generator=g)
    return tokens, torch.randint(0, LOGITS_VOCAB, (n, LOGITS_TOKENS), generator=g)
