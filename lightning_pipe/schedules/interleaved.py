"""Interleaved 1F1B: each rank runs ``v`` non-adjacent stages ("virtual stages", model chunks).

Megatron-LM's interleaved schedule (Narayanan et al., "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM", SC 2021, section 2.2.2). The chain is cut into
``d * v`` stages; stage ``s`` runs on pipeline rank ``s % d``, so rank ``r`` holds stages
``r, r + d, ..., r + (v - 1) d`` and a microbatch passes every rank ``v`` times. Each action
costs ``1/v`` of a rank's whole share, which shrinks the bubble by ``v``: with per-chunk
forward and backward times ``F`` and ``B`` it is ``(d - 1)(F + B)``, a fraction
``(d - 1) / (v m)`` of the ideal step ``v m (F + B)``, at the price of ``v`` times the messages.

Forwards run in rounds of ``d`` microbatches per chunk: chunk 0 of microbatches ``0..d-1``,
chunk 1 of the same, ..., chunk ``v-1``, then chunk 0 of microbatches ``d..2d-1``; backwards
the same with the chunks in reverse. Rank ``r`` warms up with ``2 (d - 1 - r) + (v - 1) d``
forwards, then alternates, then cools down. ``m`` must be a multiple of ``d``.

With split backward (``build_schedule(..., split=True, virtual=v)``) each rank's B's become
I's and the rank places its W's as Zero Bubble's ZB-H1 does (schedules/w_placement.py: rank ``r``
keeps at most ``r`` W's waiting): the bubble becomes ``(d - 1)(F + I - W)`` in per-chunk costs
(for ``W <= F``), and no rank holds more chunks than this schedule's first rank.

d=2, v=2, m=2 (stages 0 and 2 on rank 0, 1 and 3 on rank 1)::

    rank 0: 0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1
    rank 1: 1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1
"""

from __future__ import annotations

from lightning_pipe.schedules.actions import Action, Kind, action
from lightning_pipe.schedules.layout import rank_stages


def check(depth: int, microbatches: int, virtual: int) -> None:
    """Raise a clear error unless ``(d, m, v)`` is a valid interleaved layout."""
    if virtual < 1:
        raise ValueError(f"virtual_stages must be >= 1, got {virtual}")
    if virtual > 1 and depth < 2:
        raise ValueError("virtual_stages > 1 needs pipeline_depth >= 2 (one rank gains nothing from interleaving)")
    if virtual > 1 and microbatches % depth:
        raise ValueError(
            f"interleaved 1F1B runs microbatches in rounds of pipeline_depth={depth}: "
            f"microbatches ({microbatches}) must be a multiple of it"
        )


def _chunk_and_microbatch(k: int, depth: int, virtual: int, forward: bool) -> tuple[int, int]:
    """The chunk and microbatch of a rank's ``k``-th forward (or backward)."""
    round_, within = divmod(k, depth * virtual)
    chunk = within // depth
    return (chunk if forward else virtual - 1 - chunk), round_ * depth + within % depth


def compute_action(rank: int, depth: int, virtual: int, k: int, kind: Kind) -> Action:
    """Rank ``rank``'s ``k``-th forward (or backward) in the interleaved order; ``k`` may run past
    one step's ``m v``, as interleaved 2BW's never-flushed stream does (schedules/two_bw.py)."""
    chunk, microbatch = _chunk_and_microbatch(k, depth, virtual, kind is Kind.FORWARD)
    return action(chunk * depth + rank, kind, microbatch)


def interleaved_one_f_one_b(rank: int, depth: int, microbatches: int, virtual: int) -> list[Action]:
    """Rank ``rank``'s compute actions (F and B of its ``virtual`` stages) for one step."""
    check(depth, microbatches, virtual)
    total = microbatches * virtual
    warmup = min(2 * (depth - 1 - rank) + (virtual - 1) * depth, total)
    out = [compute_action(rank, depth, virtual, k, Kind.FORWARD) for k in range(warmup)]
    for k in range(total - warmup):
        out += [
            compute_action(rank, depth, virtual, warmup + k, Kind.FORWARD),
            compute_action(rank, depth, virtual, k, Kind.BACKWARD),
        ]
    out += [compute_action(rank, depth, virtual, k, Kind.BACKWARD) for k in range(total - warmup, total)]
    return out


def rank_one_f_one_b(rank: int, depth: int, microbatches: int, virtual: int, placement: str = "loop") -> list[Action]:
    """:func:`interleaved_one_f_one_b` as the registry calls it (the loop placement only)."""
    if placement != "loop":
        raise ValueError(f"interleaved 1F1B runs the loop placement, not {placement!r}")
    return interleaved_one_f_one_b(rank, depth, microbatches, virtual)


def looped_bfs(rank: int, depth: int, microbatches: int, virtual: int, placement: str = "loop") -> list[Action]:
    """Looped BFS (torch.distributed.pipelining's ``ScheduleLoopedBFS``; Lamy-Poirier,
    "Breadth-First Pipeline Parallelism", MLSys 2023): GPipe over the rank's stages in chain
    order (every forward of its first stage, then of its next), then every backward, its last
    stage first. It holds all ``m`` microbatches of every stage of the rank, as GPipe does, and
    runs under any placement: its order depends only on which stages the rank holds.

    d=2, v=2, m=2, loop placement::

        rank 0: 0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1
        rank 1: 1F0 1F1 3F0 3F1 3B0 3B1 1B0 1B1
    """
    stages = rank_stages(rank, depth, virtual, placement)
    mbs = range(microbatches)
    return [action(s, Kind.FORWARD, k) for s in stages for k in mbs] + [
        action(s, Kind.BACKWARD, k) for s in reversed(stages) for k in mbs
    ]


def forwards(rank: int, depth: int, microbatches: int, virtual: int) -> list[Action]:
    """Rank ``rank``'s forwards in the interleaved order, for inference."""
    return [compute_action(rank, depth, virtual, k, Kind.FORWARD) for k in range(microbatches * virtual)]
