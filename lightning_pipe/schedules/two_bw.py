"""PipeDream-2BW (PipeDream-2BW paper, section 3.1) as data: one window of a never-flushed 1F1B stream per step.

Stage ``s`` runs the continuous 1F1B stream ``F0 .. F(W-1)`` then pairs ``F(W+i) B(i)`` with
warm-up ``W = d-1-s``. Training step ``t`` runs the window holding the forwards of batch
``t`` (microbatches ``t*m .. (t+1)*m-1``, numbered across steps), so the forwards of batch
``t+1`` overlap the backwards of batch ``t`` and there is no flush between steps.

Placement, with ``m >= d`` so every window's backwards finish the previous batch:

- ``V(t*m)`` opens each window: the forwards that follow use batch ``t``'s weight version,
  ``max(t-1, 0)``, i.e. ``max(floor((k-1)/m) - 1, 0)`` for 1-indexed microbatch ``k``.
- ``AR`` follows the backward of each batch's last microbatch (replica all-reduce).
- ``OPT`` (the deferred step) ends window ``t >= 1`` and applies batch ``t-1``'s coalesced
  gradient, computed on ``W(t-2)``, to the newest weights:
  ``W(t) = W(t-1) - lr * grad f(W(t-2))``. Placing it at the same point on every stage keeps
  cross-stage collectives (global gradient norm) off the critical path. Stage 0 is the
  exception (``early``, the default): it finishes each batch's backwards last, when every
  other stage has posted its norm, so it steps right after its ``AR``, before the next
  batch's first backward: it never holds two batches' gradients (the others hold both until
  the window ends). Not with weights tied across stages, whose step waits for every stage.
- A drain (before validation, checkpoints and the end of fit) runs the remaining backwards,
  the last ``AR`` and ``OPT``.

d=2, m=2, two steps then a drain, stage 0 (``W=1``) and stage 1 (``W=0``)::

    stage 0: [0V0 0F0 0F1 0B0] [0V2 0F2 0B1 0AR 0OPT 0F3 0B2] [0B3 0AR 0OPT]
    stage 1: [1V0 1F0 1B0 1F1 1B1 1AR] [1V2 1F2 1B2 1F3 1B3 1AR 1OPT] [1OPT]
"""

from __future__ import annotations

from lightning_pipe.schedules.actions import Action, Kind, action


def check_microbatches(depth: int, microbatches: int) -> None:
    """2BW needs ``m >= d``: otherwise a third weight version would be in flight."""
    if microbatches < depth:
        raise ValueError(
            f"schedule '2bw' needs microbatches >= pipeline_depth (got m={microbatches}, d={depth}); "
            "with fewer, in-flight microbatches would need a third weight version"
        )


def _backward(stage: int, k: int, microbatches: int, step_now: bool = False) -> list[Action]:
    done = [action(stage, Kind.ALL_REDUCE)] if k % microbatches == microbatches - 1 else []
    step = [action(stage, Kind.OPTIMIZER_STEP)] if done and step_now else []
    return [action(stage, Kind.BACKWARD, k)] + done + step


def window(stage: int, depth: int, microbatches: int, step: int, early: bool = True) -> list[Action]:
    """Compute, all-reduce, version and optimizer actions of training step ``step``; ``early``:
    stage 0 steps right after its all-reduce instead of at the window's end (see above)."""
    check_microbatches(depth, microbatches)
    warmup = depth - 1 - stage
    first = step * microbatches
    now = early and stage == 0 and depth > 1  # there batch step-1's last backward runs inside this window (m >= d)
    actions = [action(stage, Kind.VERSION, first)]
    for k in range(first, first + microbatches):
        actions.append(action(stage, Kind.FORWARD, k))
        if k >= warmup:
            actions += _backward(stage, k - warmup, microbatches, now)
    return actions + ([action(stage, Kind.OPTIMIZER_STEP)] if step >= 1 and not now else [])


def drain(stage: int, depth: int, microbatches: int, last_step: int) -> list[Action]:
    """Finish the stream after step ``last_step``: its remaining backwards, AR and OPT."""
    end = (last_step + 1) * microbatches
    warmup = depth - 1 - stage
    tail = [a for k in range(end - warmup, end) for a in _backward(stage, k, microbatches)]
    return tail + [action(stage, Kind.OPTIMIZER_STEP)]
