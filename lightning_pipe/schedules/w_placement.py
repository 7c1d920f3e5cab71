"""Split backward (2BP, Rae et al.) as a pure pass: each B becomes I (input gradient) and W (weight gradient).

``I`` produces the gradient the previous stage waits for; ``W`` is needed only by the
all-reduce and the optimizer step, so it is delayed into time the stage would idle:

- ``"end"`` (2BP's GPipe, section 3.2): every W after the stage's last I.
- ``"cooldown"`` (2BP's 1F1B): after each I of the cool-down phase (no forward
  left to run) the stage would wait for the next gradient, so one pending W runs there; the
  rest at the end.
- ``"zb-h1"`` (1F1B by default): ``"cooldown"`` with stage ``s`` keeping at most ``s``
  W's waiting, so W of microbatch ``k`` runs right after the I of microbatch ``k + s``. This
  is Zero Bubble's ZB-H1 (Qi et al., 2023, section 2.1): the start of W is delayed by the
  stage's missing warm-up microbatches, so every stage holds the ``d`` microbatches that
  1F1B's first stage holds, and the bubble shrinks from ``(d-1)(F+I+W)`` to ``(d-1)(F+I-W)``.
  Under interleaved 1F1B the bound is the rank's (its first stage's index ``r``), and the
  same holds with per-chunk costs (schedules/interleaved.py).
- ``"bounded"`` (GPipe by default): ZB-H1's bound without the cool-down rule: stage ``s``
  defers W's until ``s`` are waiting, then runs the oldest after each I; the rest before the
  all-reduce. GPipe's backward phase is all cool-down, where ``"cooldown"`` runs each W right
  after its I: the gradient sent upstream then waits for a whole I + W per microbatch, and on
  real blocks I + W costs more than one backward (1.07x on the GPT example's blocks on a CPU),
  so GPipe with split was simulated and measured slower than without. Deferring ``s`` W's lets
  the first gradients go up at I's pace, which covers the stages below, whose backward is
  longer (stage 0's input needs no gradient: its W is its whole backward). Simulated with the
  GPT blocks' costs (stage 0: I = 0, W = B; others I = 0.60 B, W = 0.48 B; F = 0.5 B), GPipe
  with split takes 0.98x plain GPipe's step at d = 2 and 0.93x at d = 4 (m = 8), where
  ``"cooldown"`` took 1.01x and 0.96x (a brute-force search over every stage's bound up to 4
  finds at most 0.3% more). On the benchmark's cost model (2 blocks a stage, 20 ms each in F,
  I and W; stage 0 has one I) it is 0.93x at d = 2 and 0.88x at d = 4, ``"cooldown"`` 0.94x
  and 0.89x; with equal F, I and W on every stage both give 2BP's Table 1.
  ``"end"`` is the same with no bound: it idles stage 0 while gradients arrive and then runs
  its whole backward in a row (1.28x plain GPipe's step with the GPT costs at d = 2).

- ``"carry"`` (2BW's, :func:`carry_split`): every stage but the first keeps one W waiting and
  runs it after its next I, across windows; a batch's last W runs after the stage's next F
  instead, and the batch's all-reduce right after it. 2BW's stream has no bubble for W to
  fill: what a stage waits for in its steady state is the gradient of its next I, a round trip
  through the stages below (two hops). Between sending an activation and reading that
  gradient each stage runs the W held back, so hops up to W / 2 cost nothing (tested with the
  simulator's latency). ``"zb-h1"`` ran the W's held at a batch boundary in a row before the
  all-reduce, which idled the stages above each time: on the cost model (equal F, I and W, 8
  windows after a barrier) 1.049x the unsplit step at d = 4 and 1.070x at d = 8, ``"carry"``
  1.000x; with 3 ms per hop 1.027x and 1.044x against 0.969x and 0.960x. The last W goes
  before the next I rather than after it because stage 0 steps right after its all-reduce
  (schedules/two_bw.py), which waits for every stage's gradient norm: after the next I, the
  stages above would post it a whole F + I + W later (5% slower on the GPT example, measured).
  Stage 0 runs each W right after its I (its input needs no gradient, so its I is empty).
  On a rank of several stages (interleaved 2BW, loop or V placement) each stage keeps its own
  W waiting by the same rule, and the rank's all-reduce of a batch waits for every W of that
  batch on the rank.

- ``"drain"`` (1F1B's memory; PipelinePlan takes it for 1F1B with one stage per rank): only
  the backwards of the cool-down phase split, each W right
  after its I; every earlier backward stays whole. In 1F1B's steady state a stage holds as many
  microbatches as without split, so the peak is 1F1B's; in the drain the gradient leaves a
  W earlier per stage, which is where 1F1B's bubble is. On this CPU the deferred linear split
  costs a little per split microbatch (its forward runs under a function mode, I + W is
  1.02-1.05x B), so splitting few microbatches costs little. Simulated with the GPT
  blocks' costs (above), 1F1B at m = 8 takes 0.970x plain 1F1B's step at d = 2 and 0.927x at
  d = 4 (ZB-H1: 0.976x and 0.874x, with one more microbatch's I-to-W state on the later stages).

``max_pending`` bounds how many microbatches may wait for their W (each holds activations
and intermediate gradients): past it a W runs right after the I, as in 2BP's Figure 5.
Under ``"zb-h1"`` and ``"bounded"`` it replaces the per-stage bound ``s`` (under ``"zb-h1"``,
``max_pending >= m`` gives 2BP's ``"cooldown"``). Pending W's always run before an all-reduce,
which needs complete gradients (2BW relies on it).

1F1B, d=2, m=3 (ZB-H1)::

    stage 0: 0F0 0F1 0B0 0F2 0B1 0B2  ->  0F0 0F1 0I0 0W0 0F2 0I1 0W1 0I2 0W2
    stage 1: 1F0 1B0 1F1 1B1 1F2 1B2  ->  1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1W2
"""

from __future__ import annotations

from typing import Optional, Sequence

from lightning_pipe.schedules.actions import Action, Kind, action

PLACEMENTS = ("end", "cooldown", "zb-h1", "bounded", "drain")


def split_backward(actions: list[Action], placement: str, max_pending: Optional[int] = None) -> list[Action]:
    """Replace every B with I and place the W's by ``placement`` (one of :data:`PLACEMENTS`)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown W placement {placement!r}; use one of {PLACEMENTS}")
    if max_pending is not None and max_pending < 0:
        raise ValueError(f"max_pending must be >= 0, got {max_pending}")
    if placement == "drain":
        return _split_drain(actions)
    if placement in ("zb-h1", "bounded"):
        if max_pending is None and actions:
            max_pending = actions[0].stage
        placement = "cooldown" if placement == "zb-h1" else "end"
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


def _split_drain(actions: list[Action]) -> list[Action]:
    """The ``"drain"`` placement: each backward after the stage's last forward becomes I, then W."""
    forwards_left = sum(a.kind is Kind.FORWARD for a in actions)
    out: list[Action] = []
    for a in actions:
        forwards_left -= a.kind is Kind.FORWARD
        if a.kind is Kind.BACKWARD and forwards_left == 0:
            out += [action(a.stage, Kind.INPUT_GRAD, a.microbatch), action(a.stage, Kind.WEIGHT_GRAD, a.microbatch)]
        else:
            out.append(a)
    return out


def carry_split(parts: Sequence[list[Action]], microbatches: int, steps_before: int = 0) -> list[list[Action]]:
    """2BW's ``"carry"`` placement over consecutive parts of one rank's stream (windows, then the
    drain), over each stage it runs (one, or several under interleaved 2BW): each B becomes I;
    past stage 0 a stage's W waits until that stage's next I has run (one W waiting at most per
    stage, across windows), a W that holds up its batch's all-reduce only until the stage's next
    F. The rank's all-reduce of batch ``b`` (it follows the rank's last backward of ``b``) is
    written once no W of ``b`` waits on any of its stages, its gradients then whole; an optimizer
    step that applies batch ``b`` (the stream's ``b``-th, counting from ``steps_before`` at the
    first part) first writes every W of ``b`` and earlier still waiting. 2BW's step of batch
    ``t - 1`` ends window ``t``, where the last stage has read batch ``t``'s all-reduce too: that
    one stays behind its W.

    Returns:
        Per part, what is written while it is read. A W still waiting after the last part is
        not written: it belongs to the part after (a window's next window, or its drain). The
        first part's output is complete only when the stream starts with it; from the second
        on, each is its part of the whole stream's, provided the part before holds a backward
        of every stage.
    """
    out: list[list[Action]] = [[] for _ in parts]
    state = _RankCarry(microbatches)
    stepped = steps_before
    for written, actions in zip(out, parts):
        state.written = written
        for a in actions:
            if a.kind is Kind.BACKWARD:
                state.backward(a)
            elif a.kind is Kind.ALL_REDUCE:
                state.all_reduce(a)
            elif a.kind is Kind.OPTIMIZER_STEP:
                state.flush(stepped)
                stepped += 1
                written.append(a)
            else:
                written.append(a)
                if a.kind is Kind.FORWARD:
                    state.forward(a.stage)
    return out


class _RankCarry:
    """:func:`carry_split`'s state: each stage's waiting W's and the all-reduces they hold up."""

    def __init__(self, microbatches: int) -> None:
        self.microbatches = microbatches
        self.written: list[Action] = []
        self.waiting: dict[int, list[Action]] = {}  # per stage, oldest first
        self.reduces: list[tuple[int, Action]] = []  # (batch, its all-reduce) held up by W's
        self.last_batch = -1  # the batch of the last backward read

    def _batch(self, a: Action) -> int:
        return a.microbatch // self.microbatches

    def _held(self, batch: int) -> bool:
        return any(self._batch(w) <= batch for ws in self.waiting.values() for w in ws)

    def _write(self, w: Action) -> None:
        self.waiting[w.stage].remove(w)
        self.written.append(w)
        while self.reduces and not self._held(self.reduces[0][0]):
            self.written.append(self.reduces.pop(0)[1])

    def backward(self, a: Action) -> None:
        """An I now; its W waits (stage 0: none waits)."""
        self.last_batch = self._batch(a)
        self.written.append(action(a.stage, Kind.INPUT_GRAD, a.microbatch))
        mine = self.waiting.setdefault(a.stage, [])
        mine.append(action(a.stage, Kind.WEIGHT_GRAD, a.microbatch))
        while len(mine) > min(a.stage, 1):
            self._write(mine[0])

    def all_reduce(self, a: Action) -> None:
        """Now, or once the last W of its batch is written."""
        if self._held(self.last_batch):
            self.reduces.append((self.last_batch, a))
        else:
            self.written.append(a)

    def forward(self, stage: int) -> None:
        """After a stage's F: its W's that hold up an all-reduce."""
        if self.reduces:
            for w in [w for w in self.waiting.get(stage, []) if self._batch(w) <= self.reduces[-1][0]]:
                self._write(w)

    def flush(self, batch: int) -> None:
        """Before the step that applies ``batch``: every W of it and earlier, by microbatch (the
        later stage's first, as their I's ran)."""
        for w in sorted(
            (w for ws in self.waiting.values() for w in ws if self._batch(w) <= batch),
            key=lambda w: (w.microbatch, -w.stage),
        ):
            self._write(w)
