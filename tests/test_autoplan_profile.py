"""The AutoPlanner's in-job profile: who profiles when, and at which microbatch sizes (one process, dist faked)."""

from __future__ import annotations

import itertools
import threading
import time

import pytest
import torch

from lightning_pipe.lightning import autoplan


def _threads_as_ranks(monkeypatch: pytest.MonkeyPatch, world: int) -> threading.local:
    """``dist`` faked for ``world`` threads of this process, each a rank: its rank, the world, a barrier."""
    local, barrier = threading.local(), threading.Barrier(world)
    monkeypatch.setattr(autoplan.dist, "get_rank", lambda: local.rank)
    monkeypatch.setattr(autoplan.dist, "get_world_size", lambda: world)
    monkeypatch.setattr(autoplan.dist, "barrier", lambda: barrier.wait(timeout=30))
    return local


@pytest.mark.parametrize("shared", [True, False])
def test_ranks_sharing_a_hosts_cores_profile_one_at_a_time_and_each_keeps_its_own_result(
    monkeypatch: pytest.MonkeyPatch, shared: bool
) -> None:
    world = 4
    local = _threads_as_ranks(monkeypatch, world)
    spans: dict[int, tuple[float, float]] = {}
    results: dict[int, object] = {}
    every_rank_inside = threading.Barrier(world)  # unshared: all ranks are inside at once

    def work() -> str:
        start = time.perf_counter()
        if not shared:
            every_rank_inside.wait(timeout=30)
        time.sleep(0.01)
        spans[local.rank] = (start, time.perf_counter())
        return f"rank {local.rank}"

    def rank(r: int) -> None:
        local.rank = r
        results[r] = autoplan._in_turn(work, shared)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {r: f"rank {r}" for r in range(world)}
    overlapping = [(a, b) for a, b in itertools.combinations(range(world), 2) if _overlap(spans[a], spans[b])]
    assert overlapping == ([] if shared else list(itertools.combinations(range(world), 2)))


def _overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def _bent(size: int) -> float:
    """A block's seconds at ``size`` samples: a per-call overhead and a line, bent upward by caches."""
    return 1e-4 + 1e-3 * size + 1e-3 * size * size / 32


@pytest.mark.parametrize("captured_size", [32, 12])
def test_the_in_job_profile_prices_every_smaller_microbatch_by_interpolation(captured_size: int) -> None:
    from lightning_pipe.planning.profile import BlockProfile, BlockSample
    from lightning_pipe.runtime.microbatch import batch_size

    captured = [(torch.arange(captured_size * 3.0).reshape(captured_size, 3),)]
    inputs = autoplan._profile_inputs(captured)
    sizes = [batch_size(x) for x in inputs]
    assert sizes == sorted(set(sizes)) and sizes[0] == 1 and sizes[-1] == captured_size
    for x, n in zip(inputs, sizes):  # the captured microbatch's first rows
        assert torch.equal(x[0], captured[0][0][:n])
    samples = [BlockSample(n, _bent(n), 2 * _bent(n), _bent(n), _bent(n), 100 * n, 10 * n) for n in sizes]
    block = BlockProfile("bent", samples, 0, 0, 0)
    for size in range(1, captured_size + 1):  # every microbatch a plan of the job can take
        assert block.at(size).forward == pytest.approx(_bent(size), rel=0.1)
        assert block.at(size).backward == pytest.approx(2 * _bent(size), rel=0.1)


@pytest.mark.parametrize(
    ("captured", "others", "expected"),
    [
        # stage 0 gets token ids, the links carry activations: the smallest activation any rank receives
        ({0: [(torch.zeros(32, 64, dtype=torch.int64),)]}, [32 * 64 * 96 * 4, 32 * 64 * 128 * 4], 32 * 64 * 96 * 4),
        # a rank holding stages 0 and 3 (interleaved) reads stage 3's input only
        ({0: [(torch.zeros(8, 4, dtype=torch.int64),)], 3: [(torch.zeros(8, 4, 512),)]}, [], 8 * 4 * 512 * 4),
        # activations above 1 MiB are measured at 1 MiB
        ({1: [(torch.zeros(64, 64, 128),)]}, [], 2**20),
        # one stage: no link carries anything; the smallest input, at least 16 KiB
        ({0: [(torch.zeros(4, 8, dtype=torch.int64),)]}, [], 2**14),
    ],
)
def test_the_link_measurement_sends_what_the_links_carry_not_the_datas_token_ids(
    monkeypatch: pytest.MonkeyPatch, captured: dict, others: list[int], expected: int
) -> None:
    def all_reduce(sizes: torch.Tensor, op: object) -> None:  # other ranks, each receiving one of ``others``
        assert op == autoplan.dist.ReduceOp.MIN
        sizes[0] = min([float(sizes[0])] + [float(n) for n in others])

    monkeypatch.setattr(autoplan.dist, "all_reduce", all_reduce)
    assert autoplan._link_bytes(captured, torch.device("cpu")) == expected
