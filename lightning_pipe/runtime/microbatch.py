"""Split a batch (tensor or nested tuple/list/dict of tensors) into microbatches along dim 0."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def batch_size(batch: Any) -> int:
    """Size of dim 0 of the first tensor found in ``batch``."""
    if isinstance(batch, Tensor):
        return batch.shape[0]
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for value in values:
        size = batch_size(value)
        if size >= 0:
            return size
    return -1


def _split(batch: Any, chunks: int) -> list[Any]:
    if isinstance(batch, Tensor):
        return list(torch.tensor_split(batch, chunks))
    if isinstance(batch, dict):
        parts = {k: _split(v, chunks) for k, v in batch.items()}
        return [type(batch)({k: parts[k][i] for k in batch}) for i in range(chunks)]
    if isinstance(batch, (list, tuple)):
        columns = [_split(v, chunks) for v in batch]
        rows = [[col[i] for col in columns] for i in range(chunks)]
        return [type(batch)(*r) if hasattr(batch, "_fields") else type(batch)(r) for r in rows]
    return [batch] * chunks


def split_batch(batch: Any, chunks: int) -> tuple[list[Any], list[float]]:
    """Split ``batch`` into ``chunks`` microbatches and return each one's share of the batch.

    Uneven sizes are allowed: as with :func:`torch.tensor_split`, the first ``B % m``
    microbatches hold one sample more. The shares ``n_k / B`` weight each microbatch's
    mean loss so that the sum equals the mean loss over the whole batch.

    Raises:
        ValueError: if the batch holds no tensor or fewer samples than ``chunks``.
    """
    size = batch_size(batch)
    if size < 0:
        raise ValueError("the batch holds no tensor to split into microbatches")
    if size < chunks:
        raise ValueError(
            f"a batch of {size} samples cannot be split into microbatches={chunks}; "
            "use a batch size of at least `microbatches` (drop_last=True avoids small last batches)"
        )
    parts = _split(batch, chunks)
    return parts, [batch_size(p) / size for p in parts]
