"""The blocks one rank owns, run in order on a chosen weight version, optionally recomputed."""

from __future__ import annotations

from functools import partial
from typing import Any, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call
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
        position = {id(p): i for i, p in enumerate(self._params)}
        self._names = [
            [(name, position[id(p)]) for name, p in block.named_parameters() if id(p) in position] for block in self.blocks
        ]

    def parameters(self) -> list[nn.Parameter]:
        """Trainable parameters of this stage, without duplicates."""
        return self._params

    def _call(self, i: int, weights: Optional[list[Tensor]], x: Tensors) -> Any:
        block = self.blocks[i]
        if weights is None:
            return block(*x)
        return functional_call(block, {name: weights[j] for name, j in self._names[i]}, x, strict=False)

    def _run(self, weights: Optional[list[Tensor]], *inputs: Tensor) -> Tensors:
        x: Tensors = inputs
        for i, block in enumerate(self.blocks):
            x = as_tuple(self._call(i, weights, x), f"pipeline block {self.first_index + i} ({type(block).__name__})")
        return x

    def __call__(self, inputs: Tensors, weights: Optional[list[Tensor]] = None) -> Tensors:
        """Forward ``inputs`` through the stage's blocks, on ``weights`` (aligned with
        :meth:`parameters`) instead of the blocks' own parameters when given."""
        run = partial(self._run, weights)
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(run, *inputs, use_reentrant=False)
        return run(*inputs)
