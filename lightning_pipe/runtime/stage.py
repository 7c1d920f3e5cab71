"""The blocks one rank owns, run in order on a chosen weight version, optionally recomputed."""

from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager, nullcontext
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint
from torch.utils.hooks import RemovableHandle

from lightning_pipe.runtime.autograd.deferred_weights import deferrable_weights_only

if TYPE_CHECKING:
    from lightning_pipe.runtime.sharding import ShardedStage

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
        ties: every parameter of the layout that blocks on several stages share
            (:class:`~lightning_pipe.runtime.ties.Tie`), this stage's or not.
        index: the stage's position in the chain of stages.
        sharded: with FSDP replicas, the blocks' sharding (``fully_shard`` wrapped them already):
            split backward gathers them for W through it.
    """

    def __init__(
        self,
        blocks: Sequence[nn.Module],
        first_index: int,
        recompute: bool = False,
        ties: tuple = (),
        index: int = 0,
        sharded: Optional["ShardedStage"] = None,
    ) -> None:
        self.blocks = list(blocks)
        self.sharded = sharded
        self.first_index = first_index
        self.index = index
        self.recompute = recompute
        self.ties = ties
        unique = {id(p): p for block in self.blocks for p in block.parameters() if p.requires_grad}
        self._params = list(unique.values())
        position = {id(p): i for i, p in enumerate(self._params)}
        self._names = [
            [(name, position[id(p)]) for name, p in block.named_parameters() if id(p) in position]
            for block in self.blocks
        ]
        self._input_hooks: OrderedDict[int, Callable[[Tensors], None]] = OrderedDict()  # weakly referenced by handles
        # Walked once: every forward renews running statistics (a walk of every module cost
        # about 0.5 ms a step on a 2-layer GPT stage, measured). Modules swapped into the blocks
        # after the stage is built are not seen (deferred BatchNorm is converted before).
        self._all_modules = [m for block in self.blocks for m in block.modules()]
        self._norms = [m for m in self._all_modules if isinstance(m, nn.modules.batchnorm._NormBase)]
        self.defers_weights = deferrable_weights_only(self._all_modules)  # split backward: see runtime.deferred_weights

    def register_input_hook(self, hook: Callable[[Tensors], None]) -> RemovableHandle:
        """Call ``hook(inputs)`` on every microbatch's first forward through the stage (never on a
        recomputation); ``.remove()`` the returned handle to stop."""
        handle = RemovableHandle(self._input_hooks)
        self._input_hooks[handle.id] = hook
        return handle

    def modules(self) -> list[nn.Module]:
        """Every module of the stage's blocks (the blocks and their submodules), as the stage was built."""
        return list(self._all_modules)

    def parameters(self) -> list[nn.Parameter]:
        """Trainable parameters of this stage, without duplicates."""
        return self._params

    def leaves(self) -> list[Tensor]:
        """The tensors autograd records for :meth:`parameters`: the parameters themselves, or with
        FSDP replicas their gathered forms (:meth:`~lightning_pipe.runtime.sharding.ShardedStage.leaves`)."""
        return self.sharded.leaves(self._params) if self.sharded is not None else self._params

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
        if self._input_hooks:
            for hook in list(self._input_hooks.values()):
                hook(inputs)
        run = partial(self._run, weights)
        if torch.is_grad_enabled():
            self.renew_buffers()
        if self.recompute and torch.is_grad_enabled():
            contexts = lambda: (nullcontext(), self.buffers_kept())  # noqa: E731 - the recomputation updates no buffer
            return checkpoint(run, *inputs, use_reentrant=False, context_fn=contexts)
        return run(*inputs)

    def recompute_forward(self, inputs: Tensors, weights: Optional[list[Tensor]] = None) -> Tensors:
        """Run the forward again with its graph (split backward's recomputation before I); the
        blocks' buffers (running statistics) keep the values the first forward left."""
        with self.buffers_kept():
            return self._run(weights, *inputs)

    def _buffer_slots(self, running_only: bool = False) -> list[tuple[nn.Module, str, Tensor]]:
        modules = [m for m in self._norms if _keeps_running_stats(m)] if running_only else self._all_modules
        return [(m, name, b) for m in modules for name, b in m._buffers.items() if b is not None]

    def renew_buffers(self) -> None:
        """Give running statistics a fresh tensor of the same value before a forward that records
        a graph. BatchNorm updates them in place and saves them for its backward; with several
        microbatches in flight the next forward's update would change what an earlier
        microbatch's backward saved (autograd refuses that)."""
        for module, name, b in self._buffer_slots(running_only=True):
            module._buffers[name] = b.detach().clone()

    @contextmanager
    def buffers_kept(self) -> Iterator[None]:
        """Run on copies of every buffer, and put the originals back on exit: a recomputed forward
        must not update running statistics a second time (nor touch tensors a graph saved)."""
        slots = self._buffer_slots()
        for module, name, b in slots:
            module._buffers[name] = b.detach().clone()
        try:
            yield
        finally:
            for module, name, b in slots:
                module._buffers[name] = b


def _keeps_running_stats(module: nn.Module) -> bool:
    """A BatchNorm-style module that updates its running statistics in a training forward."""
    return isinstance(module, nn.modules.batchnorm._NormBase) and module.training and module.track_running_stats
