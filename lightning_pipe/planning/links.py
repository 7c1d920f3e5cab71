"""Link benchmarks between two processes: latency, bandwidth, all-reduce, and what a transfer costs next to compute."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from torch import Tensor


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _ping(nbytes: int, repeats: int, device: torch.device) -> float:
    """Seconds of one transfer between ranks 0 and 1 (half a round trip), in its rounds unloaded
    by other processes (:func:`unloaded`): bandwidth is the slope from a small message's to a
    large one's, which one preempted round of either would swing by orders of magnitude."""
    import torch.distributed as dist

    t = torch.zeros(max(nbytes // 4, 1), device=device)
    times = []
    for _ in range(repeats + 1):
        _synchronize(device)
        start = time.perf_counter()
        if dist.get_rank() == 0:
            dist.send(t, 1)
            dist.recv(t, 1)
        elif dist.get_rank() == 1:
            dist.recv(t, 0)
            dist.send(t, 0)
        _synchronize(device)
        times.append((time.perf_counter() - start) / 2)
        dist.barrier()
    return unloaded(times[1:])


LOADED_GAP = 0.005  # seconds of compute between two transfers in the loaded link measurement


def _link_worker(
    rank: int,
    world: int,
    small: int,
    large: int,
    repeats: int,
    device: torch.device = torch.device("cpu"),
    busy: float = LOADED_GAP,
) -> dict[str, float]:
    """Latency, bandwidth and all-reduce bandwidth between this job's ranks, with tensors on
    ``device`` (the backend's: NCCL moves CUDA tensors only); nothing to measure for one rank.
    On CPU the latency and the sender's posting time are those of :func:`_loaded_hop` with
    ``busy`` seconds of compute between transfers (0: between idle processes). Rank 0's result
    is the measurement."""
    import torch.distributed as dist

    if world < 2:
        return {}
    t_small, t_large = _ping(small, repeats, device), _ping(large, repeats, device)
    posting = _posting(large, repeats, device)
    latency = exchange = t_small
    bandwidth = (large - small) / max(t_large - t_small, 1e-9)
    if device.type == "cpu" and busy > 0:
        latency, posting = _loaded_hop(small, busy, 4 * repeats, device)
        exchange = max(_exchange_hop(EXCHANGE_BYTES, busy, 4 * repeats, device) - EXCHANGE_BYTES / bandwidth, latency)
    flat = torch.zeros(large // 4, device=device)
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        _synchronize(device)
        start = time.perf_counter()
        dist.all_reduce(flat)
        _synchronize(device)
        times.append(time.perf_counter() - start)
    ring = 2 * (world - 1) / world * large  # bytes each rank moves in a ring all-reduce
    return {
        "link_latency": latency,
        "link_bandwidth": bandwidth,
        "allreduce_bandwidth": ring / statistics.median(times[1:]),
        "send_overhead": posting,
        "exchange_latency": exchange,
    }


def _compute_for(seconds: float, operands: tuple[Tensor, Tensor]) -> None:
    """Multiply matrices for ``seconds`` (one rank's compute between two transfers)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        torch.mm(*operands)


def _loaded_hop(nbytes: int, busy: float, rounds: int, device: torch.device) -> tuple[float, float]:
    """Median seconds one transfer of ``nbytes`` adds to a relay between ranks 0 and 1 that
    compute for ``busy`` seconds between transfers, beyond the sender's posting of it (each
    round's trip less that round's postings), and the seconds the sender spends posting it
    (:func:`unloaded`), as the executor sends and receives (the receive of the reply posted just before each
    send, :meth:`~lightning_pipe.runtime.comm.mailbox.Mailbox.post_next`, and counted in the
    posting). Rank 0's result is the measurement.

    Pipeline ranks compute between transfers. On a CPU host the processes share the cores with
    the transport's threads, and a transfer posted right after computing costs more than
    between idle processes, the more so the longer the compute. The other ranks compute
    meanwhile, as they would in a step.
    """
    import torch.distributed as dist

    from lightning_pipe.runtime.comm import p2p

    rank, payload = dist.get_rank(), torch.zeros(max(nbytes // 4, 1), device=device)
    operands = (torch.randn(128, 128, device=device), torch.randn(128, 128, device=device))
    specs, peer = p2p.specs_of([payload]), 1 - rank
    incoming = p2p.Incoming(peer, device, specs) if rank == 1 else None  # rank 1 receives first
    trips, posts = [], []
    dist.barrier()
    for _ in range(rounds + 1):
        start = time.perf_counter()
        if rank == 1:
            incoming.wait()  # type: ignore[union-attr]
        _compute_for(busy, operands)
        if rank < 2:
            posted = time.perf_counter()
            incoming = p2p.Incoming(peer, device, specs)
            transfer = p2p.send_tensors([payload], peer, device, posted=specs)
            posts.append(time.perf_counter() - posted)
        if rank == 0:
            incoming.wait()  # type: ignore[union-attr]
            trips.append(time.perf_counter() - start)
        if rank < 2:
            transfer.wait()
    if rank == 0:  # rank 1's last receive is for a message that never came: rank 0 sends one more
        p2p.send_tensors([payload], peer, device, posted=specs).wait()
    elif rank == 1:
        incoming.wait()  # type: ignore[union-attr]
    if rank == 1:
        dist.send(torch.tensor(posts, dtype=torch.float64), 0)
    if rank != 0:
        return 0.0, statistics.median(posts[1:]) if posts else 0.0
    theirs = torch.zeros(len(posts), dtype=torch.float64)
    dist.recv(theirs, 1)
    # Each round's trip less its own compute and both postings, so that a slow posting (a busy
    # host) cancels against the trip it lengthened instead of against another round's.
    hops = [
        (trip - 2 * busy - mine - other) / 2 for trip, mine, other in zip(trips[1:], posts[1:], theirs.tolist()[1:])
    ]
    return max(statistics.median(hops), 0.0), unloaded(posts[1:])


def unloaded(seconds: list[float]) -> float:
    """The lower quartile of ``seconds`` (its value for one): what a step of the host's own work
    takes when no other process took its core meanwhile. With more ranks than cores a posting is
    preempted in a share of the rounds that hangs on how the ranks' compute lines up, so its
    median jumps between runs (0.2 ms in one profile of 4 ranks on 2 cores, 2.6 ms in the next).
    Load only adds time: the fastest rounds are the nearest to the posting itself."""
    if len(seconds) < 2:
        return seconds[0] if seconds else 0.0
    return statistics.quantiles(seconds, n=4, method="inclusive")[0]


#: Bytes of the message each rank sends in the exchange measurement (a GPT example activation is 128-256 KiB).
EXCHANGE_BYTES = 128 * 2**10


def _exchange_hop(nbytes: int, busy: float, rounds: int, device: torch.device) -> float:
    """Median seconds a message of ``nbytes`` takes to arrive when ranks 0 and 1 compute for
    ``busy`` seconds, then send each other one at once and wait for the other's, as the
    executor sends and receives; from the sender's posting to the receiver having it (one
    clock for the processes of a host). Rank 0's result is the measurement.

    Under gloo on a CPU host such a message arrives about ten times later than one sent to a
    waiting rank: a pipeline whose ranks send each other at the same moment (1F1B's steady state with many
    microbatches, interleaved 1F1B) waits that long for each such message
    (:class:`~lightning_pipe.schedules.simulate.Exchange`)."""
    import torch.distributed as dist

    from lightning_pipe.runtime.comm import p2p

    rank, payload = dist.get_rank(), torch.zeros(max(nbytes // 4, 1), device=device)
    operands = (torch.randn(128, 128, device=device), torch.randn(128, 128, device=device))
    specs, peer = p2p.specs_of([payload]), 1 - rank
    sent, arrived = [], []
    for _ in range(rounds + 1):  # the other ranks compute meanwhile
        dist.barrier()
        _compute_for(busy, operands)
        if rank >= 2:
            continue
        sent.append(time.time())
        incoming = p2p.Incoming(peer, device, specs)  # as the executor: posted just before the send to that peer
        transfer = p2p.send_tensors([payload], peer, device, posted=specs)
        incoming.wait()
        arrived.append(time.time())
        transfer.wait()
    if rank == 1:
        dist.send(torch.tensor(sent, dtype=torch.float64), 0)
        dist.send(torch.tensor(arrived, dtype=torch.float64), 0)
    if rank != 0:
        return 0.0
    their_sent, their_arrived = torch.zeros(len(sent), dtype=torch.float64), torch.zeros(len(sent), dtype=torch.float64)
    dist.recv(their_sent, 1)
    dist.recv(their_arrived, 1)
    delays = [a - s for a, s in zip(arrived[1:], their_sent.tolist()[1:])] + [
        a - s for a, s in zip(their_arrived.tolist()[1:], sent[1:])
    ]
    return max(statistics.median(delays), 0.0)


def _posting(nbytes: int, repeats: int, device: torch.device) -> float:
    """Median seconds rank 0 spends posting one transfer of ``nbytes`` to rank 1 as the executor
    does once the link's shapes are known (:func:`~lightning_pipe.runtime.p2p.send_tensors`:
    one message, header and tensor packed), not counting its delivery."""
    import torch.distributed as dist

    from lightning_pipe.runtime.comm import p2p

    t = torch.zeros(max(nbytes // 4, 1), device=device)
    specs, times = p2p.specs_of([t]), []
    for _ in range(repeats + 1):
        dist.barrier()
        if dist.get_rank() == 0:
            start = time.perf_counter()
            transfer = p2p.send_tensors([t], 1, device, posted=specs)
            times.append(time.perf_counter() - start)
            transfer.wait()
        elif dist.get_rank() == 1:
            p2p.Incoming(0, device, specs).wait()
    return statistics.median(times[1:]) if times else 0.0


def _threaded_link_worker(rank: int, world: int, threads: int, *args: Any) -> dict[str, float]:
    torch.set_num_threads(threads)
    return _link_worker(rank, world, *args)


def profile_links(
    world: int = 2,
    small: int = 1024,
    large: int = 8 * 2**20,
    repeats: int = 5,
    threads: int = 1,
    busy: float = LOADED_GAP,
) -> dict[str, float]:
    """Measure this machine's transfers between local gloo processes: latency (a small message,
    between processes that compute ``busy`` seconds between transfers on ``threads`` torch
    threads each, as the job's ranks will), the latency of a message in an exchange (two ranks
    that compute, then send each other one at once), bandwidth (the slope to a large one) and
    the bandwidth of a ring all-reduce over ``world``."""
    from lightning_pipe.runtime.spawn import run_gloo

    status, value = run_gloo(
        _threaded_link_worker, world, threads, small, large, repeats, torch.device("cpu"), busy, timeout=120.0
    )[0]
    if status != "ok":
        raise RuntimeError(f"link profiling failed: {value}")
    return value
