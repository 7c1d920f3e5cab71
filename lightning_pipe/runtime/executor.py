"""Runs one rank's action list with real tensors: a dispatch table from action kind to handler."""

from __future__ import annotations

from collections import Counter, deque
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_pipe.runtime import p2p, split
from lightning_pipe.runtime.stage import Stage, Tensors, as_tuple
from lightning_pipe.schedules.actions import Action, Kind
from lightning_pipe.timeline import Trace, now


@dataclass(frozen=True)
class Position:
    """Where a rank sits in its pipeline: stage index, depth and neighbouring global ranks."""

    stage: int
    depth: int
    prev_rank: Optional[int]
    next_rank: Optional[int]

    @property
    def is_first(self) -> bool:
        """Whether this rank reads the data batch."""
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        """Whether this rank computes the loss."""
        return self.stage == self.depth - 1


@dataclass
class Hooks:
    """What the executor calls back into: user code and the engine's whole-batch actions."""

    inputs: Callable[[Any], Any]
    loss: Callable[[Any, Any], Tensor]
    all_reduce: Callable[[], None] = lambda: None
    optimizer_step: Callable[[], Optional[float]] = lambda: None
    weights: Callable[[int], Optional[list[Tensor]]] = lambda first_microbatch: None
    loss_done: Callable[[Tensor], None] = lambda loss_sum: None
    weights_accumulated: Callable[[list[Tensor]], None] = lambda weights: None


class Outbox:
    """Messages posted to one peer, kept (so their tensors stay alive) until known delivered.

    Gloo's send handles report completion only once waited on, so completion is learned from
    the peer: every header carries how many messages its sender has received so far, and
    waiting on those sends returns at once. Without this a step held every microbatch's sent
    tensors to its end, and a 2BW stream (which never waits) held them forever.
    """

    def __init__(self) -> None:
        self.posted = 0
        self.messages: deque[tuple[int, list[dist.Work], Tensors]] = deque()

    def post(self, works: list[dist.Work], tensors: Tensors) -> None:
        """Keep one just-posted message."""
        self.messages.append((self.posted, works, tensors))
        self.posted += 1

    def release(self, delivered: int) -> None:
        """Drop the first ``delivered`` messages (the peer has them) and any reported complete."""
        kept: deque[tuple[int, list[dist.Work], Tensors]] = deque()
        for index, works, tensors in self.messages:
            if index < delivered:
                for work in works:
                    work.wait()
            elif not all(w.is_completed() for w in works):
                kept.append((index, works, tensors))
        self.messages = kept

    def wait(self) -> None:
        """Wait for every message still kept."""
        for _, works, _ in self.messages:
            for work in works:
                work.wait()
        self.messages.clear()


@dataclass
class StepState:
    """Everything kept between actions, keyed by microbatch (2BW keeps it across steps)."""

    microbatches: dict[int, Any]
    shares: dict[int, float]
    train: bool = True
    weights: Optional[list[Tensor]] = None
    inputs: dict[int, Tensors] = field(default_factory=dict)
    outputs: dict[int, Tensors] = field(default_factory=dict)
    losses: dict[int, Tensor] = field(default_factory=dict)
    grads: dict[int, Tensors] = field(default_factory=dict)
    input_grads: dict[int, Tensors] = field(default_factory=dict)
    weight_work: dict[int, split.WeightWork] = field(default_factory=dict)
    replay: dict[int, "Replay"] = field(default_factory=dict)  # split backward with recompute: how to rerun F
    results: dict[int, Any] = field(default_factory=dict)
    loss_sum: Optional[Tensor] = None  # on the loss's device: read once per step, never per microbatch
    losses_left: int = 0
    sent: dict[int, Outbox] = field(default_factory=dict)
    received: Counter[int] = field(default_factory=Counter)
    live: int = 0
    peak_stash: int = 0
    held_bytes: dict[int, int] = field(default_factory=dict)
    live_bytes: int = 0
    peak_stash_bytes: int = 0

    def add_batch(self, first: int, microbatches: list[Any], shares: list[float]) -> None:
        """Admit a batch whose microbatches are numbered from ``first``."""
        self.microbatches.update(enumerate(microbatches, start=first))
        self.shares.update(enumerate(shares, start=first))
        self.loss_sum = None
        self.losses_left = len(microbatches)

    def stash(self, delta: int) -> None:
        """Count microbatches whose activations are held for a backward."""
        self.live += delta
        self.peak_stash = max(self.peak_stash, self.live)

    def hold(self, k: int, nbytes: int) -> None:
        """Account ``nbytes`` more held for microbatch ``k`` (saved activations, captured gradients)."""
        self.held_bytes[k] = self.held_bytes.get(k, 0) + nbytes
        self.live_bytes += nbytes
        self.peak_stash_bytes = max(self.peak_stash_bytes, self.live_bytes)

    def release(self, k: int) -> None:
        """Microbatch ``k``'s backward is complete: its bytes are freed."""
        self.live_bytes -= self.held_bytes.pop(k, 0)


@dataclass
class Replay:
    """What rerunning a microbatch's forward needs (split backward with recompute): the weight
    version it ran on and the random state it started from (dropout draws the same masks)."""

    weights: Optional[list[Tensor]]
    rng: Tensor
    device_rng: Optional[Tensor]

    @classmethod
    def capture(cls, weights: Optional[list[Tensor]], device: torch.device) -> "Replay":
        """The state before a forward."""
        return cls(weights, torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None)

    @contextmanager
    def restored(self, device: torch.device) -> Iterator[None]:
        """Run with the random state the forward started from; the caller's state is kept."""
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.set_rng_state(self.rng)
            if self.device_rng is not None:
                torch.cuda.set_rng_state(self.device_rng, device)
            yield


@contextmanager
def saved_bytes(weights: Iterable[Tensor] = ()) -> Iterator[list[int]]:
    """Count the bytes autograd saves for backward inside the block (parameters and views of
    ``weights`` excluded: they are held anyway); the graph keeps them until the microbatch's backward."""
    counted, seen = [0], {t.untyped_storage().data_ptr() for t in weights}

    def pack(t: Tensor) -> Tensor:
        key = t.untyped_storage().data_ptr()
        if not (t.is_leaf and t.requires_grad) and key not in seen:
            seen.add(key)
            counted[0] += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield counted


def _unwrap(values: Tensors) -> Any:
    return values[0] if len(values) == 1 else values


class Executor:
    """Execute a rank's actions; never decides what runs next, only how each kind runs.

    Args:
        stage: the blocks this rank owns.
        position: the rank's place in its pipeline.
        device: where received tensors are allocated.
        hooks: user inputs/loss and the engine's all-reduce and optimizer step.
        abort_timeout: how long to wait for abort notices to reach neighbours on failure.
        trace: where to record each action's start and end time, if anywhere.
        account: count the bytes autograd saves for backward (``StepState.peak_stash_bytes``);
            a saved-tensor hook per forward, so only when a monitor asks.
        links: what each link last carried (kept by the engine across programs, see :class:`p2p.Links`).
    """

    def __init__(self, stage: Stage, position: Position, device: torch.device, hooks: Hooks,
                 abort_timeout: float = 10.0, trace: Optional[Trace] = None, links: Optional[p2p.Links] = None,
                 account: bool = False) -> None:  # fmt: skip
        self.stage, self.position, self.device, self.hooks = stage, position, device, hooks
        self.abort_timeout, self.trace, self.account = abort_timeout, trace, account
        self.links = links if links is not None else p2p.Links()
        self._left: Counter[int] = Counter()
        self._replay_forward = False  # split backward on a recomputed stage: F keeps no graph, I reruns it
        self._incoming: dict[int, p2p.Incoming] = {}
        self._handlers: dict[Kind, Callable[[Action, StepState], Optional[float]]] = {
            Kind.FORWARD: self._forward,
            Kind.BACKWARD: self._backward,
            Kind.SEND_ACT: self._send_act,
            Kind.RECV_ACT: self._recv_act,
            Kind.SEND_GRAD: self._send_grad,
            Kind.RECV_GRAD: self._recv_grad,
            Kind.ALL_REDUCE: lambda a, st: self.hooks.all_reduce(),
            Kind.OPTIMIZER_STEP: lambda a, st: self.hooks.optimizer_step(),
            Kind.VERSION: self._version,
            Kind.INPUT_GRAD: self._input_grad,
            Kind.WEIGHT_GRAD: self._weight_grad,
        }

    def run(self, actions: list[Action], state: StepState, wait: bool = True) -> StepState:
        """Run ``actions`` in order; on any error tell both neighbours, then re-raise.

        Args:
            actions: this rank's program.
            state: what the program reads and writes.
            wait: wait for every posted send before returning. 2BW windows pass ``False``:
                a neighbour receives the last sends of a window only in its next window.
        """
        self._replay_forward = self.stage.recompute and any(a.kind is Kind.INPUT_GRAD for a in actions)
        try:
            self._post_receives(actions)
            for action in actions:
                start = now()
                ready = self._handlers[action.kind](action, state)  # when its own work began, if it waited first
                if self.trace is not None:
                    self.trace.record(action, start if ready is None else ready, now())
                for incoming in self._incoming.values():
                    incoming.advance()
            if wait:
                self._wait(state)
        except BaseException as err:  # noqa: BLE001 - neighbours must hear of every failure
            self._abort(err)
            raise
        return state

    # -- compute ---------------------------------------------------------------------------
    def _forward(self, a: Action, st: StepState) -> None:
        k = a.microbatch
        mb = st.microbatches[k]
        inputs = as_tuple(self.hooks.inputs(mb), "pipeline_inputs") if self.position.is_first else st.inputs.pop(k)
        if st.train:
            st.inputs[k] = inputs
        replay = self._replay_forward and st.train
        if replay:  # the graph is built once, by I's recomputation, and W reuses it
            st.replay[k] = Replay.capture(st.weights, self.device)
        with saved_bytes(self.stage.parameters()) if self.account and st.train else nullcontext([0]) as counted, \
                torch.no_grad() if replay else nullcontext():  # fmt: skip
            outputs = self.stage(inputs, st.weights)
        if st.train:
            st.stash(1)
            st.hold(k, counted[0])
        if not self.position.is_last:
            st.outputs[k] = outputs
        elif st.train:
            loss = self._loss(outputs, mb) * st.shares[k]
            st.loss_sum = loss.detach() if st.loss_sum is None else st.loss_sum + loss.detach()
            st.losses_left -= 1
            if st.losses_left == 0:  # the newest batch's loss is complete: share it now
                self.hooks.loss_done(st.loss_sum)
            st.losses[k] = loss
        else:
            st.results[k] = _unwrap(outputs)

    def _version(self, a: Action, st: StepState) -> None:
        st.weights = self.hooks.weights(a.microbatch)

    def _loss(self, outputs: Tensors, mb: Any) -> Tensor:
        loss = self.hooks.loss(_unwrap(outputs), mb)
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise TypeError(f"pipeline_loss must return a scalar Tensor, got {type(loss).__name__}")
        return loss.reshape(())

    def _roots(self, k: int, st: StepState) -> tuple[list[Tensor], list[Optional[Tensor]]]:
        """What microbatch ``k``'s backward starts from: the loss, or outputs and their gradients."""
        if self.position.is_last:
            pairs: list[tuple[Tensor, Optional[Tensor]]] = [(st.losses.pop(k), None)]
        else:
            floats = [o for o in st.outputs.pop(k) if o.is_floating_point()]
            pairs = list(zip(floats, st.grads.pop(k)))
        pairs = [(root, grad) for root, grad in pairs if root.requires_grad]
        return [r for r, _ in pairs], [g for _, g in pairs]

    def _keep_input_grads(self, k: int, st: StepState, floats: list[Tensor], grads: list[Optional[Tensor]]) -> None:
        st.microbatches.pop(k, None)
        st.shares.pop(k, None)
        if not self.position.is_first:
            st.input_grads[k] = tuple(g if g is not None else torch.zeros_like(x) for x, g in zip(floats, grads))

    def _backward(self, a: Action, st: StepState) -> None:
        k = a.microbatch
        roots, grads = self._roots(k, st)
        if roots:
            torch.autograd.backward(roots, grads)
        floats = [x for x in st.inputs.pop(k) if x.is_floating_point()]
        self._keep_input_grads(k, st, floats, [x.grad for x in floats])
        st.stash(-1)
        st.release(k)

    def _replayed_roots(self, k: int, st: StepState) -> tuple[list[Tensor], list[Optional[Tensor]]]:
        """Split backward with recompute: run microbatch ``k``'s forward again, with its graph,
        on the weights and random state of its first run, and return what I starts from."""
        replay = st.replay.pop(k)
        with replay.restored(self.device), saved_bytes(self.stage.parameters()) if self.account else nullcontext([0]) as counted:
            outputs = self.stage.recompute_forward(st.inputs[k], replay.weights)
        if self.account:
            st.hold(k, counted[0])
        if self.position.is_last:
            st.losses.pop(k)
            st.losses[k] = self._loss(outputs, st.microbatches[k]) * st.shares[k]
        else:
            st.outputs[k] = outputs
        return self._roots(k, st)

    def _input_grad(self, a: Action, st: StepState) -> None:
        k = a.microbatch
        roots, grads = self._replayed_roots(k, st) if k in st.replay else self._roots(k, st)
        floats = [x for x in st.inputs.pop(k) if x.is_floating_point()]
        needing = [x for x in floats if x.requires_grad]
        found, work = split.input_grads(roots, grads, needing) if roots else ([], split.WeightWork([], [], []))
        by_input = {id(x): g for x, g in zip(needing, found)}
        self._keep_input_grads(k, st, floats, [by_input.get(id(x)) for x in floats])
        st.weight_work[k] = work
        if self.account:
            st.hold(k, sum(g.numel() * g.element_size() for group in work.grads for g in group if g is not None))

    def _weight_grad(self, a: Action, st: StepState) -> None:
        self.hooks.weights_accumulated(split.weight_grads(st.weight_work.pop(a.microbatch)))
        st.stash(-1)
        st.release(a.microbatch)

    # -- communication ---------------------------------------------------------------------
    def _send(self, tensors: Tensors, dst: int, st: StepState) -> None:
        box = st.sent.setdefault(dst, Outbox())
        box.post(p2p.send_tensors(tensors, dst, self.device, ack=st.received[dst], posted=self.links.sent.get(dst)), tensors)
        self.links.sent[dst] = p2p.specs_of(tensors)

    def _send_act(self, a: Action, st: StepState) -> None:
        outputs = st.outputs[a.microbatch] if st.train else st.outputs.pop(a.microbatch)
        self._send(outputs, self.position.next_rank, st)

    def _send_grad(self, a: Action, st: StepState) -> None:
        self._send(st.input_grads.pop(a.microbatch), self.position.prev_rank, st)

    def _post_receives(self, actions: list[Action]) -> None:
        """Post the first receive from each neighbour the program reads from.

        Each receive is posted one ahead (the next from a neighbour as soon as the previous is
        in), and its payload as soon as its header arrives, so transfers overlap compute rather
        than start when the schedule reaches them. Only receives the program will consume are
        posted, so none is left over for the next program.
        """
        sources = {Kind.RECV_ACT: self.position.prev_rank, Kind.RECV_GRAD: self.position.next_rank}
        self._left = Counter(sources[a.kind] for a in actions if a.kind in sources)
        self._incoming = {src: self._incoming_from(src) for src in self._left}

    def _incoming_from(self, src: int) -> p2p.Incoming:
        return p2p.Incoming(src, self.device, expected=self.links.received.get(src))

    def _receive(self, src: Optional[int], st: StepState) -> Tensors:
        assert src is not None
        incoming = self._incoming.pop(src)
        try:
            received = incoming.wait()
        except p2p.PipelineAbortedError:
            self.links.received.pop(src, None)
            raise
        self.links.received[src] = p2p.specs_of(received)
        st.received[src] += 1
        if src in st.sent:
            st.sent[src].release(incoming.ack)
        self._left[src] -= 1
        if self._left[src]:
            self._incoming[src] = self._incoming_from(src)
        return received

    def _recv_act(self, a: Action, st: StepState) -> None:
        received = self._receive(self.position.prev_rank, st)
        grad = st.train and torch.is_grad_enabled()
        st.inputs[a.microbatch] = tuple(t.requires_grad_(grad and t.is_floating_point()) for t in received)

    def _recv_grad(self, a: Action, st: StepState) -> None:
        st.grads[a.microbatch] = self._receive(self.position.next_rank, st)

    def _wait(self, st: StepState) -> None:
        for box in st.sent.values():
            box.wait()

    # -- failure ---------------------------------------------------------------------------
    def _abort(self, err: BaseException) -> None:
        source = getattr(err, "source_rank", None)
        if isinstance(err, p2p.PipelineAbortedError):
            message = str(err)
        else:
            rank = dist.get_rank() if dist.is_initialized() else 0
            message = f"stage {self.position.stage} (rank {rank}) failed: {type(err).__name__}: {err}"
        for peer in (self.position.prev_rank, self.position.next_rank):
            if peer is None or peer == source:
                continue
            try:
                for work in p2p.send_abort(message, peer, self.device, posted=self.links.sent.pop(peer, None)):
                    work.wait(timedelta(seconds=self.abort_timeout))
            except Exception:  # noqa: BLE001 - the peer may already be gone; the original error matters
                pass
