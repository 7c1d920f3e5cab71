"""Weight versions of one stage: one slot for flushed schedules, two for PipeDream-2BW.

2BW (PipeDream-2BW paper, section 3.1): batch ``b`` runs forward and backward on slot ``b % 2``, which
holds version ``max(b-1, 0)``. The deferred step for batch ``b`` overwrites that same slot,
once batch ``b`` has left the pipeline, with the newest weights minus the step:
``W(b+1) = W(b) - lr * grad f(W(b-1))``. So at most two versions are ever alive, and the
optimizer's state is moved to the slot it steps rather than copied (no shadow state).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn
from torch.optim import Optimizer


def move_optimizer(optimizer: Optimizer, old: list[Tensor], new: list[Tensor]) -> None:
    """Point ``optimizer`` (param groups and state) at ``new`` in place of ``old``, position by position."""
    mapping = {id(o): n for o, n in zip(old, new)}
    for group in optimizer.param_groups:
        group["params"] = [mapping.get(id(p), p) for p in group["params"]]
    for o, n in zip(old, new):
        if o in optimizer.state:
            optimizer.state[n] = optimizer.state.pop(o)


class WeightVersions:
    """The weight slots of one stage and which version each holds.

    Args:
        params: the stage's parameters (slot 0; the module keeps pointing at these).
        double: keep two slots (2BW) instead of one (flushed schedules).
    """

    def __init__(self, params: list[nn.Parameter], double: bool) -> None:
        self.double = double
        self.slots: list[Optional[list[Tensor]]] = [list(params), None]
        self.versions: list[Optional[int]] = [0, None]
        self.peak_live = 1

    def slot_of(self, batch: int) -> int:
        """Slot that batch ``batch`` (counted since the last drain) runs on."""
        return batch % 2 if self.double else 0

    def weights(self, batch: int) -> Optional[list[Tensor]]:
        """Tensors batch ``batch`` runs on, or ``None`` for the module's own parameters."""
        slot = self.slot_of(batch)
        if slot == 1 and self.slots[1] is None:
            self.slots[1] = [nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad) for p in self.slots[0]]
            self.versions[1] = self.versions[0]
        return None if slot == 0 else self.slots[1]

    def grads_of(self, batch: int) -> list[Tensor]:
        """The tensors whose ``.grad`` holds batch ``batch``'s gradient."""
        self.weights(batch)
        return self.slots[self.slot_of(batch)]

    def clear_grads(self, slot: int = 0) -> None:
        """Drop the gradients held by ``slot``."""
        for p in self.slots[slot] or ():
            p.grad = None

    def live_versions(self) -> int:
        """How many distinct weight versions this stage holds now."""
        return len({v for v in self.versions if v is not None})

    def begin_step(self, batch: int, optimizer: Optimizer) -> list[Tensor]:
        """Prepare batch ``batch``'s deferred step: its slot takes the newest weights and the optimizer.

        Returns:
            The tensors to step (their ``.grad`` already holds the batch's gradient).
        """
        target = self.slot_of(batch)
        newest = self.slot_of(batch + 1)
        if target != newest and self.slots[newest] is not None:  # None: a drain after the first batch
            self.peak_live = max(self.peak_live, self.live_versions())
            with torch.no_grad():
                for t, n in zip(self.slots[target], self.slots[newest]):
                    t.copy_(n)
            move_optimizer(optimizer, self.slots[newest], self.slots[target])
        return self.slots[target]

    def end_step(self, batch: int) -> None:
        """Record that batch ``batch``'s slot now holds version ``batch + 1``.

        Under 2BW the slot's gradients are cleared for the batch after next; with one slot they
        stay readable until the next step starts (as after ``optimizer.step()``)."""
        target = self.slot_of(batch)
        self.versions[target] = batch + 1
        if self.double:
            self.clear_grads(target)
        self.peak_live = max(self.peak_live, self.live_versions())

    def collapse(self, optimizer: Optional[Optimizer], last_batch: int) -> None:
        """After a drain whose last step was batch ``last_batch``'s: put the newest weights (and
        the optimizer) back on the module's slot 0 and free slot 1."""
        newest = self.slot_of(last_batch)
        if newest == 1 and self.slots[1] is not None:
            with torch.no_grad():
                for a, b in zip(self.slots[0], self.slots[1]):
                    a.copy_(b)
            if optimizer is not None:
                move_optimizer(optimizer, self.slots[1], self.slots[0])
        self.versions[0] = self.versions[newest] if self.versions[newest] is not None else self.versions[0]
        self.slots[1], self.versions[1] = None, None
