"""Runs one rank's action list with real tensors: a dispatch table from action kind to handler."""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterable, Iterator, Mapping, Optional, Sequence, Union

import torch
from torch import Tensor

from lightning_pipe.core.sizes import storages
from lightning_pipe.runtime.autograd import backward_split as split
from lightning_pipe.runtime.autograd.deferred_weights import DeferredGrads, DeferWeightGrads, keeps_saved_tensors
from lightning_pipe.runtime.comm import p2p
from lightning_pipe.runtime.comm.abort import failure_message, notify_neighbours
from lightning_pipe.runtime.comm.mailbox import Mailbox, Outbox
from lightning_pipe.runtime.stage import Stage, Tensors, as_tuple
from lightning_pipe.schedules.actions import Action, Kind
from lightning_pipe.schedules.passes import DELIVERS
from lightning_pipe.schedules.timeline import Trace, now


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
    weights: Callable[[int, int], Optional[list[Tensor]]] = lambda first_microbatch, stage: None
    loss_done: Callable[[Tensor], None] = lambda loss_sum: None
    weights_accumulated: Callable[[list[Tensor]], None] = lambda weights: None
    weights_to_accumulate: Callable[[list[Tensor]], None] = lambda weights: None


Key = tuple[int, int]  # (stage, microbatch): a rank may run several stages (interleaved 1F1B)


@dataclass
class StepState:
    """Everything kept between actions (2BW keeps it across steps): per-stage tensors keyed by
    (stage, microbatch), the batch's microbatches and the results keyed by microbatch."""

    microbatches: dict[int, Any]
    shares: dict[int, float]
    train: bool = True
    weights: dict[int, Optional[list[Tensor]]] = field(default_factory=dict)  # by stage: its V's version
    inputs: dict[Key, Tensors] = field(default_factory=dict)
    outputs: dict[Key, Tensors] = field(default_factory=dict)
    losses: dict[Key, Tensor] = field(default_factory=dict)
    grads: dict[Key, Tensors] = field(default_factory=dict)
    input_grads: dict[Key, Tensors] = field(default_factory=dict)
    weight_work: dict[Key, split.WeightWork] = field(default_factory=dict)
    deferred: dict[Key, DeferredGrads] = field(
        default_factory=dict
    )  # split backward: linear and convolution calls waiting for I
    replay: dict[Key, "Replay"] = field(default_factory=dict)  # split backward with recompute: how to rerun F
    results: dict[int, Any] = field(default_factory=dict)
    loss_sum: Optional[Tensor] = None  # on the loss's device: read once per step, never per microbatch
    losses_left: int = 0
    sent: dict[int, Outbox] = field(default_factory=dict)
    received: Counter[int] = field(default_factory=Counter)
    live: int = 0
    peak_stash: int = 0
    held_bytes: dict[Key, int] = field(default_factory=dict)
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

    def hold(self, key: Key, nbytes: int) -> None:
        """Account ``nbytes`` more held for a stage's microbatch (saved activations, captured gradients)."""
        self.held_bytes[key] = self.held_bytes.get(key, 0) + nbytes
        self.live_bytes += nbytes
        self.peak_stash_bytes = max(self.peak_stash_bytes, self.live_bytes)

    def release(self, key: Key) -> None:
        """A stage's backward of a microbatch is complete: its bytes are freed."""
        self.live_bytes -= self.held_bytes.pop(key, 0)


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

    @keeps_saved_tensors
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
        stage: the blocks this rank owns: one :class:`Stage`, or several (interleaved 1F1B),
            each run by the actions that name its ``index``.
        position: the rank's place in its pipeline, one per stage (aligned with ``stage``).
        device: where received tensors are allocated.
        hooks: user inputs/loss and the engine's all-reduce and optimizer step.
        abort_timeout: how long to wait for abort notices to reach neighbours on failure.
        trace: where to record each action's start and end time, if anywhere.
        account: count the bytes autograd saves for backward (``StepState.peak_stash_bytes``);
            a saved-tensor hook per forward, so only when a monitor asks.
        links: what each link last carried (kept by the engine across programs, see :class:`p2p.Links`).
        channel: where headers and tensors travel (:class:`p2p.Channel`).
    """

    def __init__(
        self,
        stage: Union[Stage, Sequence[Stage]],
        position: Union[Position, Sequence[Position]],
        device: torch.device,
        hooks: Hooks,
        abort_timeout: float = 10.0,
        trace: Optional[Trace] = None,
        links: Optional[p2p.Links] = None,
        account: bool = False,
        channel: p2p.Channel = p2p.DIRECT,
    ) -> None:
        stages = [stage] if isinstance(stage, Stage) else list(stage)
        positions = [position] if isinstance(position, Position) else list(position)
        self._chunks = {p.stage: (st, p) for st, p in zip(stages, positions, strict=True)}
        self._lowest = min(self._chunks)  # its backward of a microbatch is this rank's last
        self.device, self.hooks = device, hooks
        self.abort_timeout, self.trace, self.account = abort_timeout, trace, account
        self.links = links if links is not None else p2p.Links()
        self.channel = channel
        self.mailbox = Mailbox(device, self.links, channel, posts_after_send=len(self._chunks) == 1)
        self._replayed: set[int] = set()  # split backward on a recomputed stage: F keeps no graph, I reruns it
        self._deferring: set[int] = (
            set()
        )  # split backward on a stage whose linear and convolution calls defer their weight gradients
        self._whole: set[Key] = (
            set()
        )  # microbatches whose backward runs whole in a split run (split_backward's "drain")
        self._actions: list[Action] = []  # the program running, and the index of its action now running
        self._at = 0
        self._posted_at = -1  # the action whose send was posted last (see _next_send_kind)
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

    def _stage(self, a: Action) -> Stage:
        return self._chunks[a.stage][0]

    def _position(self, a: Action) -> Position:
        return self._chunks[a.stage][1]

    def run(
        self,
        actions: list[Action],
        state: StepState,
        wait: bool = True,
        arrivals: Optional[Mapping[int, list[Action]]] = None,
    ) -> StepState:
        """Run ``actions`` in order; on any error tell every neighbour, then re-raise.

        Args:
            actions: this rank's program.
            state: what the program reads and writes.
            wait: wait for every posted send before returning. 2BW windows pass ``False``:
                a neighbour receives the last sends of a window only in its next window.
            arrivals: per source rank, this program's receives from it in the order it sends
                them (:func:`~lightning_pipe.schedules.receive_order`); default: the order the
                program reads them, right whenever one rank sends only one kind to another.
        """
        split_run = any(a.kind is Kind.INPUT_GRAD for a in actions)
        self._replayed = {s for s, (stage, _) in self._chunks.items() if stage.recompute and split_run}
        self._deferring = {s for s, (stage, _) in self._chunks.items() if stage.defers_weights and split_run}
        self._whole = {(a.stage, a.microbatch) for a in actions if a.kind is Kind.BACKWARD} if split_run else set()
        self._actions, self._at, self._posted_at = actions, 0, -1
        try:
            self.mailbox.start(actions, self._source, self._destination, arrivals)
            trace = self.trace  # the clock is read only for a trace
            for self._at, action in enumerate(actions):
                start = now() if trace is not None else 0.0
                ready = self._handlers[action.kind](action, state)  # when its own work began, if it waited first
                if trace is not None:
                    trace.record(action, start if ready is None else ready, now())
                self.mailbox.advance()
            if wait:
                self._wait(state)
        except BaseException as err:  # noqa: BLE001 - neighbours must hear of every failure
            self._abort(err)
            raise
        return state

    # -- compute ---------------------------------------------------------------------------
    def _forward(self, a: Action, st: StepState) -> None:
        k, key, position = a.microbatch, (a.stage, a.microbatch), self._position(a)
        mb = st.microbatches[k]
        if position.is_first:
            inputs = as_tuple(self.hooks.inputs(mb), "pipeline_inputs")
        elif a.stage - 1 in self._chunks:  # the stage before runs here (the V's turn): no message
            inputs = self._handed_over(st, (a.stage - 1, k))
        else:
            inputs = st.inputs.pop(key)
        if st.train:
            st.inputs[key] = inputs
        replay = a.stage in self._replayed and st.train and key not in self._whole
        if replay:  # the graph is built once, by I's recomputation, and W reuses it
            st.replay[key] = Replay.capture(st.weights.get(a.stage), self.device)
        stage, weights = self._stage(a), st.weights.get(a.stage)
        with (
            saved_bytes(stage.parameters()) if self.account and st.train else nullcontext([0]) as counted,
            torch.no_grad() if replay else self._deferred_weights(a, st, weights, inputs),
        ):
            outputs = stage(inputs, weights)
        if st.train:
            st.stash(1)
            st.hold(key, counted[0])
        if not position.is_last:
            st.outputs[key] = outputs
        elif st.train:
            loss = self._loss(outputs, mb) * st.shares[k]
            st.loss_sum = loss.detach() if st.loss_sum is None else st.loss_sum + loss.detach()
            st.losses_left -= 1
            if st.losses_left == 0:  # the newest batch's loss is complete: share it now
                self.hooks.loss_done(st.loss_sum)
            st.losses[key] = loss
        else:
            st.results[k] = _unwrap(outputs)

    @staticmethod
    def _handed_over(st: StepState, key: Key) -> Tensors:
        """The outputs of this rank's stage and microbatch ``key`` as the next stage's inputs:
        detached, as a received message is, so each stage's backward ends at its own inputs."""
        outputs = st.outputs[key] if st.train else st.outputs.pop(key)
        grad = st.train and torch.is_grad_enabled()
        return tuple(t.detach().requires_grad_(grad and t.is_floating_point()) for t in outputs)

    def _deferred_weights(
        self, a: Action, st: StepState, weights: Optional[list[Tensor]], inputs: Tensors
    ) -> ContextManager[Any]:
        """Split backward on a stage that defers its linear and convolution weight gradients: record
        those calls of this microbatch's forward on ``weights`` (``None``: the stage's own) for its I and W
        (:mod:`~lightning_pipe.runtime.autograd.deferred_weights`). Not where no input needs a gradient (the
        first stage): there I is empty and W a whole backward, with nothing to defer."""
        deferring = a.stage in self._deferring and (a.stage, a.microbatch) not in self._whole
        if not deferring or not st.train or not any(x.requires_grad for x in inputs):
            return nullcontext()
        stage = self._stage(a)
        # With FSDP replicas the blocks run on gathered parameters, which exist from each block's first all-gather.
        own = stage.leaves if stage.sharded is not None else stage.parameters()
        store = st.deferred[a.stage, a.microbatch] = DeferredGrads(weights or own)
        return DeferWeightGrads(store)

    def _version(self, a: Action, st: StepState) -> None:
        st.weights[a.stage] = self.hooks.weights(a.microbatch, a.stage)

    def _loss(self, outputs: Tensors, mb: Any) -> Tensor:
        loss = self.hooks.loss(_unwrap(outputs), mb)
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            got = f"a Tensor of shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else type(loss).__name__
            raise TypeError(
                f"pipeline_loss must return a mean-reduced scalar Tensor (e.g. F.cross_entropy(..., "
                f"reduction='mean')), got {got}"
            )
        return loss if loss.dim() == 0 else loss.reshape(())  # a scalar already: no view, nor its backward

    def _roots(self, a: Action, st: StepState) -> tuple[list[Tensor], list[Optional[Tensor]]]:
        """What a stage's backward of a microbatch starts from: the loss, or outputs and their gradients."""
        key = (a.stage, a.microbatch)
        if self._position(a).is_last:
            pairs: list[tuple[Tensor, Optional[Tensor]]] = [(st.losses.pop(key), None)]
        else:
            floats = [o for o in st.outputs.pop(key) if o.is_floating_point()]
            local = (a.stage + 1, a.microbatch) if a.stage + 1 in self._chunks else None  # the V's turn
            pairs = list(zip(floats, st.input_grads.pop(local) if local else st.grads.pop(key)))
        pairs = [(root, grad) for root, grad in pairs if root.requires_grad]
        return [r for r, _ in pairs], [g for _, g in pairs]

    def _keep_input_grads(self, a: Action, st: StepState, floats: list[Tensor], grads: list[Optional[Tensor]]) -> None:
        if a.stage == self._lowest:  # no stage of this rank reads the microbatch any more
            st.microbatches.pop(a.microbatch, None)
            st.shares.pop(a.microbatch, None)
        if not self._position(a).is_first:
            st.input_grads[a.stage, a.microbatch] = tuple(
                g if g is not None else torch.zeros_like(x) for x, g in zip(floats, grads)
            )

    def _backward(self, a: Action, st: StepState) -> None:
        key = (a.stage, a.microbatch)
        roots, grads = self._roots(a, st)
        if roots:
            torch.autograd.backward(roots, grads)
        floats = [x for x in st.inputs.pop(key) if x.is_floating_point()]
        self._keep_input_grads(a, st, floats, [x.grad for x in floats])
        st.stash(-1)
        st.release(key)
        if self._whole:  # a whole backward in a split run (drain): the stage's W's may be done
            self._release_gathered(a, st)

    def _replayed_roots(self, a: Action, st: StepState) -> tuple[list[Tensor], list[Optional[Tensor]]]:
        """Split backward with recompute: run a microbatch's forward again, with its graph,
        on the weights and random state of its first run, and return what I starts from."""
        key, stage = (a.stage, a.microbatch), self._stage(a)
        replay = st.replay.pop(key)
        with (
            replay.restored(self.device),
            saved_bytes(stage.parameters()) if self.account else nullcontext([0]) as counted,
            self._deferred_weights(a, st, replay.weights, st.inputs[key]),
        ):
            outputs = stage.recompute_forward(st.inputs[key], replay.weights)
        if self.account:
            st.hold(key, counted[0])
        if self._position(a).is_last:
            st.losses.pop(key)
            st.losses[key] = self._loss(outputs, st.microbatches[a.microbatch]) * st.shares[a.microbatch]
        else:
            st.outputs[key] = outputs
        return self._roots(a, st)

    def _input_grad(self, a: Action, st: StepState) -> None:
        key = (a.stage, a.microbatch)
        roots, grads = self._replayed_roots(a, st) if key in st.replay else self._roots(a, st)
        floats = [x for x in st.inputs.pop(key) if x.is_floating_point()]
        needing = [x for x in floats if x.requires_grad]
        deferred = st.deferred.pop(key, None)
        if self._stage(a).sharded is not None:
            self._stage(a).sharded.hold()  # the blocks stay gathered for this microbatch's W
        found, work = (
            split.input_grads(roots, grads, needing, deferred) if roots else ([], split.WeightWork([], [], []))
        )
        by_input = {id(x): g for x, g in zip(needing, found)}
        self._keep_input_grads(a, st, floats, [by_input.get(id(x)) for x in floats])
        st.weight_work[key] = work
        if self.account and deferred is not None and not work.roots:  # I freed the graph: W holds only what it kept
            st.release(key)
            st.hold(key, sum(storages(work.kept()).values()))  # a deferred call's input may feed several
        elif self.account:
            st.hold(key, sum(g.numel() * g.element_size() for g in work.kept()))

    def _weight_grad(self, a: Action, st: StepState) -> None:
        key = (a.stage, a.microbatch)
        # Each deferred weight reported as its gradient is complete: a bucket adopts it before the next exists.
        report = self.hooks.weights_accumulated
        sharded = self._stage(a).sharded
        if sharded is not None:  # W runs outside FSDP's hooks, on the gathered weights its forward ran on
            sharded.gather()
        report(split.weight_grads(st.weight_work.pop(key), report, self.hooks.weights_to_accumulate))
        st.stash(-1)
        st.release(key)
        self._release_gathered(a, st)

    def _release_gathered(self, a: Action, st: StepState) -> None:
        """FSDP replicas: after a stage's last pending W, its blocks reshard (ZeRO-3; see
        :class:`~lightning_pipe.runtime.sharding.ShardedStage`)."""
        sharded = self._stage(a).sharded
        if sharded is not None and not any(s == a.stage for s, _ in st.weight_work):
            sharded.release()

    # -- communication ---------------------------------------------------------------------
    def _send(self, a: Action, tensors: Tensors, st: StepState) -> None:
        """Post ``tensors``, what send ``a`` delivers, to the rank whose receive reads them."""
        dst = self._destination(a)
        assert dst is not None
        self.mailbox.before_send(dst, self._at)
        box = st.sent.get(dst) or st.sent.setdefault(dst, Outbox(self.channel.polls()))
        name = self._delivered_name(a)
        transfer = p2p.send_tensors(
            tensors,
            dst,
            self.device,
            ack=st.received[dst],
            posted=self.links.sent.get((dst, name)),
            channel=self.channel,
        )
        box.post(transfer)
        self._posted_at = self._at
        self.links.sent[dst, name] = transfer.specs
        self.mailbox.after_send(dst, self._at)

    def _delivered_name(self, a: Action) -> tuple:
        """The name (:class:`p2p.Links`) of the message send ``a`` delivers."""
        kind, offset = DELIVERS[a.kind]
        return self.links.name(kind, a.stage + offset, a.microbatch)  # type: ignore[arg-type]

    def _send_act(self, a: Action, st: StepState) -> None:
        key = (a.stage, a.microbatch)
        self._send(a, st.outputs[key] if st.train else st.outputs.pop(key), st)

    def _send_grad(self, a: Action, st: StepState) -> None:
        self._send(a, st.input_grads.pop((a.stage, a.microbatch)), st)

    def _destination(self, a: Action) -> Optional[int]:
        position = self._position(a)
        return position.next_rank if a.kind is Kind.SEND_ACT else position.prev_rank

    def _source(self, a: Action) -> Optional[int]:
        position = self._position(a)
        return position.prev_rank if a.kind is Kind.RECV_ACT else position.next_rank

    def _receive(self, a: Action, st: StepState) -> Tensors:
        src = self._source(a)
        assert src is not None

        def delivered(peer: int, ack: int) -> None:  # the peer has our first ``ack`` messages: drop them
            st.received[peer] += 1
            if peer in st.sent:
                st.sent[peer].release(ack)

        return self.mailbox.receive(a, src, self._at, delivered)

    def _recv_act(self, a: Action, st: StepState) -> None:
        received = self._receive(a, st)
        grad = st.train and torch.is_grad_enabled()
        st.inputs[a.stage, a.microbatch] = tuple(t.requires_grad_(grad and t.is_floating_point()) for t in received)

    def _recv_grad(self, a: Action, st: StepState) -> None:
        st.grads[a.stage, a.microbatch] = self._receive(a, st)

    def _wait(self, st: StepState) -> None:
        for box in st.sent.values():
            box.wait()

    # -- failure ---------------------------------------------------------------------------
    def _abort(self, err: BaseException) -> None:
        peers = {  # a neighbouring stage on this rank itself (the V's turn) is no peer
            peer
            for s, (_, p) in self._chunks.items()
            for peer, there in ((p.prev_rank, s - 1), (p.next_rank, s + 1))
            if there not in self._chunks
        } - {None}
        notify_neighbours(
            failure_message(err, sorted(self._chunks)),
            peers,
            self._next_send_name,
            self.links,  # type: ignore[arg-type]
            self.device,
            self.channel,
            self.mailbox.take_incoming,
            self.abort_timeout,
            getattr(err, "source_rank", None),
        )

    def _next_send_name(self, peer: int) -> Optional[tuple]:
        """The name of our next message to ``peer`` (so an abort notice fills the receive it
        posted for it): our next send to it (the running action, if a send that failed before
        posting: a notice larger than the receive posted for it kills the peer under gloo), or
        our program's first (the next program's); ``None`` if this program sends it nothing."""
        start = self._at + 1 if self._posted_at == self._at else self._at
        for a in self._actions[start:] + self._actions:
            if a.kind in DELIVERS and self._destination(a) == peer:
                return self._delivered_name(a)
        return None
