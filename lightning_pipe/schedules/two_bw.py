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

Interleaved 2BW (``virtual_stages = v > 1``, loop placement): rank ``r`` runs the never-flushed
stream of Megatron-LM's interleaved 1F1B (schedules/interleaved.py) over its stages ``r, r + d,
...``: forwards in rounds of ``d`` microbatches per stage, warm-up ``W = 2 (d-1-r) + (v-1) d``
forwards, then pairs ``F(W+i) B(i)`` in the rank's own forward and backward order. Batch ``t``
is the rank's forwards ``t m v .. (t+1) m v - 1`` (``m`` a multiple of ``d``), so window ``t``
runs them, each stage's ``V(t*m)`` right before that stage's first forward of the batch. The
two weight versions, the AR after the rank's last backward of a batch, the deferred ``OPT`` (rank
0 ``early``) and the drain follow the rules above, one weight version per rank holding every
stage's weights; with split backward each stage of the rank keeps its own W waiting by the carry
rule (schedules/w_placement.py, ``carry_split``). A batch's backwards must end before the
next batch's forwards begin (they run on the version its step writes):
``m v >= 2 (d-1) + (v-1) d``, rank 0's warm-up.

d=2, v=2, m=2, one step then a drain, rank 0 (stages 0, 2; ``W=4``) and rank 1 (stages 1, 3; ``W=2``)::

    rank 0: [0V0 0F0 0F1 2V0 2F0 2F1] [2B0 2B1 0B0 0B1 0AR 0OPT]
    rank 1: [1V0 1F0 1F1 3V0 3F0 3B0 3F1 3B1] [1B0 1B1 1AR 1OPT]

2BW in a V (``virtual_stages = 2``, ``placement="v"``: rank ``r`` holds stages ``r`` and
``2d-1-r``, schedules/layout.py). Each of the ``2d`` stages runs 2BW's never-flushed 1F1B stream
over the chain of ``2d`` stages: stage ``s`` keeps ``2d-1-s`` microbatches in flight, so the
rank's first stage (chunk 0) ``2d-1-r`` and its second (chunk 1) ``r``, as in ZB-V's steady
state (Zero Bubble paper, section 6). A *unit* of a stage is its next forward and, past its
warm-up, its oldest backward. The rank runs its chunks' units in ZB-V's steady order (chunk 0's,
then chunk 1's), chunk 0 leading by ``L = d-1-r`` units, ZB-V's steady forward lead: chunk 1's
forward of a microbatch waits for it to cross the ``2(d-1-r)`` stages in between. Two rules
bind the windows to the runtime:

- The runtime admits a batch's data with its step and sums its loss within it, so each stage
  runs all of batch ``t``'s forwards in window ``t``: the lead is taken anew in every window
  (``L`` units of chunk 0 alone open it, ``L`` of chunk 1 alone close it).
- A window reads exactly the next messages each neighbour sent (runtime/comm/mailbox.py posts
  only receives it will read), and the rank below reads the gradient of a rank's last chunk-0
  backward of a window in its next window: that backward runs at the window's end, after every
  activation the rank sends down in the window.

With unit costs a window takes ``4m + 2d - 3`` where the rank's work is ``4m``: the first and
last stage share rank 0, so batch ``t + 1``'s first forward waits there for the lead of batch
``t`` to drain (flushed ZB-V without split backward takes ``4m + 2(d-1)``; the loop placement's
stream has no such bubble). The weight versions, the AR after the rank's last backward of a
batch, the deferred ``OPT`` (rank 0 ``early``: it holds stage 0, which finishes every batch
last) and the drain follow the rules above. Batch ``t``'s backwards must end in window ``t + 1``,
before its step: ``m >= 2d - 1``, stage 0's warm-up. Split backward places each stage's W's by
the carry rule (schedules/w_placement.py, ``carry_split``), as under the loop placement.

d=2, m=3, one step then a drain, rank 0 (stages 0, 3; ``L=1``) and rank 1 (stages 1, 2; ``L=0``)::

    rank 0: [0V0 0F0 0F1 3V0 3F0 3B0 0F2 3F1 3B1 3F2 3B2] [0B0 0B1 0B2 0AR 0OPT]
    rank 1: [1V0 1F0 2V0 2F0 1F1 2F1 2B0 1F2 2F2 2B1 1B0] [1B1 2B2 1B2 1AR 1OPT]
"""

from __future__ import annotations

from lightning_pipe.schedules import interleaved
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


def interleaved_warmup(rank: int, depth: int, virtual: int) -> int:
    """Forwards rank ``rank`` runs before its first backward (Megatron-LM's interleaved 1F1B)."""
    return 2 * (depth - 1 - rank) + (virtual - 1) * depth


def check_interleaved(depth: int, microbatches: int, virtual: int) -> None:
    """Interleaved 2BW needs rounds of ``d`` microbatches and ``m v >= 2 (d-1) + (v-1) d``:
    otherwise rank 0 would run the next batch's forwards, on the weights the step it has not
    yet run writes, before this batch's backwards (a third weight version)."""
    interleaved.check(depth, microbatches, virtual)
    warmup = interleaved_warmup(0, depth, virtual)
    if microbatches * virtual < warmup:
        need = next(m for m in range(depth, warmup + depth + 1, depth) if m * virtual >= warmup)
        raise ValueError(
            f"interleaved 2BW needs microbatches x virtual_stages >= 2 (pipeline_depth - 1) + "
            f"(virtual_stages - 1) pipeline_depth = {warmup}, rank 0's warm-up (got m={microbatches}, "
            f"d={depth}, v={virtual}): with fewer, in-flight microbatches would need a third weight version; "
            f"use microbatches >= {need}"
        )


def _rank_backward(rank: int, depth: int, microbatches: int, virtual: int, k: int, step_now: bool) -> list[Action]:
    """The rank's ``k``-th backward, then its AR (and with ``step_now`` its OPT) after a batch's last."""
    done = k % (microbatches * virtual) == microbatches * virtual - 1
    closing = [action(rank, Kind.ALL_REDUCE)] + ([action(rank, Kind.OPTIMIZER_STEP)] if step_now else [])
    return [interleaved.compute_action(rank, depth, virtual, k, Kind.BACKWARD)] + (closing if done else [])


def rank_window(rank: int, depth: int, microbatches: int, step: int, virtual: int, early: bool = True) -> list[Action]:
    """Interleaved 2BW: rank ``rank``'s compute, version, all-reduce and optimizer actions of
    training step ``step`` over its ``virtual`` stages (see above); ``early``: rank 0 steps right
    after its all-reduce."""
    check_interleaved(depth, microbatches, virtual)
    warmup, per = interleaved_warmup(rank, depth, virtual), microbatches * virtual
    now = early and rank == 0
    actions: list[Action] = []
    for k in range(step * per, (step + 1) * per):
        forward = interleaved.compute_action(rank, depth, virtual, k, Kind.FORWARD)
        if forward.microbatch == step * microbatches:  # the stage's first forward of the batch
            actions.append(action(forward.stage, Kind.VERSION, forward.microbatch))
        actions.append(forward)
        if k >= warmup:
            actions += _rank_backward(rank, depth, microbatches, virtual, k - warmup, now)
    return actions + ([action(rank, Kind.OPTIMIZER_STEP)] if step >= 1 and not now else [])


def rank_drain(rank: int, depth: int, microbatches: int, last_step: int, virtual: int) -> list[Action]:
    """Interleaved 2BW: finish rank ``rank``'s stream after step ``last_step``: its remaining
    backwards, AR and OPT."""
    end = (last_step + 1) * microbatches * virtual
    warmup = interleaved_warmup(rank, depth, virtual)
    tail = [a for k in range(end - warmup, end) for a in _rank_backward(rank, depth, microbatches, virtual, k, False)]
    return tail + [action(rank, Kind.OPTIMIZER_STEP)]


def check_v(depth: int, microbatches: int, virtual: int) -> None:
    """2BW in a V needs two stages per rank and ``m >= 2d - 1``: otherwise stage 0 would still
    run batch ``t``'s backwards after its rank's step for ``t`` (a third weight version)."""
    if virtual != 2:
        raise ValueError(
            f"2BW in a V runs two stages per rank (stages r and 2d-1-r): set virtual_stages=2 (got {virtual})"
        )
    if microbatches < 2 * depth - 1:
        raise ValueError(
            f"2BW in a V needs microbatches >= 2 pipeline_depth - 1 = {2 * depth - 1}, stage 0's warm-up "
            f"(got m={microbatches}, d={depth}): with fewer, in-flight microbatches would need a third "
            f"weight version; use microbatches >= {2 * depth - 1}"
        )


def _v_unit(stage: int, k: int, warmup: int) -> list[Action]:
    """Stage ``stage``'s ``k``-th unit: forward ``k`` and, past its warm-up, backward ``k - warmup``."""
    return [action(stage, Kind.FORWARD, k)] + ([action(stage, Kind.BACKWARD, k - warmup)] if k >= warmup else [])


def _v_compute(rank: int, depth: int, microbatches: int, step: int) -> list[Action]:
    """2BW in a V: rank ``rank``'s forwards, versions and backwards of window ``step`` (see above)."""
    first, second = rank, 2 * depth - 1 - rank
    lead, base = depth - 1 - rank, step * microbatches
    units0 = [_v_unit(first, base + i, 2 * depth - 1 - rank) for i in range(microbatches)]
    units1 = [_v_unit(second, base + i, rank) for i in range(microbatches)]
    out = [action(first, Kind.VERSION, base)]
    for i in range(microbatches + lead):
        out += units0[i] if i < microbatches else []
        out += [action(second, Kind.VERSION, base)] if i == lead else []
        out += units1[i - lead] if i >= lead else []
    last = units0[-1][1:]  # the window's last chunk-0 backward, if its unit has one
    if rank and last:  # the rank below reads its gradient in its next window: sent after this one's messages
        out.remove(last[0])
        out.append(last[0])
    return out


def _close_batch(actions: list[Action], rank: int, microbatches: int, batch: int, step_now: bool) -> list[Action]:
    """``actions`` with the AR (and with ``step_now`` the OPT) right after the last backward of
    ``batch`` among them: where the rank has run all of that batch's backwards."""
    ends = [i for i, a in enumerate(actions) if a.kind is Kind.BACKWARD and a.microbatch // microbatches == batch]
    if not ends:
        return actions
    closing = [action(rank, Kind.ALL_REDUCE)] + ([action(rank, Kind.OPTIMIZER_STEP)] if step_now else [])
    return actions[: ends[-1] + 1] + closing + actions[ends[-1] + 1 :]


def v_window(rank: int, depth: int, microbatches: int, step: int, early: bool = True) -> list[Action]:
    """2BW in a V: rank ``rank``'s compute, version, all-reduce and optimizer actions of training
    step ``step`` over its stages ``rank`` and ``2 depth - 1 - rank`` (see above); ``early``: rank
    0 steps right after its all-reduce."""
    check_v(depth, microbatches, 2)
    now = early and rank == 0
    actions = _close_batch(_v_compute(rank, depth, microbatches, step), rank, microbatches, step - 1, now)
    return actions + ([action(rank, Kind.OPTIMIZER_STEP)] if step >= 1 and not now else [])


def v_drain(rank: int, depth: int, microbatches: int, last_step: int) -> list[Action]:
    """2BW in a V: finish rank ``rank``'s stream after step ``last_step``: the backwards still in
    flight, by microbatch (chunk 1's first: it is the later stage), then the AR and OPT."""
    end = (last_step + 1) * microbatches
    first, second = rank, 2 * depth - 1 - rank
    tail = [action(first, Kind.BACKWARD, k) for k in range(end - (2 * depth - 1 - rank), end)]
    tail += [action(second, Kind.BACKWARD, k) for k in range(end - rank, end)]
    tail.sort(key=lambda a: (a.microbatch, a.stage != second))
    return _close_batch(tail, rank, microbatches, last_step, False) + [action(rank, Kind.OPTIMIZER_STEP)]
