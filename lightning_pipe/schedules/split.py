"""Split backward (2BP, seed 001) as a pure pass: each B becomes I (input gradient) and W (weight gradient).

``I`` produces the gradient the previous stage waits for; ``W`` is needed only by the
all-reduce and the optimizer step, so it is delayed into time the stage would idle:

- ``"end"`` (seed 001 section 3.2's GPipe): every W after the stage's last I.
- ``"cooldown"`` (1F1B, seed 001's 2BP; GPipe by default): after each I of the cool-down
  phase (no forward left to run) the stage would wait for the next gradient, so one pending W
  runs there; the rest at the end. For GPipe this beats ``"end"`` once I and W differ by
  stage: on the first stage I is empty and W is the whole backward, so deferring every W
  leaves the stage idle while gradients arrive and then runs them all in a row. With the GPT
  example's costs at d = 2, m = 8 the simulator gives ``"end"`` 1.25x plain GPipe's step and
  ``"cooldown"`` 0.97x (equal F, I, W: both the same as seed 001's Table 1); measured on 2
  CPU processes, ``"end"`` ran at 0.71-0.79x plain GPipe and ``"cooldown"`` at 0.79-0.92x.
- ``"zb-h1"`` (1F1B and 2BW by default): ``"cooldown"`` with stage ``s`` keeping at most ``s``
  W's waiting, so W of microbatch ``k`` runs right after the I of microbatch ``k + s``. This
  is Zero Bubble's ZB-H1 (Qi et al., 2023, section 2.1): the start of W is delayed by the
  stage's missing warm-up microbatches, so every stage holds the ``d`` microbatches that
  1F1B's first stage holds, and the bubble shrinks from ``(d-1)(F+I+W)`` to ``(d-1)(F+I-W)``.
  Under interleaved 1F1B the bound is the rank's (its first stage's index ``r``), and the
  same holds with per-chunk costs (schedules/interleaved.py).

``max_pending`` bounds how many microbatches may wait for their W (each holds activations
and intermediate gradients): past it a W runs right after the I, as in seed 001's Figure 5.
Under ``"zb-h1"`` it replaces the per-stage bound ``s`` (``max_pending >= m`` gives 2BP's
``"cooldown"``). Pending W's always run before an all-reduce, which needs complete gradients
(2BW relies on it).

1F1B, d=2, m=3 (ZB-H1)::

    stage 0: 0F0 0F1 0B0 0F2 0B1 0B2  ->  0F0 0F1 0I0 0W0 0F2 0I1 0W1 0I2 0W2
    stage 1: 1F0 1B0 1F1 1B1 1F2 1B2  ->  1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1W2
"""

from __future__ import annotations

from typing import Optional

from lightning_pipe.schedules.actions import Action, Kind, action

#: Where each schedule puts its weight-gradient actions.
W_PLACEMENT = {"gpipe": "cooldown", "1f1b": "zb-h1", "2bw": "zb-h1"}
PLACEMENTS = ("end", "cooldown", "zb-h1")


def split_backward(actions: list[Action], placement: str, max_pending: Optional[int] = None) -> list[Action]:
    """Replace every B with I and place the W's by ``placement`` (one of :data:`PLACEMENTS`)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown W placement {placement!r}; use one of {PLACEMENTS}")
    if max_pending is not None and max_pending < 0:
        raise ValueError(f"max_pending must be >= 0, got {max_pending}")
    if placement == "zb-h1":
        placement = "cooldown"
        if max_pending is None and actions:
            max_pending = actions[0].stage
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
        out.append(action(a.stage, Kind.INPUT_GRAD, a.microbatch))
        pending.append(action(a.stage, Kind.WEIGHT_GRAD, a.microbatch))
        idle_next = placement == "cooldown" and forwards_left == 0 and i < len(actions) - 1
        while pending and (idle_next or (max_pending is not None and len(pending) > max_pending)):
            out.append(pending.pop(0))
            idle_next = False
    return out + pending
