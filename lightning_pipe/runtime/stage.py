"""The blocks one rank owns, run in order, with optional activation recomputation."""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

Tensors = tuple[Tensor, ...]


def as_tuple(value: Any, what: str) -> Tensors:
    """Normalise a block output (a tensor or a tuple of tensors) to a tuple, or raise."""
    items = value if isinstance(value, tuple) else (value,)
    if not items or not all(isinstance(t, Tensor) for t in items):
        raise TypeError(
            f"{what} returned {type(value).__name__}"
            f"{'' if not isinstance(value, tuple) else ' holding ' + ', '.join(type(t).__name__ for t in items)}; "
            "pipeline blocks must return a Tensor or a tuple of Tensors"
        )
    return items


class Stage:
    """Run a contiguous slice of the chain: a tuple output is unpacked into the next block's arguments.

    Args:
        blocks: the blocks of this stage, in chain order.
        first_index: index of ``blocks[0]`` in the whole chain (for error messages).
        recompute: keep only the stage input and recompute activations in backward
            (:func:`torch.utils.checkpoint.checkpoint`).
    """

    def __init__(self, blocks: Sequence[nn.Module], first_index: int, recompute: bool = False) -> None:
        self.blocks = list(blocks)
        self.first_index = first_index
        self.recompute = recompute
        unique = {id(p): p for block in self.blocks for p in block.parameters() if p.requires_grad}
        self._params = list(unique.values())

    def parameters(self) -> list[nn.Parameter]:
        """Trainable parameters of this stage, without duplicates."""
        return self._params

    def _run(self, *inputs: Tensor) -> Tensors:
        x: Tensors = inputs
        for i, block in enumerate(self.blocks):
            x = as_tuple(block(*x), f"pipeline block {self.first_index + i} ({type(block).__name__})")
        return x

    def __call__(self, inputs: Tensors) -> Tensors:
        """Forward ``inputs`` through the stage's blocks."""
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(self._run, *inputs, use_reentrant=False)
        return self._run(*inputs)
