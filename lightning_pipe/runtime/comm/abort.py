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
from lightning_pipe.schedules.actions import Kind


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
    next_kind: Callable[[int], Kind],
    links: p2p.Links,
    device: torch.device,
    channel: p2p.Channel,
    incoming: Callable[[int], p2p.Incoming],
    timeout: float,
) -> None:
    """Send ``message`` to every peer as an abort notice and wait (at most ``timeout`` seconds) until each has it.

    Args:
        message: the notice (:func:`failure_message`).
        peers: the neighbours to tell (not the rank the failure came from).
        next_kind: what a peer reads our next message as, so the notice fills the receive it posted.
        links: what each link last carried (the notice is sized to the receive posted for it).
        device: where the notice's tensors live.
        channel: where headers travel.
        incoming: the posted receive of a peer's next message (its own notice, if it aborts too).
        timeout: the most seconds to wait for the notices to arrive.
    """
    posted = {}
    for peer in sorted(peers):
        try:
            kind = next_kind(peer)
            posted[peer] = p2p.send_abort(message, peer, device, links.sent.pop((peer, kind), None), channel)
        except Exception:  # noqa: BLE001 - the peer may already be gone; the original error matters
            pass
    _deliver(posted, incoming, timeout)


def _deliver(posted: dict[int, list[dist.Work]], incoming: Callable[[int], p2p.Incoming], timeout: float) -> None:
    """Wait until every neighbour has received its abort notice, or has sent one itself (it is
    aborting too and never reads ours: waiting for that would take ``timeout``).

    Gloo reports a transfer complete only once waited on, so each wait runs in a thread
    (daemon: one still waiting when the process exits is simply dropped).
    """
    settled = {peer: threading.Event() for peer in posted}
    deadline = time.monotonic() + timeout

    def delivered(peer: int) -> None:
        for work in posted[peer]:
            with contextlib.suppress(Exception):  # a peer that is gone: nothing more to do
                work.wait(timedelta(seconds=max(deadline - time.monotonic(), 0.01)))
        settled[peer].set()

    def aborting(peer: int, notice: Optional[p2p.Incoming]) -> None:
        try:
            if notice is not None:
                notice.wait()
        except p2p.PipelineAbortedError:
            settled[peer].set()
        except Exception:  # noqa: BLE001 - a broken link: the notice's own wait decides
            pass

    for peer in posted:
        threading.Thread(target=delivered, args=(peer,), daemon=True).start()
        threading.Thread(target=aborting, args=(peer, incoming(peer)), daemon=True).start()
    for event in settled.values():
        event.wait(max(deadline - time.monotonic(), 0.0))
