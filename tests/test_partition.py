"""Pure tests of partitioning and topology validation."""

from __future__ import annotations

import itertools

import pytest

from lightning_pipe import Topology
from lightning_pipe.core.partition import balanced, partition_sizes, uniform


def _best_by_brute_force(costs: list[float], depth: int) -> float:
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), depth - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


@pytest.mark.parametrize(
    "costs,depth", [([1, 2, 3, 4, 5, 6], 3), ([9, 1, 1, 1, 1, 9], 2), ([5, 1, 1, 1, 1, 1, 1, 5], 4)]
)
def test_balanced_is_optimal(costs: list[float], depth: int) -> None:
    sizes = balanced(costs, depth)
    assert sum(sizes) == len(costs) and min(sizes) >= 1 and len(sizes) == depth
    starts = [sum(sizes[:s]) for s in range(depth)]
    worst = max(sum(costs[a : a + n]) for a, n in zip(starts, sizes))
    assert worst == _best_by_brute_force(costs, depth)


def test_uniform_and_explicit() -> None:
    assert uniform(10, 4) == [3, 3, 2, 2]
    assert partition_sizes([2, 1, 1], [1.0] * 4, 3) == [2, 1, 1]
    with pytest.raises(ValueError, match="must list 3 positive block counts summing to 4"):
        partition_sizes([2, 2, 1], [1.0] * 4, 3)
    with pytest.raises(ValueError, match="unknown partition"):
        partition_sizes("random", [1.0] * 4, 2)


def test_more_stages_than_blocks_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot split 3 pipeline blocks over pipeline_depth=4"):
        partition_sizes("balanced", [1.0] * 3, 4)


def test_topology_layout_and_errors() -> None:
    topo = Topology(6, 3)
    assert topo.width == 2
    assert [(topo.replica_of(r), topo.position_of(r)) for r in range(6)] == [
        (0, 0),
        (0, 1),
        (0, 2),
        (1, 0),
        (1, 1),
        (1, 2),
    ]
    assert all(topo.rank_of(topo.replica_of(r), topo.position_of(r)) == r for r in range(6))
    with pytest.raises(ValueError, match="world size 6 is not divisible by pipeline_depth=4"):
        Topology(6, 4)
