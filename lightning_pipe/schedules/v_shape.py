"""Schedules of the V-shaped placement (two stages per rank: ``r`` and ``2d - 1 - r``): ZB-V and DualPipeV.

**ZB-V** (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 6). Every backward
is split into I (input gradient) and W (weight gradient). Rank ``r`` (chunk 0 is stage ``r``,
chunk 1 stage ``2d - 1 - r``) runs, in the paper's figure's phases:

1. ``2 (d - r) - 1`` forwards of chunk 0;
2. ``r`` pairs: F of chunk 1, F of chunk 0;
3. ``d - r`` triples of chunk 1: F, I, W;
4. the steady state: F, I, W of chunk 0 (F while any is left), then F, I, W of chunk 1;
5. the cool-down: ``r`` pairs I of chunk 0, I of chunk 1 (their W's wait), then ``d - r``
   pairs I of chunk 0, W of the oldest waiting chunk-0 microbatch, then every W left (chunk
   1's, then chunk 0's).

With per-chunk costs ``F = I = W`` every rank is busy from its first action to its last (the
paper's bubble, its idle time within that span, is 0) and rank ``r`` holds at most ``2d``
chunk-microbatches: ``d`` microbatches of its whole share of the model, 1F1B's peak (the
paper's Table: "activation memory 1x 1F1B's"). With ``m < 2d - 1`` the actions of the absent
microbatches are dropped (the schedule of ``2d - 1`` microbatches, thinned).

**DualPipeV** (DeepSeek-V3 technical report, 2024, DualPipe; its V-shaped, "cut-in-half" form
from DeepSeek's DualPipe repository, as torch.distributed.pipelining's ``ScheduleDualPipeV``).
It needs ``m >= 2d``. Rank ``r`` runs:

1. ``2 (d - r - 1)`` forwards of chunk 0;
2. ``r + 1`` pairs F of chunk 0, F of chunk 1;
3. ``d - r - 1`` triples I of chunk 1, the oldest waiting W, F of chunk 1;
4. the main phase, ``m - 2d + r + 1`` rounds of two overlapped pairs: F of chunk 0 with the
   whole B of chunk 1, then F of chunk 1 with B of chunk 0 (DualPipe overlaps a forward with a
   backward of another microbatch, so one's communication hides under the other's compute;
   here they run one after the other);
5. ``d - r - 1`` pairs B of chunk 1, then F of chunk 1 with B of chunk 0;
6. ``r + 1`` pairs B of chunk 1, B of chunk 0, the second half of them split (I, W waits);
7. ``d - r - 1`` pairs: the oldest waiting W, then the next backward of chunk 0;
8. the W's still waiting.

DualPipe's table (DeepSeek's DualPipe repository) gives DualPipeV ``PP + 1`` microbatches of
activations per rank, ``PP = 2d`` being the stages of the chain here: rank ``r`` holds at most
``2d + 1`` chunk-microbatches, one more than ZB-V. Its bubble (DeepSeek-V3 technical report,
Table 2) is ``(PP/2 - 1)(F&B + B - 3W)``, ``F&B`` a forward and a backward run as one overlapped
pair, ``B`` a whole backward. This runtime runs a pair's two actions one after the other
(``F&B = F + B``); with that, no rank idles longer than the formula within a step (tested over
several costs; with ``F = I = W`` it idles ``(d - 1) F``, half the formula's ``2 (d - 1) F``).
"""

from __future__ import annotations

from collections import Counter

from lightning_pipe.schedules.actions import Action, Kind, action


class _Writer:
    """One rank's actions as they are written, numbering each stage's microbatches per kind."""

    def __init__(self) -> None:
        self.out: list[Action] = []
        self.next: Counter = Counter()
        self.waiting: list[Action] = []  # W's not written yet, oldest first

    def write(self, stage: int, kind: Kind) -> None:
        """Write ``kind`` of ``stage``'s next microbatch (a whole B counts as its I and its W)."""
        counter = Kind.INPUT_GRAD if kind is Kind.BACKWARD else kind
        k = self.next[stage, counter]
        self.next[stage, counter] += 1
        if kind is Kind.BACKWARD:
            self.next[stage, Kind.WEIGHT_GRAD] += 1
        self.out.append(action(stage, kind, k))
        if kind is Kind.INPUT_GRAD:
            self.waiting.append(action(stage, Kind.WEIGHT_GRAD, k))

    def weight(self, stage: int) -> None:
        """Write the oldest waiting W of ``stage``."""
        w = next(w for w in self.waiting if w.stage == stage)
        self.waiting.remove(w)
        self.out.append(w)

    def oldest_weight(self) -> None:
        """Write the oldest waiting W of any stage, if one waits."""
        if self.waiting:
            self.out.append(self.waiting.pop(0))


def zbv(rank: int, depth: int, microbatches: int) -> list[Action]:
    """Rank ``rank``'s compute actions (F, I, W of stages ``rank`` and ``2 depth - 1 - rank``) of ZB-V."""
    d, r = depth, rank
    n = max(microbatches, 2 * d - 1)  # the schedule of at least 2d - 1 microbatches, thinned below
    first, second = r, 2 * d - 1 - r
    w = _Writer()
    for _ in range(2 * (d - r) - 1):
        w.write(first, Kind.FORWARD)
    for _ in range(r):
        w.write(second, Kind.FORWARD)
        w.write(first, Kind.FORWARD)
    for _ in range(d - r):
        for kind in (Kind.FORWARD, Kind.INPUT_GRAD):
            w.write(second, kind)
        w.weight(second)
    while w.next[second, Kind.FORWARD] < n:
        if w.next[first, Kind.FORWARD] < n:
            w.write(first, Kind.FORWARD)
        w.write(first, Kind.INPUT_GRAD)
        w.weight(first)
        for kind in (Kind.FORWARD, Kind.INPUT_GRAD):
            w.write(second, kind)
        w.weight(second)
    for _ in range(r):
        w.write(first, Kind.INPUT_GRAD)
        w.write(second, Kind.INPUT_GRAD)
    for _ in range(d - r):
        w.write(first, Kind.INPUT_GRAD)
        w.weight(first)
    for stage in (second, first):
        while any(x.stage == stage for x in w.waiting):
            w.weight(stage)
    return [a for a in w.out if a.microbatch < microbatches]


def dualpipev(rank: int, depth: int, microbatches: int) -> list[Action]:
    """Rank ``rank``'s compute actions (stages ``rank`` and ``2 depth - 1 - rank``) of DualPipeV (``m >= 2d``)."""
    d, r = depth, rank
    first, second = r, 2 * d - 1 - r
    w = _Writer()
    for _ in range(2 * (d - r - 1)):
        w.write(first, Kind.FORWARD)
    for _ in range(r + 1):
        w.write(first, Kind.FORWARD)
        w.write(second, Kind.FORWARD)
    for _ in range(d - r - 1):
        w.write(second, Kind.INPUT_GRAD)
        w.oldest_weight()
        w.write(second, Kind.FORWARD)
    for _ in range(microbatches - 2 * d + r + 1):
        w.write(first, Kind.FORWARD)
        w.write(second, Kind.BACKWARD)
        w.write(second, Kind.FORWARD)
        w.write(first, Kind.BACKWARD)
    for _ in range(d - r - 1):
        w.write(second, Kind.BACKWARD)
        w.write(second, Kind.FORWARD)
        w.write(first, Kind.BACKWARD)
    split = False
    for i in range(r + 1):  # the second half of the drain splits its backwards: their W's fill the gaps after
        split |= i == (r + 1) // 2 and r % 2 == 1
        w.write(second, Kind.INPUT_GRAD if split else Kind.BACKWARD)
        split |= i == (r + 1) // 2 and r % 2 == 0
        w.write(first, Kind.INPUT_GRAD if split else Kind.BACKWARD)
    for _ in range(d - r - 1):
        w.oldest_weight()
        w.write(first, Kind.INPUT_GRAD if split else Kind.BACKWARD)
    while w.waiting:
        w.oldest_weight()
    return w.out


def join_backward(actions: list[Action]) -> list[Action]:
    """A program without split backward: each I becomes the whole B, run where the I ran; its W is dropped."""
    return [
        action(a.stage, Kind.BACKWARD, a.microbatch) if a.kind is Kind.INPUT_GRAD else a
        for a in actions
        if a.kind is not Kind.WEIGHT_GRAD
    ]
