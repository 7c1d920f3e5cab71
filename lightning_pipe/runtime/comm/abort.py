"""Failure in a pipeline: a failing rank tells each neighbour, so that every rank raises its error, none waits."""

from __future__ import annotations

import contextlib
import threading
import time
from datetime import timedelta
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist

from lightning_pipe.runtime.comm import p2p

_REPLIES: list[dist.Work] = []  # sends of replies to a notice, never waited on: kept, as gloo drops a freed one


def failure_message(err: BaseException, stages: list[int]) -> str:
    """What the neighbours are told: a notice received from another rank as it came, else which
    stage (and rank) failed with which error."""
    if isinstance(err, p2p.PipelineAbortedError):
        return str(err)
    rank = dist.get_rank() if dist.is_initialized() else 0
    where = stages[0] if len(stages) == 1 else stages
    return f"stage {where} (rank {rank}) failed: {type(err).__name__}: {err}"


def notify_neighbours(
    message: str,
    peers: Iterable[int],
    next_name: Callable[[int], Optional[tuple]],
    links: p2p.Links,
    device: torch.device,
    channel: p2p.Channel,
    incoming: Callable[[int], p2p.Incoming],
    timeout: float,
    source: Optional[int] = None,
) -> None:
    """Send ``message`` to every peer as an abort notice and wait (at most ``timeout`` seconds)
    until each has it, or has sent one itself.

    The peer the failure came from (``source``) is told too, though it knows: its wait for a
    notice from this rank then ends at once, not when this rank exits. That reply is never
    waited on (the source may have taken a message in flight in its place and read no more).

    Args:
        message: the notice (:func:`failure_message`).
        peers: the neighbours to tell.
        next_name: the name (:class:`p2p.Links`) of our next message to a peer, so the notice fills
            the receive it posted for it.
        links: what each link last carried (the notice is sized to the receive posted for it).
        device: where the notice's tensors live.
        channel: where headers travel.
        incoming: the posted receive of a peer's next message (its own notice, if it aborts too).
        timeout: the most seconds to wait for the notices to arrive.
        source: the rank whose notice this rank received (no other comes from it), if any.
    """
    posted = {}
    for peer in sorted(peers):
        try:
            name = next_name(peer)
            posted[peer] = p2p.send_abort(message, peer, device, links.sent.pop((peer, name), None), channel)
        except Exception:  # noqa: BLE001 - the peer may already be gone; the original error matters
            pass
    if source in posted:
        _REPLIES.extend(posted.pop(source))
    _deliver(posted, incoming, time.monotonic() + timeout)


def _deliver(posted: dict[int, list[dist.Work]], incoming: Callable[[int], p2p.Incoming], deadline: float) -> None:
    """Wait until every neighbour has received its abort notice, or has sent one itself (it is
    aborting too and may never read ours: waiting for that would take until ``deadline``).

    Gloo reports a transfer complete only once waited on, so each wait runs in a thread. Every
    wait ends by ``deadline`` (``time.monotonic()``) and the threads are not daemons, so the
    interpreter joins them before it finalizes: a thread still inside a gloo wait then is ended
    inside C++ when that wait returns (the peer exits, closing the link), which aborts the
    process ("terminate called without an active exception").
    """
    settled = {peer: threading.Event() for peer in posted}

    def delivered(peer: int) -> None:
        for work in posted[peer]:
            with contextlib.suppress(Exception):  # a peer that is gone: nothing more to do
                work.wait(timedelta(seconds=max(deadline - time.monotonic(), 0.01)))
        settled[peer].set()

    def aborting(peer: int, notice: p2p.Incoming) -> None:
        try:
            notice.wait(max(deadline - time.monotonic(), 0.01))
        except p2p.PipelineAbortedError:
            settled[peer].set()
        except Exception:  # noqa: BLE001 - a broken link: the notice's own wait decides
            pass

    for peer in posted:
        threading.Thread(target=delivered, args=(peer,), name=f"abort-notice-to-{peer}").start()
        try:
            notice = incoming(peer)
        except Exception:  # noqa: BLE001 - a link closed by a timed-out wait: no notice comes on it
            continue
        threading.Thread(target=aborting, args=(peer, notice), name=f"abort-notice-from-{peer}").start()
    for event in settled.values():
        event.wait(max(deadline - time.monotonic(), 0.0))
