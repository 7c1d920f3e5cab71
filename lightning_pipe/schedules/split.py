"""Split backward (2BP, seed 001) as a pure pass: each B becomes I (input gradient) and W (weight gradient).

``I`` produces the gradient the previous stage waits for; ``W`` is needed only by the
all-reduce and the optimizer step, so it is delayed into time the stage would idle:

- ``"end"`` (GPipe, seed 001 section 3.2): every W after the stage's last I.
- ``"cooldown"`` (1F1B): after each I of the cool-down phase (no forward left to run) the
  stage would wait for the next gradient, so one pending W runs there; the rest at the end.

``max_pending`` bounds how many microbatches may wait for their W (each holds activations
and intermediate gradients): past it a W runs right after the I, as in seed 001's Figure 5.
Pending W's always run before an all-reduce, which needs complete gradients (2BW relies on it).

1F1B, d=2, m=2, stage 0::

    0F0 0F1 0B0 0B1        ->  0F0 0F1 0I0 0W0 0I1 0W1
"""

from __future__ import annotations

from typing import Optional

from lightning_pipe.schedules.actions import Action, Kind

#: Where each schedule puts its weight-gradient actions.
W_PLACEMENT = {"gpipe": "end", "1f1b": "cooldown", "2bw": "cooldown"}


def split_backward(actions: list[Action], placement: str, max_pending: Optional[int] = None) -> list[Action]:
    """Replace every B with I and place the W's by ``placement`` ("end" or "cooldown")."""
    if placement not in ("end", "cooldown"):
        raise ValueError(f"unknown W placement {placement!r}; use 'end' or 'cooldown'")
    if max_pending is not None and max_pending < 0:
        raise ValueError(f"max_pending must be >= 0, got {max_pending}")
    forwards_left = sum(a.kind is Kind.FORWARD for a in actions)
    out: list[Action] = []
    pending: list[Action] = []
    for i, a in enumerate(actions):
        forwards_left -= a.kind is Kind.FORWARD
        if a.kind is Kind.ALL_REDUCE:
            out += pending
            pending = []
        if a.kind is not Kind.BACKWARD:
            out.append(a)
            continue
        out.append(Action(a.stage, Kind.INPUT_GRAD, a.microbatch))
        pending.append(Action(a.stage, Kind.WEIGHT_GRAD, a.microbatch))
        idle_next = placement == "cooldown" and forwards_left == 0 and i < len(actions) - 1
        while pending and (idle_next or (max_pending is not None and len(pending) > max_pending)):
            out.append(pending.pop(0))
            idle_next = False
    return out + pending
