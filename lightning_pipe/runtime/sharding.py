"""Sharded stage replicas: each block of a stage wrapped with FSDP2's fully_shard over the stage's replica mesh."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
from torch.distributed.tensor import DTensor


def shard_blocks(blocks: Sequence[nn.Module], mesh: Any, reshard_after_forward: bool) -> None:
    """Wrap each of ``blocks`` with ``fully_shard`` over ``mesh`` (the replicas of their stage), in place.

    Each block is its own FSDP unit and its own root (the blocks share no module), as torchtitan
    shards each transformer block: a block's parameters are gathered for its forward and
    backward only. Its parameters become :class:`~torch.distributed.tensor.DTensor` shards
    (dim 0 split over the replicas), so an optimizer built over the module's parameters
    afterwards holds its state sharded too.

    Each all-gather's flat output is freed as soon as its copy-out into the unsharded
    parameters is done (:func:`free_all_gather_output`).

    Args:
        blocks: this rank's blocks of one or more stages.
        mesh: the 1-D DeviceMesh of the replicas of those stages.
        reshard_after_forward: free the gathered parameters after each forward (ZeRO-3) or not (ZeRO-2).
    """
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
        for group in fully_shard.state(block)._fsdp_param_groups:  # type: ignore[attr-defined]
            free_all_gather_output(group)


def free_all_gather_output(group: FSDPParamGroup) -> None:
    """Free ``group``'s flat all-gather output (on CPU) right after FSDP copies it out.

    FSDP2 gathers a block's shards into one flat tensor and copies it out into the unsharded
    parameters (``foreach_all_gather`` and ``foreach_all_gather_copy_out``). Its own reference
    to that tensor ends after the copy-out in a backward, at the block's post-forward in a
    forward (kept so that a CUDA copy-out can overlap the next all-gather). But gloo's worker
    thread holds the collective's work, and with it the tensor, past the collective's completion,
    until it takes its work queue's lock again (``ProcessGroupGloo::runLoop``); how long depends
    on thread scheduling, so without this the tensor's bytes stay alive into the block's compute
    on some ranks and steps and not on others. Its storage is therefore resized to 0 once the
    copy-out is done (as FSDP frees the unsharded parameters): a block's weights are held twice
    during its gather's copy-out only. On CPU collectives and copies are synchronous; on an
    accelerator the tensor is left to FSDP, which orders its reuse by stream events.

    Args:
        group: a parameter group of a block wrapped by ``fully_shard``; its ``wait_for_unshard``
            (the copy-out) is wrapped, on this instance only.
    """
    copy_out = group.wait_for_unshard

    def copy_out_then_free() -> None:
        result = group._all_gather_result
        copy_out()
        if result is None or group._all_gather_process_group.size() == 1:  # no gather (w = 1 reads its shard)
            return
        if result.all_gather_output.device.type == "cpu":
            result.all_gather_output.untyped_storage().resize_(0)

    group.wait_for_unshard = copy_out_then_free  # type: ignore[method-assign]


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


class ShardedStage:
    """A stage's FSDP blocks under split backward: gathered for each W, resharded once no W is pending.

    I runs through FSDP's hooks as any backward does: a block's pre-backward gathers its weights,
    its post-backward runs with gradient sync off. W (split backward: 2BP; Zero Bubble) computes
    the weight gradients later, from what I captured, outside those hooks, on the gathered
    parameters the forward ran on: so, as torch's pipelining stage keeps a stage gathered from
    its first backward (``set_reshard_after_backward(False)``), a block stays gathered from an I
    until the stage has no W pending (:meth:`hold`), W gathers any block a forward resharded in
    between (:meth:`gather`; ZeRO-3 reshards after every forward), and the W or full backward
    that leaves no W pending reshards them (:meth:`release`; under ZeRO-2 they stay gathered
    until the reduce-scatter, as without split backward). W's gradients land on the gathered
    parameters' ``.grad``, where FSDP accumulates a backward's, and :class:`ShardedGradients`
    reduce-scatters them once per batch.

    Args:
        blocks: the stage's blocks, each wrapped by ``fully_shard``.
        reshard_after_forward: the blocks' setting (ZeRO-3: ``True``; ZeRO-2: ``False``).
    """

    def __init__(self, blocks: Sequence[nn.Module], reshard_after_forward: bool) -> None:
        self.modules = [b for b in blocks if isinstance(b, FSDPModule)]
        self.reshard_after_forward = reshard_after_forward
        self._params: Optional[dict[int, Any]] = None  # id of a sharded parameter -> its FSDPParam

    def hold(self) -> None:
        """Before an I: its blocks' post-backward keeps them gathered for the W that follows."""
        for module in self.modules:
            module.set_reshard_after_backward(False)

    def gather(self) -> None:
        """Before a W: all-gather every block a forward resharded since its I (a no-op for the others)."""
        for module in self.modules:
            module.unshard()

    def release(self) -> None:
        """No W of the stage is pending: under ZeRO-3 free the gathered weights (kept under ZeRO-2)."""
        if not self.reshard_after_forward:
            return
        for module in self.modules:
            module.set_reshard_after_backward(True)
            module.reshard()

    def leaves(self, params: Sequence[Tensor]) -> list[Tensor]:
        """What autograd records for each of ``params`` (the blocks' sharded parameters): its
        gathered (unsharded) parameter, which the blocks run on, once the first all-gather made it
        (FSDP keeps that tensor for good, freeing and refilling its storage); else the parameter."""
        if self._params is None:
            self._params = {
                id(fp.sharded_param): fp
                for module in self.modules
                for group in fully_shard.state(module)._fsdp_param_groups  # type: ignore[attr-defined]
                for fp in group.fsdp_params
            }
        found = (self._params.get(id(p)) for p in params)
        return [getattr(fp, "_unsharded_param", p) if fp is not None else p for fp, p in zip(found, params)]
