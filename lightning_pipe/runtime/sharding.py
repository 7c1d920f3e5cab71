"""Sharded stage replicas: each block of a stage wrapped with FSDP2's fully_shard over the stage's replica mesh."""

from __future__ import annotations

from typing import Any, Sequence

from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor


def shard_blocks(blocks: Sequence[nn.Module], mesh: Any, reshard_after_forward: bool) -> None:
    """Wrap each of ``blocks`` with ``fully_shard`` over ``mesh`` (the replicas of their stage), in place.

    Each block is its own FSDP unit and its own root (the blocks share no module), as torchtitan
    shards each transformer block: a block's parameters are gathered for its forward and
    backward only. Its parameters become :class:`~torch.distributed.tensor.DTensor` shards
    (dim 0 split over the replicas), so an optimizer built over the module's parameters
    afterwards holds its state sharded too.

    Args:
        blocks: this rank's blocks of one or more stages.
        mesh: the 1-D DeviceMesh of the replicas of those stages.
        reshard_after_forward: free the gathered parameters after each forward (ZeRO-3) or not (ZeRO-2).
    """
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)


def local(tensor: Tensor) -> Tensor:
    """This rank's part of ``tensor``: its local shard for a DTensor, the tensor itself otherwise."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class ShardedGradients:
    """Reduce-scatters a batch's gradients once, after its last backward, for a stage's FSDP blocks.

    As torch's pipelining stage does (``PipelineStage.backward_maybe_with_nosync`` and
    ``perform_reduce_grad``): every microbatch's backward runs with gradient sync off, so FSDP
    accumulates the unsharded gradients; the AR action then turns sync on and runs FSDP's
    post-backward of every parameter group and its final callback, which reduce-scatters the
    accumulated gradients (averaged over the replicas) into the sharded parameters' ``.grad``.

    Args:
        modules: the FSDP-wrapped blocks of this rank's stages.
        reshard_after_forward: the blocks' setting; between microbatches a block's gathered
            parameters are freed after its backward too (ZeRO-3), or kept (ZeRO-2).
    """

    def __init__(self, modules: Sequence[nn.Module], reshard_after_forward: bool) -> None:
        self.modules = [m for m in modules if isinstance(m, FSDPModule)]
        self.reshard_after_forward = reshard_after_forward

    def accumulate(self) -> None:
        """A training program starts: backwards accumulate unsharded gradients, none is reduced."""
        for module in self.modules:
            module.set_is_last_backward(False)
            module.set_requires_gradient_sync(False)
            module.set_reshard_after_backward(self.reshard_after_forward)

    def reduce(self) -> None:
        """AR: reduce-scatter every accumulated gradient and free the gathered parameters."""
        for module in self.modules:
            module.set_is_last_backward(True)
            module.set_requires_gradient_sync(True)
            module.set_reshard_after_backward(True)
            state = fully_shard.state(module)  # type: ignore[attr-defined]
            if state._state_ctx.all_states:  # empty until the block's first forward
                for member in state._state_ctx.all_states:
                    for group in member._fsdp_param_groups:
                        group.post_backward()
                state._root_post_backward_final_callback()
