"""Which pipeline rank runs which stage: the loop (interleaved) and V-shaped stage placements.

With ``d`` ranks of ``v`` stages each the chain is cut into ``d * v`` stages:

- ``"loop"`` (Megatron-LM's interleaved 1F1B, Narayanan et al., SC 2021): stage ``s`` on rank
  ``s % d``, so rank ``r`` holds ``r, r + d, ..., r + (v - 1) d`` and a microbatch passes
  ranks ``0..d-1`` ``v`` times in the same direction.
- ``"v"`` (Zero Bubble's ZB-V, Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024,
  section 6): the direction alternates per round, so with ``v = 2`` rank ``r`` holds stages
  ``r`` and ``2d - 1 - r``: the microbatch goes down ranks ``0..d-1`` and comes back up
  ``d-1..0``. Rank ``d - 1`` holds two adjacent stages (``d - 1`` and ``d``), whose handoff
  needs no message, and the last stage is on rank 0, beside the first.

d=3, v=2::

    loop: rank 0: stages 0 3   rank 1: stages 1 4   rank 2: stages 2 5
    v:    rank 0: stages 0 5   rank 1: stages 1 4   rank 2: stages 2 3
"""

from __future__ import annotations

from typing import Sequence

from lightning_pipe.schedules.actions import Action

#: The stage placements, the default first.
STAGE_PLACEMENTS = ("loop", "v")


def check_placement(placement: str) -> None:
    """Raise a clear ``ValueError`` for a stage placement that does not exist."""
    if placement not in STAGE_PLACEMENTS:
        raise ValueError(f"unknown stage placement {placement!r}; use one of {STAGE_PLACEMENTS}")


def stage_rank(stage: int, depth: int, placement: str = "loop") -> int:
    """The pipeline rank that runs ``stage`` of a ``depth``-rank pipeline under ``placement``."""
    check_placement(placement)
    round_, within = divmod(stage, depth)
    return depth - 1 - within if placement == "v" and round_ % 2 else within


def rank_stages(rank: int, depth: int, virtual: int, placement: str = "loop") -> list[int]:
    """The stages pipeline rank ``rank`` runs, in chain order (one per round of ``depth`` stages)."""
    check_placement(placement)
    return [c * depth + (depth - 1 - rank if placement == "v" and c % 2 else rank) for c in range(virtual)]


def stage_ranks(depth: int, virtual: int, placement: str = "loop") -> list[int]:
    """The rank of every stage of the chain, by stage."""
    return [stage_rank(s, depth, placement) for s in range(depth * virtual)]


def owners(schedule: Sequence[Sequence[Action]]) -> dict[int, int]:
    """The rank each stage of a program runs on, read from the program (rank ``r`` runs
    ``schedule[r]``): what sends and receives need, whatever the placement."""
    return {a.stage: rank for rank, actions in enumerate(schedule) for a in actions}
