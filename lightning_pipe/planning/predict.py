"""Predicted step time (the simulator over the plan's real program) and peak memory per pipeline rank."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from lightning_pipe.core.pipeline_plan import PipelinePlan
from lightning_pipe.planning.costs import (
    StageCosts,
    action_cost,
    batch_bytes,
    gathering_pending,
    gathers,
    gradient_sets,
    stage_costs,
    step_bytes,
    traffic,
    weight_versions,
)
from lightning_pipe.planning.held import HeldCounts
from lightning_pipe.planning.memory import Sharding, rank_peak_bytes, stage_peak_bytes
from lightning_pipe.planning.profile import BlockSample, Profile
from lightning_pipe.planning.programs import compiled_program, flat_program, held, moments, program_key
from lightning_pipe.planning.programs import gradient_sets as program_gradient_sets
from lightning_pipe.schedules import Action, Kind
from lightning_pipe.schedules.actions import COMPUTE_KINDS, MESSAGE_KINDS
from lightning_pipe.schedules.simulate import CompiledProgram, Exchange, SharedCores, shared_run

#: What keeps a rank on a core of a host whose cores the ranks share: compute, the optimizer step,
#: and moving messages (a send packs and copies its tensors, a receive's bytes are copied on the
#: CPU, and the executor runs its own work around each). A receive's waiting is no action's: the
#: simulator starts it when its message arrives.
_CPU_KINDS = COMPUTE_KINDS | MESSAGE_KINDS | {Kind.OPTIMIZER_STEP}


def exchange(profile: Profile) -> Optional[Exchange]:
    """What a message two ranks send each other at once costs beyond any other, from the
    profile's links (``None`` where its exchange latency is not above its link latency).

    "At once" is while the other rank posts its own send: the two sends end within one posting
    (:attr:`Profile.send_overhead`) of each other. Two sends further apart find the other rank's
    receive posted, or that rank computing, as a message sent to a waiting rank does."""
    extra = profile.exchange_latency - profile.link_latency
    return Exchange(profile.send_overhead, extra) if extra > 0 and profile.send_overhead > 0 else None


def step_time(
    plan: PipelinePlan,
    cost: Callable[[Action], float],
    sharing: Optional[SharedCores] = None,
    exchange: Optional[Exchange] = None,
) -> float:
    """Seconds of one step of ``plan``'s program under ``cost`` (the simulator's makespan, on the
    program compiled once). 2BW never flushes: its step is one steady-state window, the
    difference of runs of 3 and 2 windows.

    ``sharing``: the job's ranks compute on one host's shared cores (a CPU job), so that a rank
    computes slower while more ranks compute with it (:func:`~lightning_pipe.schedules.simulate.shared_run`);
    ``cost`` is then each action's seconds alone. ``exchange``: charge the messages two ranks
    send each other at once more (:func:`exchange`)."""
    if plan.spec.streams:
        return _makespan(plan, 3, cost, sharing, exchange) - _makespan(plan, 2, cost, sharing, exchange)
    return _makespan(plan, 1, cost, sharing, exchange)


def _makespan(
    plan: PipelinePlan,
    steps: int,
    cost: Callable[[Action], float],
    sharing: Optional[SharedCores],
    exchange: Optional[Exchange],
) -> float:
    compiled = compiled_program(*program_key(plan, steps))
    costs = compiled.costs_from(cost)
    if sharing is None:
        return compiled.makespan(costs, exchange)
    return _shared(plan, steps, compiled, costs, sharing, exchange)[0]


def _shared(
    plan: PipelinePlan,
    steps: int,
    compiled: CompiledProgram,
    costs: list[float],
    sharing: SharedCores,
    exchange: Optional[Exchange],
) -> tuple[float, list[float], list[float]]:
    key_of = compiled.key_of.tolist()
    computes = [a.kind in _CPU_KINDS for a in compiled.keys]
    return shared_run(
        flat_program(*program_key(plan, steps)),
        [costs[k] for k in key_of],
        [computes[k] for k in key_of],
        sharing,
        exchange,
    )


def sharing(profile: Profile, plan: PipelinePlan) -> Optional[SharedCores]:
    """How ``plan``'s ranks share the cores of the profile's host (``None``: each rank computes
    on a device of its own, or there are cores enough for every rank)."""
    if profile.cores is None or plan.world_size <= profile.cores:
        return None
    return SharedCores(profile.cores, plan.width)


def slowdowns(profile: Profile, plan: PipelinePlan, cost: Callable[[Action], float]) -> dict[tuple[int, Kind], float]:
    """Per ``(stage, kind)`` of the plan's computing actions, how many times their seconds alone
    they take on average in the job, its ranks sharing the host's cores (:func:`sharing`; all 1
    without sharing)."""
    steps = 3 if plan.spec.streams else 1
    compiled = compiled_program(*program_key(plan, steps))
    costs = compiled.costs_from(cost)
    shared = sharing(profile, plan)
    if shared is None:
        return {(a.stage, a.kind): 1.0 for a in compiled.keys}
    _, starts, ends = _shared(plan, steps, compiled, costs, shared, exchange(profile))
    taken, alone = [0.0] * len(compiled.keys), [0.0] * len(compiled.keys)
    for k, s, e in zip(compiled.key_of.tolist(), starts, ends):
        taken[k] += e - s
        alone[k] += costs[k]
    return {(a.stage, a.kind): t / c if c > 0 else 1.0 for a, t, c in zip(compiled.keys, taken, alone)}


def predict_step(
    profile: Profile, plan: PipelinePlan, microbatch_size: int, costs: Optional[Sequence[StageCosts]] = None
) -> tuple[float, list[HeldCounts]]:
    """Predicted seconds of one training step (:func:`step_time`, plus the profile's step
    overhead of the plan's layout outside the program, :meth:`Profile.overhead_of`), and the
    microbatches each stage holds (:func:`held`; empty for an interleaved plan, whose ranks have
    :func:`moments`). ``costs``: the plan's :func:`stage_costs`, if already summed."""
    cost = action_cost(profile, plan, costs if costs is not None else stage_costs(profile, plan, microbatch_size))
    seconds = step_time(plan, cost, sharing(profile, plan), exchange(profile))
    seconds += profile.overhead_of(plan.width, plan.depth)
    return seconds, (held(plan) if plan.virtual_stages == 1 else [])


def predict_memory(
    profile: Profile,
    plan: PipelinePlan,
    microbatch_size: int,
    held: Sequence[HeldCounts],
    costs: Optional[Sequence[StageCosts]] = None,
) -> list[int]:
    """Predicted peak tensor bytes of every pipeline rank: of its stage
    (:func:`~lightning_pipe.planning.memory.stage_peak_bytes` over ``held``), or of an interleaved
    rank's stages together (:func:`~lightning_pipe.planning.memory.rank_peak_bytes` over :func:`moments`).
    ``costs``: the plan's :func:`stage_costs`, if already summed."""
    costs = costs if costs is not None else stage_costs(profile, plan, microbatch_size)
    versions, batch = weight_versions(plan), batch_bytes(profile, plan, microbatch_size)
    last = len(costs) - 1
    if plan.virtual_stages > 1:
        ranges = plan.stage_ranges()
        return [
            rank_peak_bytes(
                [costs[s] for s in mine],
                walked,
                [plan.recompute[s] for s in mine],
                [s == 0 for s in mine],
                [s == last for s in mine],
                batch,
                plan.width > 1,
                _all_split(plan),
                step_bytes(profile, [profile.blocks[i] for s in mine for i in ranges[s]]),
                [s - 1 in mine for s in mine],
                [s + 1 in mine for s in mine],
                versions,
                [_rank_gradient_sets(profile, plan, s) for s in mine],
                _walked_sets(profile, plan),
            )
            + profile.device_bytes
            for mine, walked in zip(map(plan.stages_of, range(plan.depth)), moments(plan))
        ]
    return [
        stage_peak_bytes(
            st,
            held[s],
            versions,
            plan.recompute[s],
            s == 0,
            s == last,
            batch,
            gradient_sets(profile, plan, s),
            _all_split(plan),
            sharding(profile, plan, s),
            plan.width > 1 and plan.data_parallel != "fsdp",
        )
        + profile.device_bytes
        for s, st in enumerate(costs)
    ]


def _rank_gradient_sets(profile: Profile, plan: PipelinePlan, stage: int) -> int:
    """Batches' gradients stage ``stage`` of an interleaved plan holds at once: as its rank's
    program holds them (:func:`~lightning_pipe.planning.programs.gradient_sets`, rank 0 stepping
    right after its all-reduce), or two on rank 0 when it steps at the window's end instead
    (weights tied across stages, :func:`~lightning_pipe.planning.costs.gradient_sets`). With
    replicas a batch's gradients live in buckets shared by the rank's stages, each whole from its
    first gradient (runtime/buckets.py): a stage holds as many batches' as any stage of its rank
    (its part of the next batch's bucket exists once another stage starts that batch)."""
    if plan.spec.gradient_sets == 1:
        return 1
    late = plan.rank_of_stage(stage) == 0 and gradient_sets(profile, plan, stage) == 2  # tied: rank 0 steps late
    if late:
        return 2
    sets = program_gradient_sets(plan)
    if plan.width > 1:  # replicas: a batch's bucket spans the rank's stages, whole from its first gradient
        return max(sets[s] for s in plan.stages_of(plan.rank_of_stage(stage)))
    return sets[stage]


def _walked_sets(profile: Profile, plan: PipelinePlan) -> bool:
    """Whether an interleaved 2BW plan's moments count the gradient sets alive as its program
    holds them (``memory.rank_peak_bytes``; with replicas, whose buckets span a rank's stages, as
    the rank holds them, :func:`moments`): with rank 0 stepping right after its all-reduce (no
    weights tied across stages)."""
    return plan.spec.streams and all(gradient_sets(profile, plan, s) == 1 for s in plan.stages_of(0))


def sharding(profile: Profile, plan: PipelinePlan, stage: int) -> Optional[Sharding]:
    """How stage ``stage`` is sharded over its replicas (``data_parallel="fsdp"`` with ``w > 1``), else ``None``.

    An interleaved plan's ranks are predicted as under DDP (its sharded terms are not modelled).
    Under split backward the stage's blocks stay gathered together from an I until its W
    (runtime/sharding.py, ``ShardedStage``), and a recomputed stage's backward gathers them all
    in its recomputed forward: ZeRO-3 then holds every block's weights gathered."""
    if plan.data_parallel != "fsdp" or plan.width == 1:
        return None
    sizes = [profile.blocks[i].parameter_bytes for i in plan.stage_ranges()[stage]]
    largest, whole = max(sizes), sum(sizes)
    in_order = max(before + 2 * size for before, size in zip(itertools.accumulate([0, *sizes]), sizes)) - whole
    weight_gathers = plan.split_backward and gathers(plan, Action(stage, Kind.WEIGHT_GRAD, 0)) > 0
    recomputed = plan.recompute[stage] and not plan.split_backward
    return Sharding(
        plan.width,
        whole if plan.split_backward or recomputed else largest,
        kept_gathered=not plan.reshard_after_forward,
        largest_bytes=largest,
        held_for_w=plan.split_backward,
        gather_all_bytes=in_order if weight_gathers else None,
        gathering_pending=gathering_pending(plan, stage),
        recomputed=recomputed,
    )


def _all_split(plan: PipelinePlan) -> bool:
    """Whether every backward of the plan's program is split (so no forward keeps the loss's graph
    beside a recomputed last stage); "drain" keeps its earlier backwards whole."""
    return plan.split_backward and plan.split_placement != "drain"


def orient(profile: Profile, plan: PipelinePlan, microbatch_size: int, ranks_per_node: int) -> PipelinePlan:
    """``plan`` with its heavier traffic on neighbouring ranks, which share a node (PipeDream-2BW paper,
    section 3.3: "stage replicas can be placed on the same server so that expensive all-reduce
    updates are between GPUs on the same server"; here whichever traffic is larger stays there)."""
    if plan.world_size <= ranks_per_node:
        return plan.replace(inner="pp")
    pipeline, replicas = traffic(profile, plan, microbatch_size)
    return plan.replace(inner="pp" if pipeline >= replicas else "dp")


def appendix_a_time(
    t_comp: Sequence[float], t_comm_in: Sequence[float], t_comm_dp: Sequence[float], m: int, c_extra: float = 1.0
) -> float:
    """Seconds per microbatch with pipelining (PipeDream-2BW paper, Appendix A.1.1), kept as a cross-check:
    ``t = max_i max(c_extra * T_comp_i + sum_j T_comm_{j->i}, T_comm_i / m(b))``."""
    return max(max(c_extra * tc + ti, td / m) for tc, ti, td in zip(t_comp, t_comm_in, t_comm_dp))


def appendix_a_memory(
    weights: float, activations_total: float, activations_input: float, d: int, recompute: bool
) -> float:
    """2BW footprint of a stage (PipeDream-2BW paper, Appendix A.1.2), kept as a cross-check:
    ``2|W|/d + d|A_total(b)|/d + d|A_input(b)|``, or with
    recomputation ``2|W|/d + |A_total(b)|/d + d|A_input(b)|``."""
    versions = 1 if recompute else d
    return 2 * weights / d + versions * activations_total / d + d * activations_input


@dataclass(frozen=True)
class Prediction:
    """One candidate plan with its predicted step time and peak memory per pipeline rank (its
    stage's, or under interleaving its stages' together)."""

    plan: PipelinePlan
    microbatch_size: int
    step_time: float
    stage_memory: tuple[int, ...]
    memory_limit: Optional[float] = None

    @property
    def feasible(self) -> bool:
        """Whether every stage fits the memory limit."""
        return self.memory_limit is None or max(self.stage_memory) <= self.memory_limit

    @property
    def samples_per_second(self) -> float:
        """Predicted throughput over all replicas."""
        return self.plan.width * self.plan.microbatches * self.microbatch_size / self.step_time

    def why_infeasible(self) -> str:
        """Which stage exceeds the budget and by how much ('' if none)."""
        if self.feasible:
            return ""
        r = max(range(len(self.stage_memory)), key=lambda i: self.stage_memory[i])
        over = self.stage_memory[r] - (self.memory_limit or 0)
        where = (
            f"stage {r}"
            if self.plan.virtual_stages == 1
            else f"rank {r} (stages {', '.join(map(str, self.plan.stages_of(r)))})"
        )
        return f"{where} needs {_size(self.stage_memory[r])}, {_size(over)} over the budget"


def _size(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} B"


def predict(
    profile: Profile,
    plan: PipelinePlan,
    microbatch_size: int,
    memory_limit: Optional[float] = None,
    samples: Optional[Sequence[BlockSample]] = None,
) -> Prediction:
    """Predicted step time and memory of one resolved plan at ``microbatch_size`` (``samples``: every
    block already at that size, see :func:`stage_costs`)."""
    costs = stage_costs(profile, plan, microbatch_size, samples)
    seconds, peaks = predict_step(profile, plan, microbatch_size, costs)
    return Prediction(
        plan,
        microbatch_size,
        seconds,
        tuple(predict_memory(profile, plan, microbatch_size, peaks, costs)),
        memory_limit,
    )
