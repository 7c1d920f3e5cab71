"""Undo FSDP2's ``fully_shard`` on a block in place, so that another layout can place it again.

``fully_shard`` changes a module for good: it swaps its class for a dynamic ``FSDP<Class>``,
replaces its parameters with DTensor shards, registers forward and state-dict hooks and keeps its
state in the module's ``__dict__`` and in torch's module-state registry. :func:`unshard_block`
removes each of these, leaving the block of its original class with plain parameters on the meta
device (no values: the caller fills them, as for a block that moves to this rank).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed import _composable_state
from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY
from torch.distributed.fsdp import FSDPModule, fully_shard


def unshard_block(block: nn.Module) -> None:
    """Turn an FSDP-wrapped ``block`` back into a plain module of its own class, in place.

    Its parameters become plain ``nn.Parameter``\\ s on the meta device, shaped as the whole
    (unsharded) tensors, with their ``requires_grad``; buffers stay. Gradients are dropped.

    Raises:
        TypeError: if ``block`` is not wrapped by ``fully_shard``.
    """
    if not isinstance(block, FSDPModule):
        raise TypeError(f"{type(block).__name__} is not wrapped by fully_shard")
    state = fully_shard.state(block)  # type: ignore[attr-defined]
    for group in state._fsdp_param_groups:
        for param in group.fsdp_params:
            _restore_parameter(param)
        for handles in (
            group._module_to_pre_save_state_dict_hook_handle,
            group._module_to_pre_load_state_dict_hook_handle,
        ):
            for handle in handles.values():
                handle.remove()
    state._pre_forward_hook_handle.remove()
    state._post_forward_hook_handle.remove()
    _forget_state(block, state)


def _restore_parameter(param: Any) -> None:
    """Put a plain meta parameter of the whole shape where an ``FSDPParam`` registered its shard."""
    param._post_load_hook_handle.remove()
    info = param._module_info
    whole = nn.Parameter(
        torch.empty(param._orig_size, dtype=param.sharded_param.dtype, device="meta"),
        requires_grad=param.sharded_param.requires_grad,
    )
    info.module._parameters[info.param_name] = whole
    for shared, name in zip(info.shared_modules, info.shared_param_names):
        shared._parameters[name] = whole


def _forget_state(block: nn.Module, state: Any) -> None:
    """Drop every record ``fully_shard`` kept of ``block`` and give it back its own class."""
    for module in block.modules():
        for flag in ("_is_fsdp_managed_module", "_fsdp_use_orig_params"):
            module.__dict__.pop(flag, None)
    _composable_state._module_state_mapping.pop(block, None)
    states = block.__dict__.get(STATE_KEY, {})
    for key in [k for k, v in states.items() if v is state]:
        del states[key]
    block.__dict__.get(REGISTRY_KEY, {}).pop("fully_shard", None)
    block.__class__ = type(block).__mro__[FSDPModule._orig_cls_mro_index]
