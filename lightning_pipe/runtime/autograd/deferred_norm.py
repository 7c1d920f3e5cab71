"""Deferred batch normalisation (torchgpipe's): running statistics from the whole batch, updated once per batch."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm


class DeferredBatchNorm(_BatchNorm):
    """A BatchNorm for microbatched training: each microbatch is normalised with its own
    statistics, as a BatchNorm would, but the running statistics are updated once per batch,
    after its last microbatch, from the mean and (unbiased) variance of the whole batch, as
    training on the whole batch would have (torchgpipe's ``DeferredBatchNorm``).

    The per-batch sums are buffers, so a recomputed forward (which runs on copies of the
    buffers) counts nothing twice.

    Args:
        num_features, eps, momentum, affine: as :class:`torch.nn.BatchNorm1d`.
        chunks: microbatches per batch.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: Optional[float] = 0.1,
        affine: bool = True,
        chunks: int = 1,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats=True)
        self.chunks = chunks
        # The batch in progress: not in checkpoints (a step never ends mid-batch), so a
        # checkpoint loads into the plain BatchNorm model.
        self.register_buffer("batch_sum", torch.zeros(num_features), persistent=False)
        self.register_buffer("batch_squares", torch.zeros(num_features), persistent=False)
        self.register_buffer("batch_count", torch.zeros((), dtype=torch.long), persistent=False)
        self.register_buffer("batch_chunks", torch.zeros((), dtype=torch.long), persistent=False)

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: Tensor) -> Tensor:
        """Normalise with this microbatch's statistics; after the batch's last, update the running ones."""
        self._check_input_dim(input)
        if not self.training:
            return F.batch_norm(
                input, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps
            )
        self._track(input.detach())
        return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)

    @torch.no_grad()
    def _track(self, x: Tensor) -> None:
        dims = [0, *range(2, x.dim())]
        self.batch_sum += x.sum(dims, dtype=self.batch_sum.dtype)
        self.batch_squares += (x.to(self.batch_squares.dtype) ** 2).sum(dims)
        self.batch_count += x.numel() // x.size(1)
        self.batch_chunks += 1
        if int(self.batch_chunks) >= self.chunks:
            self._commit()

    def _commit(self) -> None:
        count = int(self.batch_count)
        mean = self.batch_sum / count
        var = (self.batch_squares / count - mean**2) * count / max(count - 1, 1)  # unbiased, as BatchNorm keeps it
        self.num_batches_tracked += 1
        factor = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
        self.running_mean.mul_(1 - factor).add_(mean, alpha=factor)
        self.running_var.mul_(1 - factor).add_(var, alpha=factor)
        for buffer in (self.batch_sum, self.batch_squares, self.batch_count, self.batch_chunks):
            buffer.zero_()


def convert_deferred_batch_norm(module: nn.Module, chunks: int) -> nn.Module:
    """Replace every BatchNorm inside ``module`` by a :class:`DeferredBatchNorm` of ``chunks``
    microbatches (same parameters and running statistics); set ``chunks`` on those already deferred."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, DeferredBatchNorm):
                child.chunks = chunks
            elif isinstance(child, _BatchNorm) and child.track_running_stats:
                parent._modules[name] = _deferred(child, chunks)
    return module


def _deferred(norm: _BatchNorm, chunks: int) -> DeferredBatchNorm:
    deferred = DeferredBatchNorm(norm.num_features, norm.eps, norm.momentum, norm.affine, chunks)
    deferred.weight, deferred.bias = norm.weight, norm.bias  # the same Parameter objects
    with torch.no_grad():
        deferred.running_mean.copy_(norm.running_mean)
        deferred.running_var.copy_(norm.running_var)
        deferred.num_batches_tracked.copy_(norm.num_batches_tracked)
    return deferred.to(norm.running_mean.device).train(norm.training)
