"""Split a chain of blocks into contiguous pipeline stages."""

from __future__ import annotations

from typing import Sequence, Union

from torch import nn

PartitionSpec = Union[str, Sequence[int]]


def block_cost(block: nn.Module) -> float:
    """Default cost of a block: its parameter count, plus one so parameter-free blocks count."""
    return float(sum(p.numel() for p in block.parameters()) + 1)


def uniform(num_blocks: int, depth: int) -> list[int]:
    """Equal block counts per stage; the first ``num_blocks % depth`` stages take one more."""
    base, extra = divmod(num_blocks, depth)
    return [base + (s < extra) for s in range(depth)]


def balanced(costs: Sequence[float], depth: int) -> list[int]:
    """Contiguous split minimising the largest stage cost (exact dynamic program)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][i]: minimal max-stage cost of putting the first i blocks on s stages.
    best = [[inf] * (n + 1) for _ in range(depth + 1)]
    cut = [[0] * (n + 1) for _ in range(depth + 1)]
    best[0][0] = 0.0
    for s in range(1, depth + 1):
        for i in range(s, n + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], prefix[i] - prefix[j])
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    sizes, i = [], n
    for s in range(depth, 0, -1):
        sizes.append(i - cut[s][i])
        i = cut[s][i]
    return sizes[::-1]


def partition_sizes(spec: PartitionSpec, costs: Sequence[float], depth: int) -> list[int]:
    """Blocks per stage for ``spec``: "uniform", "balanced" or an explicit list of counts.

    Raises:
        ValueError: if there are fewer blocks than stages or the explicit list does not fit.
    """
    n = len(costs)
    if n < depth:
        raise ValueError(
            f"cannot split {n} pipeline blocks over pipeline_depth={depth} stages: need at least one block per stage"
        )
    if spec == "uniform":
        return uniform(n, depth)
    if spec == "balanced":
        return balanced(costs, depth)
    if isinstance(spec, str):
        raise ValueError(f"unknown partition {spec!r}; use 'balanced', 'uniform' or a list of blocks per stage")
    sizes = [int(s) for s in spec]
    if len(sizes) != depth or sum(sizes) != n or min(sizes) < 1:
        raise ValueError(f"partition {sizes} must list {depth} positive block counts summing to {n}")
    return sizes


def stage_ranges(sizes: Sequence[int]) -> list[range]:
    """Block index range of each stage."""
    starts = [sum(sizes[:s]) for s in range(len(sizes))]
    return [range(start, start + size) for start, size in zip(starts, sizes)]
