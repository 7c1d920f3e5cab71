"""The action programs of a plan, built once and cached, and what each stage holds while it runs them."""

from __future__ import annotations

import functools
import itertools
import weakref
from typing import Any, Optional

import numpy as np

from lightning_pipe.core.pipeline_plan import PipelinePlan
from lightning_pipe.planning.held import HeldCounts, Moment, buffered_by_kind, program_held_counts, rank_moments
from lightning_pipe.schedules import Action, Kind, build_schedule, two_bw_drain, two_bw_window
from lightning_pipe.schedules.flat import FlatProgram, flatten
from lightning_pipe.schedules.layout import rank_stages
from lightning_pipe.schedules.registry import get
from lightning_pipe.schedules.simulate import CompiledProgram, compile_program


def program(plan: PipelinePlan, steps: int = 1) -> list[list[Action]]:
    """The action lists the executor runs for ``plan`` (``steps`` 2BW windows and the drain)."""
    return _program(*program_key(plan, steps))


def program_key(plan: PipelinePlan, steps: int) -> tuple:
    return (
        plan.schedule,
        plan.depth,
        plan.microbatches,
        plan.split_backward,
        plan.split_max_pending,
        plan.split_placement,
        steps,
        plan.virtual_stages,
        plan.stage_placement,
    )


@functools.lru_cache(maxsize=1024)
def _program(
    schedule: str,
    depth: int,
    m: int,
    split: bool,
    max_pending: Optional[int],
    placement: Optional[str],
    steps: int,
    virtual: int = 1,
    stage_placement: str = "loop",
) -> list[list[Action]]:
    if get(schedule).streams:  # two_bw_run, from windows shared between the runs of 2 and 3 windows
        parts = [_two_bw_part(depth, m, t, split, False, virtual, stage_placement) for t in range(steps)]
        parts.append(_two_bw_part(depth, m, steps - 1, split, True, virtual, stage_placement))
        return [list(itertools.chain.from_iterable(part[s] for part in parts)) for s in range(depth)]
    return build_schedule(schedule, depth, m, split, max_pending, virtual, placement, stage_placement)


@functools.lru_cache(maxsize=1024)
def _two_bw_part(
    depth: int, m: int, step: int, split: bool, drain: bool, virtual: int = 1, stage_placement: str = "loop"
) -> list[list[Action]]:
    return (two_bw_drain if drain else two_bw_window)(depth, m, step, split, virtual=virtual, placement=stage_placement)


@functools.lru_cache(maxsize=4)
def _begins(*key: Any) -> Optional[np.ndarray]:
    """Per action of the flat program of ``key``, whether the executor starts a new program there:
    each 2BW window and the drain run as programs of their own, on one stage per rank and on
    several (runtime/engine.py, ``_window``; ``None``: one program per rank)."""
    schedule, depth, m, split, _, _, steps, virtual, stage_placement = key
    if not get(schedule).streams:
        return None
    parts = [_two_bw_part(depth, m, t, split, False, virtual, stage_placement) for t in range(steps)]
    parts.append(_two_bw_part(depth, m, steps - 1, split, True, virtual, stage_placement))
    marks = []
    for s in range(depth):
        for part in parts:
            marks += [True] + [False] * (len(part[s]) - 1) if part[s] else []
    return np.array(marks, bool)


def program_begins(*key: Any) -> Optional[np.ndarray]:
    """Per action of the program of :func:`program_key` ``key`` as arrays, where each of the
    executor's programs begins (2BW's windows and drain; ``None`` where one program runs)."""
    return _begins(*key)


@functools.lru_cache(maxsize=1024)
def compiled_program(*key: Any) -> CompiledProgram:
    return compile_program(_program(*key), _flat(*key))


@functools.lru_cache(maxsize=4)  # a search asks for one program's arrays a few times in a row
def _flat(*key: Any) -> FlatProgram:
    return flatten(_program(*key))


def flat_program(*key: Any) -> FlatProgram:
    """The program of :func:`program_key` ``key`` as arrays (cached for the last few keys)."""
    return _flat(*key)


#: One object per distinct :class:`HeldCounts`: programs of many lengths share them, and caches keyed by them hit.
_SHARED_COUNTS: "weakref.WeakValueDictionary[HeldCounts, HeldCounts]" = weakref.WeakValueDictionary()


@functools.lru_cache(maxsize=1024)
def _held(*key: Any) -> list[HeldCounts]:
    streamed = key[2] if get(key[0]).streams else 0
    counts = program_held_counts(_program(*key), streamed, _flat(*key), _begins(*key))
    return [_SHARED_COUNTS.setdefault(c, c) for c in counts]


def held(plan: PipelinePlan) -> list[HeldCounts]:
    """Microbatches each stage of ``plan``'s program holds at each kind of moment (cost-free, cached;
    one stage per rank: interleaved plans have :func:`moments`)."""
    if plan.virtual_stages > 1:
        raise ValueError(f"an interleaved rank runs several stages: use planner.moments ({plan.describe()})")
    return _held(*program_key(plan, 3 if plan.spec.streams else 1))


@functools.lru_cache(maxsize=1024)
def _moments(*key: Any, shared: bool = False) -> list[tuple[Moment, ...]]:
    depth, virtual, placement, program, flat = key[1], key[-2], key[-1], _program(*key), _flat(*key)
    # Interleaved 2BW: each window is a program of its own, which posts only the receives it reads.
    sent, streamed = buffered_by_kind(flat, _begins(*key)), key[2] if get(key[0]).streams else 0
    return [
        rank_moments(actions, rank_stages(r, depth, virtual, placement), sent[flat.rank(r)], streamed, shared)
        for r, actions in enumerate(program)
    ]


def clear_caches() -> None:
    """Forget every program, compiled program and count cached by earlier searches: the next
    search builds them again (as the first search of a process does)."""
    for cached in (_program, _two_bw_part, compiled_program, _flat, _begins, _held, _moments, _gradient_sets):
        cached.cache_clear()


def moments(plan: PipelinePlan) -> list[tuple[Moment, ...]]:
    """Every pipeline rank's distinct moments over all its stages (:func:`~.held.rank_moments`; cached).
    Interleaved 2BW: over three windows and the drain, each moment warm once its own batch has
    gradients (as :func:`held` walks one-stage 2BW); with replicas once its rank's bucket of that
    batch exists, which spans the rank's stages (:func:`~.held.rank_moments`, ``shared``)."""
    return _moments(*program_key(plan, 3 if plan.spec.streams else 1), shared=plan.spec.streams and plan.width > 1)


def gradient_sets(plan: PipelinePlan) -> list[int]:
    """Per stage, the most batches' gradients it holds at once over a 2BW stream of three windows
    and the drain (1 for a flushed schedule): a stage's gradient of batch ``t`` exists from its
    first backward (or W) of the batch to its rank's optimizer step for ``t``. Under interleaved
    2BW a rank's stages differ: the one whose backwards of the next batch start before the
    rank's deferred step holds two, the others one (cached)."""
    return list(_gradient_sets(*program_key(plan, 3 if plan.spec.streams else 1)))


@functools.lru_cache(maxsize=1024)
def _gradient_sets(*key: Any) -> tuple[int, ...]:
    m, out = key[2], {}
    for actions in _program(*key):
        held: dict[int, set[int]] = {}
        stepped = 0
        for a in actions:
            if a.kind is Kind.BACKWARD or a.kind is Kind.WEIGHT_GRAD:
                batches = held.setdefault(a.stage, set())
                batches.add(a.microbatch // m)
                out[a.stage] = max(out.get(a.stage, 1), len(batches))
            elif a.kind is Kind.OPTIMIZER_STEP:
                for batches in held.values():
                    batches.discard(stepped)
                stepped += 1
    return tuple(out.get(s, 1) for s in range(max(out, default=-1) + 1))
