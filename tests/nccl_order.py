"""NCCL's point-to-point discipline, emulated over recorded transfers: would a run that passed on gloo hang there?

Gloo matches a send with its receive whenever both are posted. NCCL runs each process group's
operations on one stream per rank, in the order the rank posted them (a ``batch_isend_irecv``
as one group of operations that run together), and an operation ends only once its counterpart
runs: a send waits for the receiving rank to reach its receive (small messages may go ahead
eagerly, but nothing may rely on that). On one group the ``n``-th send from ``a`` to ``b`` meets
the ``n``-th receive ``b`` posts from ``a``.

:func:`record` records what a rank posts; :func:`run_in_order` replays every rank's streams
under that discipline and fails on a hang or on a send and receive of different sizes. One
stream per group and rank: stricter than torch, which runs the single operations of a group
of more than two ranks on a communicator per pair of ranks. Not modelled: waits outside the
streams (a host reading a header over gloo, a device synchronisation), which a run that
finished on gloo has already passed.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch.distributed as dist

#: One transfer: ("send" or "recv", the peer's global rank, bytes).
Op = tuple[str, int, int]
#: A rank's stream: the name of the group it belongs to, and the operations posted on it, a batch each.
Streams = dict[str, list[list[Op]]]


def _op(kind: str, peer: int, tensor: Any) -> Op:
    return kind, peer, tensor.numel() * tensor.element_size()


@contextmanager
def record(skip: Any = None) -> Iterator[Streams]:
    """Record every point-to-point operation this rank posts (single ``isend``/``irecv`` and
    ``batch_isend_irecv``, but those on ``skip``) by the name of its group."""
    streams: Streams = {}
    batched, isend, irecv = dist.batch_isend_irecv, dist.isend, dist.irecv

    def add(group: Any, ops: list[Op]) -> None:
        group = group if group is not None else dist.group.WORLD
        if group is not skip and ops:
            streams.setdefault(group.group_name, []).append(ops)

    def batch(ops: list[dist.P2POp]) -> Any:
        for group in {id(op.group): op.group for op in ops}.values():
            add(
                group,
                [
                    _op("send" if op.op.__name__ == "isend" else "recv", op.peer, op.tensor)
                    for op in ops
                    if op.group is group
                ],
            )
        return batched(ops)

    def single(kind: str, original: Any) -> Any:
        def post(tensor: Any, peer: int, group: Any = None, tag: int = 0) -> Any:
            add(group, [_op(kind, peer, tensor)])
            return original(tensor, peer, group=group, tag=tag)

        return post

    dist.batch_isend_irecv, dist.isend, dist.irecv = batch, single("send", isend), single("recv", irecv)
    try:
        yield streams
    finally:
        dist.batch_isend_irecv, dist.isend, dist.irecv = batched, isend, irecv


def run_in_order(ranks: dict[int, Streams]) -> int:
    """Replay every rank's streams (``ranks[rank][group]``), each in its order, as NCCL runs them;
    return how many operations ran. Raise ``AssertionError`` on a hang (naming what each stuck
    stream waits in) or on a send whose receive has another size."""
    streams = {(rank, group): batches for rank, by_group in ranks.items() for group, batches in by_group.items()}
    where: dict[tuple[str, str, int, int, int], tuple[tuple[int, str], int, int]] = {}
    counts: dict[tuple[str, str, int, int], int] = {}
    for (rank, group), batches in streams.items():
        for b, ops in enumerate(batches):
            for kind, peer, nbytes in ops:
                src, dst = (rank, peer) if kind == "send" else (peer, rank)
                n = counts[kind, group, src, dst] = counts.get((kind, group, src, dst), -1) + 1
                where[kind, group, src, dst, n] = ((rank, group), b, nbytes)
    waits_on: dict[tuple[tuple[int, str], int], list[tuple[tuple[int, str], int]]] = {}
    for (kind, group, src, dst, n), (stream, b, nbytes) in where.items():
        other = where.get(("recv" if kind == "send" else "send", group, src, dst, n))
        waits_on.setdefault((stream, b), []).append((stream, -1) if other is None else other[:2])
        if other is not None and other[2] != nbytes:
            raise AssertionError(
                f"{kind} {n} from {src} to {dst} on group {group} carries {nbytes} bytes, its counterpart {other[2]}"
            )
    head = {stream: 0 for stream in streams}
    ran = 0
    while True:
        done = [
            s
            for s, b in head.items()
            if b < len(streams[s]) and all(o >= 0 and head[peer] >= o for peer, o in waits_on[s, b])
        ]
        if not done:
            break
        for stream in done:
            ran += len(streams[stream][head[stream]])
            head[stream] += 1
    stuck = {
        f"rank {rank} group {group}": streams[rank, group][b]
        for (rank, group), b in head.items()
        if b < len(streams[rank, group])
    }
    assert not stuck, f"NCCL would hang: each stuck stream's waiting operations (kind, peer, bytes): {stuck}"
    return ran
