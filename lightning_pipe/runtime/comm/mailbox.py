"""The messages of one rank's program: sends kept until delivered, and when each receive is posted."""

from __future__ import annotations

import bisect
import itertools
import math
import time
from collections import deque
from typing import Callable, Mapping, Optional

import torch
import torch.distributed as dist

from lightning_pipe.runtime.comm import p2p
from lightning_pipe.runtime.stage import Tensors
from lightning_pipe.schedules.actions import RECEIVE_KINDS, Action, Kind
from lightning_pipe.schedules.passes import DELIVERS

#: The actions that free what a forward holds: until the next, a rank's held memory only grows.
BACKWARDS = (Kind.BACKWARD, Kind.INPUT_GRAD, Kind.WEIGHT_GRAD)

Route = Callable[[Action], Optional[int]]


def waited_message(key: Action, src: int, seconds: float) -> str:
    """What a rank says when its wait for the message that receive ``key`` reads from rank ``src``
    timed out: which stage waited how long for what, from which rank and stage.

    Args:
        key: the receive the message was for (its stage is the waiting one).
        src: the global rank the message was to come from.
        seconds: how long the wait lasted.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    what, sender = ("activations", key.stage - 1) if key.kind is Kind.RECV_ACT else ("gradients", key.stage + 1)
    return (
        f"stage {key.stage} (rank {rank}) waited {seconds:.0f} s for the {what} of microbatch {key.microbatch} "
        f"from rank {src} (stage {sender}): that rank is stuck or slower than the timeout"
    )


class Outbox:
    """Messages posted to one peer, kept (so their tensors stay alive) until known delivered.

    Gloo's send handles report completion only once waited on, so completion is learned from
    the peer: every header carries how many messages its sender has received so far, and
    waiting on those sends returns at once. Without this a step held every microbatch's sent
    tensors to its end, and a 2BW stream (which never waits) held them forever.
    """

    def __init__(self, polls: bool = True) -> None:
        self.posted = 0
        self.messages: deque[tuple[int, p2p.Transfer]] = deque()
        self.polls = polls  # whether a send can report completion unwaited: not where headers go over gloo

    def post(self, transfer: p2p.Transfer) -> None:
        """Keep one just-posted message."""
        self.messages.append((self.posted, transfer))
        self.posted += 1

    def release(self, delivered: int) -> None:
        """Drop the first ``delivered`` messages (the peer has them) and, where sends report their
        completion unwaited, any reported complete."""
        while self.messages and self.messages[0][0] < delivered:  # kept in the order posted
            self.messages.popleft()[1].wait()
        if self.polls:
            self.messages = deque(m for m in self.messages if not m[1].is_completed())

    def wait(self) -> None:
        """Wait for every message still kept."""
        for _, transfer in self.messages:
            transfer.wait()
        self.messages.clear()


class Mailbox:
    """The receives of one rank's program: which message each neighbour sends next, and when its receive is posted.

    Messages from one neighbour arrive in the order it sent them; one that arrives before the
    action that reads it is kept until then. Only receives the program will read are posted, so
    none is left over for the next program.

    When a receive is posted: beside the send this rank next makes to that neighbour, where that
    send comes before this rank next reads from it; otherwise at once (for the first message, or
    as soon as the previous one is in), so that the transfer overlaps compute. Under gloo a posted
    receive lets the sender write its payload at once, and wakes the peer's transport thread:
    beside a send the peer is most likely idle, waiting for that send, and its thread finds a
    free core; posted while the peer computes, the woken thread takes a core from compute. A rank
    that runs one stage posts just after its send (posting first would delay a message the peer
    waits for); a rank that runs several stages (interleaved 1F1B, whose ranks send each other
    both activations and gradients) posts just before, so the peer's own sends do not wait for
    a late receive. Where no send comes first (GPipe's phases, a 1F1B drain) posting at once wins.

    With each such receive, where headers travel with the tensors (``ahead``), the receives of
    the activations that follow it from the same neighbour are posted too, as far as the rank's
    next backward (B, I or W): a burst of sends (GPipe's and looped BFS's forward phases, a 1F1B
    or 2BW warm-up) then finds every receive posted, where one posted at a time made each
    transfer after the first wait for the receiver under gloo (its payload moves only once the
    receive is posted: a wake-up of both transport threads, about a millisecond a message).
    Until a backward frees something, what a rank holds only grows, and each of those inputs is
    held from its receive to its backward, so posting them together adds nothing to the peak;
    gradients (GPipe's backward phase, a 1F1B drain) are posted one at a time, as each would add
    a buffer where the peak is. Each receive is sized by the name of its message
    (:class:`p2p.Links`), so posting ahead never changes what the sender packs. Where tensors
    travel apart from headers (NCCL, whose transfers on a link have no tags) one receive is
    posted at a time.

    Args:
        device: where received tensors are allocated.
        links: what each link last carried (receives are sized by it, see :class:`p2p.Links`).
        channel: where headers and tensors travel (:class:`p2p.Channel`).
        posts_after_send: post the receive beside a send just after it (one stage per rank) or
            just before it (several stages per rank).
    """

    def __init__(self, device: torch.device, links: p2p.Links, channel: p2p.Channel, posts_after_send: bool) -> None:
        self.device, self.links, self.channel = device, links, channel
        self.posts_after_send = posts_after_send
        self.ahead = channel.packs  # receives posted several at a time: payloads apart go on a tag of their own
        self._incoming: dict[int, deque[p2p.Incoming]] = {}  # per source: the posted receives, in send order
        self._expected: dict[int, deque[Action]] = {}  # per source: the receives still to come, in send order
        self._arrivals: dict[int, list[Action]] = {}  # per source: all of the program's receives, in send order
        self._arrived: dict[Action, Tensors] = {}  # received ahead of the action that reads them
        self._sends_to: dict[int, list[int]] = {}  # per peer: the program's sends to it, by action index
        self._reads_from: dict[int, list[int]] = {}  # per peer: the program's receives from it, by action index
        self._reader: dict[Action, int] = {}  # the action index of each receive
        self._backwards: list[int] = []  # the program's backward actions (B, I, W), by index
        self._polls = False  # whether a posted header receive can report its arrival unwaited

    def start(
        self,
        actions: list[Action],
        source: Route,
        destination: Route,
        arrivals: Optional[Mapping[int, list[Action]]] = None,
    ) -> None:
        """Learn which messages ``actions`` read from each neighbour, in the order it sends them
        (``arrivals``; default: the order the program reads them), and post the first receives."""
        self._sends_to, self._reads_from, self._reader = {}, {}, {}
        self._backwards = [i for i, a in enumerate(actions) if a.kind in BACKWARDS]
        for i, a in enumerate(actions):
            if a.kind in DELIVERS:
                self._sends_to.setdefault(destination(a), []).append(i)  # type: ignore[arg-type]
            elif a.kind in RECEIVE_KINDS:
                self._reads_from.setdefault(source(a), []).append(i)  # type: ignore[arg-type]
                self._reader[a] = i
        if arrivals is None:
            arrivals = {src: [actions[i] for i in reads] for src, reads in self._reads_from.items()}
        self._arrivals = {src: list(keys) for src, keys in arrivals.items() if keys}
        self._expected = {src: deque(keys) for src, keys in self._arrivals.items()}
        self._arrived = {}
        self._incoming = {src: deque() for src in self._expected}
        self._polls = bool(self._expected) and self.channel.polls()
        for src in self._expected:
            self._post_ahead(src, -1)

    def before_send(self, dst: int, at: int) -> None:
        """Called just before send ``at`` (an action index) to ``dst``: post its next receive there
        when this rank runs several stages."""
        if not self.posts_after_send:
            self.post_next(dst, at)

    def after_send(self, dst: int, at: int) -> None:
        """Called just after send ``at`` (an action index) to ``dst``: post its next receive there
        when this rank runs one stage."""
        if self.posts_after_send:
            self.post_next(dst, at)

    def _post_ahead(self, src: int, after: int) -> None:
        """Post the next receive from ``src`` now, unless this rank sends to ``src`` (after action
        ``after``) before it next reads from it: then beside that send."""
        sends, reads = self._sends_to.get(src, []), self._reads_from.get(src, [])
        i, j = bisect.bisect_right(sends, after), bisect.bisect_right(reads, after)
        if i == len(sends) or (j < len(reads) and reads[j] < sends[i]):
            self.post_next(src, after)

    def post_next(self, src: int, at: int) -> None:
        """Post the receive of the next message from ``src`` if none is posted and the program reads
        another, and (``ahead``) those of the activations after it that this program reads
        before its next backward after action ``at``."""
        posted, expected = self._incoming.get(src), self._expected.get(src)
        if posted or not expected:
            return
        posted.append(self.incoming_from(src, expected[0]))  # type: ignore[union-attr] - a source's deque is made at start
        if not self.ahead:
            return
        i = bisect.bisect_right(self._backwards, at)
        backward = self._backwards[i] if i < len(self._backwards) else math.inf
        for key in itertools.islice(expected, 1, None):
            if key.kind is not Kind.RECV_ACT or self._reader[key] >= backward:
                break
            posted.append(self.incoming_from(src, key))  # type: ignore[union-attr]

    def advance(self) -> None:
        """Post the payload receives of every message whose header is in and whose tensors come
        apart from it (a first message, new shapes, a side channel). Not where headers go over
        gloo, whose receives report completion only once waited on: there the check finds nothing."""
        if not self._polls:
            return
        for posted in self._incoming.values():
            for incoming in posted:
                incoming.advance()

    def incoming_from(self, src: int, key: Action) -> p2p.Incoming:
        """The message from ``src`` that receive ``key`` reads, its receive posted for the specs
        the message of its name last had (:class:`p2p.Links`)."""
        return p2p.Incoming(src, self.device, self.links.received.get((src, self._name(key))), self.channel)

    def _name(self, key: Action) -> tuple:
        """The name (:class:`p2p.Links`) of the message receive ``key`` reads."""
        return self.links.name(key.kind, key.stage, key.microbatch)  # type: ignore[arg-type]

    def take_incoming(self, src: int) -> p2p.Incoming:
        """The posted receive of the next message from ``src`` (posted now if it was not), no longer kept here."""
        posted = self._incoming.get(src)
        return posted.popleft() if posted else self.incoming_from(src, self._next_key(src))

    def _next_key(self, src: int) -> Action:
        """The receive that reads the next message from ``src``: the next in its send order (the
        first of the program's once they are all in, as the next program's first)."""
        pending = self._expected.get(src) or self._arrivals.get(src)
        return pending[0] if pending else Action(0, Kind.RECV_ACT, 0)

    def receive(self, a: Action, src: int, at: int, delivered: Callable[[int, int], None]) -> Tensors:
        """The tensors receive ``a`` (action ``at`` of the program) reads from ``src``, waiting for
        the messages before it; ``delivered(src, ack)`` hears of each message that comes in."""
        while a not in self._arrived:
            if not self._expected.get(src):
                raise RuntimeError(f"{a} waits for a message rank {src} never sends in this program")
            self.post_next(src, at)
            key = self._expected[src][0]
            self._arrived[key] = self._next_message(src, at, delivered)
        return self._arrived.pop(a)

    def _next_message(self, src: int, at: int, delivered: Callable[[int, int], None]) -> Tensors:
        """Wait for the next message from ``src`` (its receive posted); post the one after it where that goes ahead."""
        incoming, key = self._incoming[src].popleft(), self._expected[src][0]
        name = self._name(key)
        start = time.monotonic()
        try:
            received = incoming.wait()
        except p2p.PipelineAbortedError:
            self.links.received.pop((src, name), None)
            raise
        except RuntimeError as err:
            if not p2p.timed_out(err):
                raise
            raise TimeoutError(waited_message(key, src, time.monotonic() - start)) from err
        self._expected[src].popleft()
        self.links.received[src, name] = incoming.specs  # type: ignore[assignment] - set once a tuple is in
        delivered(src, incoming.ack)
        self._post_ahead(src, at)
        return received
