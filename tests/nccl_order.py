"""NCCL's point-to-point discipline, emulated over recorded transfers: does a run that passed on gloo hang there?

Gloo matches a send with its receive whenever both are posted. NCCL runs a communicator's
operations on one stream, one ``batch_isend_irecv`` group after another in the order each rank
posted them, and a group ends only when every transfer in it has met its counterpart: a send
waits for the receiving rank to run the group holding its receive (a rendezvous; small messages
may go ahead eagerly, but nothing may rely on that). The ``n``-th send from ``a`` to ``b``
meets the ``n``-th receive ``b`` posts from ``a``.

:func:`record_batches` records what each rank posts; :func:`run_in_order` replays every rank's
groups under that discipline and fails on a hang or on a send and receive of different sizes.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch.distributed as dist

#: One transfer: ("send" or "recv", peer's global rank, bytes).
Op = tuple[str, int, int]


@contextmanager
def record_batches(group: Any = None) -> Iterator[list[list[Op]]]:
    """Record every ``dist.batch_isend_irecv`` posted on this rank (its transfers on ``group``,
    if given), and any single ``isend``/``irecv`` on ``group`` as a group of its own."""
    batches: list[list[Op]] = []
    batched, isend, irecv = dist.batch_isend_irecv, dist.isend, dist.irecv

    def on(g: Any) -> bool:
        return group is None or g is group

    def batch(ops: list[dist.P2POp]) -> Any:
        batches.append([("send" if op.op.__name__ == "isend" else "recv", op.peer, op.tensor.numel() * op.tensor.element_size())
                        for op in ops if on(op.group)])  # fmt: skip
        return batched(ops)

    def single(kind: str, original: Any) -> Any:
        def post(tensor: Any, peer: int, group: Any = None, tag: int = 0) -> Any:
            if on(group) and group is not None:
                batches.append([(kind, peer, tensor.numel() * tensor.element_size())])
            return original(tensor, peer, group=group, tag=tag)

        return post

    dist.batch_isend_irecv, dist.isend, dist.irecv = batch, single("send", isend), single("recv", irecv)
    try:
        yield batches
    finally:
        dist.batch_isend_irecv, dist.isend, dist.irecv = batched, isend, irecv


def run_in_order(streams: dict[int, list[list[Op]]]) -> int:
    """Replay each rank's groups (``streams[rank]``) in order, as NCCL runs them; return how
    many groups ran. Raise ``AssertionError`` on a hang (naming each rank's waiting group) or
    on a send whose receive has another size."""
    where: dict[tuple[str, int, int, int], tuple[int, int, int]] = {}  # (kind, src, dst, n) -> (rank, group, bytes)
    counts: dict[tuple[str, int, int], int] = {}
    for rank, groups in streams.items():
        for g, ops in enumerate(groups):
            for kind, peer, nbytes in ops:
                src, dst = (rank, peer) if kind == "send" else (peer, rank)
                n = counts[kind, src, dst] = counts.get((kind, src, dst), -1) + 1
                where[kind, src, dst, n] = (rank, g, nbytes)
    matches: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (rank, group) -> the (rank, group) of each counterpart
    for (kind, src, dst, n), (rank, g, nbytes) in where.items():
        other = where.get(("recv" if kind == "send" else "send", src, dst, n))
        matches.setdefault((rank, g), []).append((-1, -1) if other is None else other[:2])
        if other is not None and other[2] != nbytes:
            raise AssertionError(f"{kind} {n} from {src} to {dst} carries {nbytes} bytes, its counterpart {other[2]}")
    head = {rank: 0 for rank in streams}
    ran = 0
    while True:
        done = [rank for rank, g in head.items() if g < len(streams[rank]) and
                all(peer >= 0 and head[peer] >= pg for peer, pg in matches.get((rank, g), []))]  # fmt: skip
        if not done:
            break
        for rank in done:
            head[rank] += 1
            ran += 1
    waiting = {rank: streams[rank][g] for rank, g in head.items() if g < len(streams[rank])}
    assert not waiting, f"NCCL would hang: each rank's waiting group (kind, peer, bytes): {waiting}"
    return ran
