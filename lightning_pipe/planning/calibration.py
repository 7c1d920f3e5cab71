"""The planner's cost model fitted to trial runs: a few plans trained briefly as the job runs, traced.

Block times come from profiling each block alone; a job runs them inside its executor, its
processes, its training loop. A trial run measures what that adds: each traced action's
seconds against the model's, and each step's seconds against the simulated program: compute
as a scale on the blocks' seconds, the optimizer step and the
all-reduce as scales, the cost of posting a send, the stalls each message brings beyond the
actions' typical seconds, then one per-step overhead as the median residual of the trials'
steps. The fitted profile predicts the plans no trial ran.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from lightning_pipe.core.pipeline_plan import PipelinePlan
from lightning_pipe.planning.costs import action_cost, sharded, sharded_seconds, stage_costs
from lightning_pipe.planning.predict import predict_step, slowdowns
from lightning_pipe.planning.profile import Profile, layout_key
from lightning_pipe.schedules import Action, Kind
from lightning_pipe.schedules.actions import COMPUTE_KINDS, MESSAGE_KINDS, SEND_KINDS


@dataclass(frozen=True)
class Stalls:
    """What one rank's traced steps spent beyond its actions' typical seconds (:func:`traced_stalls`).

    Args:
        beyond: seconds a step spent beyond its actions' medians.
        messages: the sends and receives of a step.
        typical: seconds of a step's actions at their medians.
    """

    beyond: float
    messages: int
    typical: float


@dataclass(frozen=True)
class Trial:
    """One plan trained for a few steps the way the job will run, with its actions traced.

    Args:
        plan: the plan that ran.
        microbatch_size: its samples per microbatch.
        step: measured seconds of one step: the median over the timed steps of the slowest
            rank's time between consecutive step ends.
        actions: per rank, each traced action's median seconds, keyed by its text form (``"0F1"``).
        spread: how far another measurement of this plan can fall from ``step``, relative to it:
            at least the standard error of its median (:func:`median_error`) over the measured steps.
        logged_bytes: the bytes of the values the module logged that Lightning holds between
            steps, on the rank that holds the most (0: not measured).
        launches: each launch's median step, where the trial ran in several.
        stalls: per rank, what its traced steps spent beyond its actions' medians
            (:func:`traced_stalls`; empty: not measured).
    """

    plan: PipelinePlan
    microbatch_size: int
    step: float
    actions: tuple[Mapping[str, float], ...]
    spread: float = 0.0
    logged_bytes: int = 0
    launches: tuple[float, ...] = ()
    stalls: tuple[Stalls, ...] = ()


def _fitted_scale(traced: float, modeled: float) -> float:
    """``traced / modeled`` (sums over actions), 1 without data."""
    return traced / modeled if modeled > 0 and traced > 0 else 1.0


def fitted_scale(points: Sequence[tuple[float, float]], intercept: float) -> float:
    """Slope of the least-squares line through ``(modeled, traced)`` points that crosses the
    traced axis at ``intercept``; 1 without data."""
    sxx = sum(x * x for x, _ in points)
    sxy = sum(x * (y - intercept) for x, y in points)
    return sxy / sxx if sxx > 0 and sxy > 0 else 1.0


def fitted_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Intercept and slope, both at least 0, of the least-squares line through ``(modeled, traced)``
    points; through the origin (the ratio of sums) where the points have one ``modeled`` value
    or the free line would cross below 0; ``(0, 1)`` without data."""
    if not points:
        return 0.0, 1.0
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx > 1e-12 * max(mx * mx, 1e-30):
        slope = sum((x - mx) * (y - my) for x, y in points) / sxx
        if slope >= 0 and my - slope * mx >= 0:
            return my - slope * mx, slope
        if slope < 0:  # no growth with size: a latency alone
            return my, 0.0
    return 0.0, _fitted_scale(sum(y for _, y in points), sum(x for x, _ in points))


def send_seconds_per_byte(sends: Sequence[tuple[int, float]], posting: float) -> float:
    """The median over traced ``(payload bytes, seconds)`` sends of the seconds beyond ``posting``
    (a small message's) per byte; at least 0, and 0 without sends."""
    rates = [(seconds - posting) / nbytes for nbytes, seconds in sends if nbytes > 0]
    return max(statistics.median(rates), 0.0) if rates else 0.0


def traced_stalls(traced: Mapping[str, Sequence[float]], microbatches: int) -> Stalls:
    """A rank's :class:`Stalls` from its traced actions' seconds, one per traced step: each
    action's mean less its median, summed, its messages and its medians, summed, per step.
    Actions are matched across steps by stage, kind and microbatch modulo ``microbatches`` (a
    PipeDream-2BW window numbers its microbatches on from the last); those traced in one step
    only are left out.

    A rank loses a scheduler slice (milliseconds) in some steps and not in others: on a host
    whose cores the ranks share, to another rank, and where a message's arrival wakes a
    transport thread. The medians leave those slices out; the mean step holds them."""
    matched: dict[tuple[int, Kind, Optional[int]], list[float]] = {}
    for text, seconds in traced.items():
        a = Action.parse(text)
        key = (a.stage, a.kind, None if a.microbatch is None else a.microbatch % microbatches)
        matched.setdefault(key, []).extend(seconds)
    repeated = {key: seconds for key, seconds in matched.items() if len(seconds) > 1}
    steps = max((len(seconds) for seconds in repeated.values()), default=1)
    beyond = sum(len(s) * (statistics.fmean(s) - statistics.median(s)) for s in repeated.values()) / steps
    typical = sum(len(s) * statistics.median(s) for s in repeated.values()) / steps
    return Stalls(beyond, sum(1 for _, kind, _ in repeated if kind in MESSAGE_KINDS), typical)


def message_stall(points: Sequence[tuple[Stalls, float]]) -> float:
    """Seconds each message costs its job beyond its actions' medians, at least 0; 0 without a
    rank that sends or receives.

    ``points``: each rank's stalls and the slowdown of its messages on the host's shared cores
    (1: none). A rank's steps lose slices in proportion to their length as well as to their
    messages, so the seconds beyond the medians are fitted by least squares as
    ``a * typical + stall * slowdown * messages``, both terms at least 0: the ranks that send
    nothing (data-parallel layouts) and the lengths of the others' steps price the first term,
    so that a trial of long actions and few messages does not read its slices as the messages'."""
    rows = [(p.typical, slowdown * p.messages, p.beyond) for p, slowdown in points]
    if not any(m > 0 for _, m, _ in rows):
        return 0.0
    stt, smm, stm = sum(t * t for t, _, _ in rows), sum(m * m for _, m, _ in rows), sum(t * m for t, m, _ in rows)
    stb, smb = sum(t * b for t, _, b in rows), sum(m * b for _, m, b in rows)
    det = stt * smm - stm * stm
    if det > 1e-12 * stt * smm:
        a, stall = (stb * smm - smb * stm) / det, (stt * smb - stm * stb) / det
        if a >= 0:
            return max(stall, 0.0)
        if stall < 0:
            return 0.0
    return max(smb / smm, 0.0)  # the lengths price nothing: the messages alone


def unfitted(profile: Profile) -> Profile:
    """``profile`` as profiled: no scale, no step overhead, the executor's per-action and
    per-send overheads and the bytes every device holds that its profile measured (a fit replaces
    them with the trials')."""
    profiled = profile.meta.get("calibration", {})
    return dataclasses.replace(
        profile,
        compute_scale=1.0,
        optimizer_scale=1.0,
        allreduce_scale=1.0,
        allreduce_latency=0.0,
        step_overhead=0.0,
        layout_overheads={},
        action_overhead=profiled.get("profiled_action_overhead", profile.action_overhead),
        send_overhead=profiled.get("profiled_send_overhead", profile.send_overhead),
        send_seconds_per_byte=0.0,
        message_stall=0.0,
        device_bytes=profiled.get("profiled_device_bytes", profile.device_bytes),
    )


def calibrate(profile: Profile, trials: Sequence[Trial]) -> Profile:
    """``profile`` fitted to ``trials`` (any earlier fit is replaced); ``profile`` itself without trials.

    - Compute: a line through every traced forward, backward, I and W (the model's seconds
      without the executor's overhead, slowed as the simulator finds the trial's ranks sharing the
      host's cores (:func:`~lightning_pipe.planning.predict.slowdowns`), against the traced ones),
      crossing at the executor's overhead per action the profile measured: its slope is the
      compute scale (:func:`fitted_scale`). The overhead is measured on the smallest microbatches,
      where it weighs most; trials run the best plans, of few large actions, which cannot tell
      it from the blocks' seconds. An FSDP trial's forwards and backwards also all-gather: the
      modelled all-gather (:func:`~lightning_pipe.planning.costs.sharded_seconds`) is taken off
      both sides.
    - Optimizer step and all-reduce: the traced seconds of their actions over the model's, each
      action at its fastest replica: the replicas of a stage all-reduce together, and the global
      norm the step reads joins every stage, so each waits there for the last to arrive, which
      waits least. The all-reduce is a line through its actions' ``(model, traced)`` points
      (:func:`fitted_line`): a latency each and a scale of the ring's seconds.
    - Sends: the profiled posting of a small message and the executor's overhead per action are
      the intercept, as the model charges a send both; each traced send's
      seconds (divided by the slowdown the simulator finds for it, its rank sharing the host's
      cores) beyond it over its payload's bytes gives a cost per byte, their median the fitted
      one (:func:`send_seconds_per_byte`), so that the trials' large messages do not price the
      small ones of plans with many microbatches. Receives wait on their senders, so they are
      not fitted.
    - Message stalls: each rank's traced seconds beyond its actions' medians
      (:func:`traced_stalls`), fitted as a share of its step's length plus a stall per message
      it sent and received (:func:`message_stall`; times the slowdown the simulator finds for its
      messages), the stall charged to every send and receive
      (:attr:`~lightning_pipe.planning.profile.Profile.message_stall`). The medians fit the
      compute; the stalls land on a few actions of a step, on any of them, and grow with its
      messages: on a 2-core host up to 0.4 ms a message, a third of the step of an interleaved
      plan of 32 microbatches on 2 processes. The share of the length is left to the step
      overhead, as before.
    - Memory: every device also holds Lightning's copies of the values the module logs (the
      most a trial's rank held, :attr:`Trial.logged_bytes`), added to ``device_bytes``.
    - Then the step overhead (measured minus predicted step, at least 0): per layout a trial ran
      (``width`` x ``depth``) the median over its trials (:func:`layout_overheads`), for any
      other the median over the layouts of its kind that ran, pipelined or not
      (:meth:`~lightning_pipe.planning.profile.Profile.overhead_of`), else over all trials.
      What a step costs beyond its program (the training loop, the loss broadcast, the
      processes sharing the host's cores while they run it) depends on the layout's
      processes: on a 2-core host a DDP layout's residual measured a quarter to three quarters
      of a pipeline's on as many processes.

    Where a trial with DDP replicas ran, trials with FSDP replicas are left out of the fit: FSDP's
    collectives run in its hooks, inside and around the actions, beyond what the model prices
    (:func:`~lightning_pipe.planning.costs.sharded_seconds`), and would skew the DDP plans'
    scales; an FSDP trial's own plan is charged its measured step by the ranking.
    """
    if not trials:
        return profile
    trials = [t for t in trials if not sharded(t.plan)] or list(trials)
    base = unfitted(profile)
    compute: list[tuple[float, float]] = []
    collectives: dict[str, list[tuple[float, float]]] = {"optimizer": [], "allreduce": []}  # (model, traced)
    sends: list[tuple[int, float]] = []
    stalls: list[tuple[Stalls, float]] = []
    for trial in trials:
        stages = stage_costs(base, trial.plan, trial.microbatch_size)
        cost = action_cost(base, trial.plan, stages)
        shared = slowdowns(base, trial.plan, cost)
        stalls += [(st, _message_slowdown(rank, shared)) for rank, st in zip(trial.actions, trial.stalls)]
        fastest: dict[str, tuple[str, float, float]] = {}  # per action: its model and fastest replica's seconds
        for rank in trial.actions:
            for text, seconds in rank.items():
                action = Action.parse(text)
                key, slower = _category(action), shared.get((action.stage, action.kind), 1.0)
                if key == "compute":
                    # an FSDP plan's forwards and backwards also all-gather: fit the compute only
                    gather = sharded_seconds(base, trial.plan, stages[action.stage], action)
                    compute.append(((cost(action) - base.action_overhead - gather) * slower, seconds - gather))
                elif key == "send":
                    st = stages[action.stage]
                    payload = st.output_bytes if action.kind is Kind.SEND_ACT else st.input_bytes
                    sends.append((payload, seconds / slower))  # as it would take alone, as the model charges it
                elif key is not None and cost(action) > 0:
                    seen = fastest.get(text)
                    fastest[text] = (key, cost(action) * slower, min(seconds, seen[2]) if seen else seconds)
        for key, modeled, seconds in fastest.values():
            collectives[key].append((modeled, seconds))
    allreduce_latency, allreduce_scale = fitted_line(collectives["allreduce"])
    optimizer = collectives["optimizer"]
    fitted = dataclasses.replace(
        base,
        compute_scale=fitted_scale(compute, base.action_overhead),
        send_seconds_per_byte=send_seconds_per_byte(sends, base.send_overhead + base.action_overhead),
        optimizer_scale=_fitted_scale(sum(y for _, y in optimizer), sum(x for x, _ in optimizer)),
        allreduce_scale=allreduce_scale,
        allreduce_latency=allreduce_latency,
        message_stall=message_stall(stalls),
        device_bytes=base.device_bytes + max(t.logged_bytes for t in trials),
    )
    residuals = [t.step - predict_step(fitted, t.plan, t.microbatch_size)[0] for t in trials]
    overhead = max(statistics.median(residuals), 0.0)
    layouts = layout_overheads([t.plan for t in trials], residuals)
    meta = dict(profile.meta)
    meta["calibration"] = {
        "trials": [
            {
                "plan": dataclasses.asdict(t.plan),
                "microbatch_size": t.microbatch_size,
                "step": t.step,
                "actions": t.actions,
                "logged_bytes": t.logged_bytes,
                "launches": list(t.launches),
                "stalls": [dataclasses.asdict(x) for x in t.stalls],
            }
            for t in trials
        ],
        "compute_scale": fitted.compute_scale,
        "action_overhead": fitted.action_overhead,
        "send_overhead": fitted.send_overhead,
        "send_seconds_per_byte": fitted.send_seconds_per_byte,
        "optimizer_scale": fitted.optimizer_scale,
        "allreduce_scale": fitted.allreduce_scale,
        "allreduce_latency": fitted.allreduce_latency,
        "message_stall": fitted.message_stall,
        "step_overhead": overhead,
        "layout_overheads": layouts,
        "profiled_action_overhead": base.action_overhead,
        "profiled_send_overhead": base.send_overhead,
        "profiled_device_bytes": base.device_bytes,
    }
    return dataclasses.replace(fitted, step_overhead=overhead, layout_overheads=layouts, meta=meta)


def layout_overheads(plans: Sequence[PipelinePlan], residuals: Sequence[float]) -> dict[str, float]:
    """Per layout of ``plans`` (their trials), the median of its trials' ``residuals`` (measured
    minus predicted step without overhead), at least 0, keyed by
    :func:`~lightning_pipe.planning.profile.layout_key`."""
    by_layout: dict[str, list[float]] = {}
    for plan, residual in zip(plans, residuals):
        by_layout.setdefault(layout_key(plan.width, plan.depth), []).append(residual)
    return {key: max(statistics.median(values), 0.0) for key, values in by_layout.items()}


def _message_slowdown(actions: Mapping[str, float], shared: Mapping[tuple[int, Kind], float]) -> float:
    """The mean slowdown the simulator finds for a rank's traced messages (1 without messages)."""
    kinds = [(a.stage, a.kind) for a in map(Action.parse, actions) if a.kind in MESSAGE_KINDS]
    return statistics.fmean(shared.get(k, 1.0) for k in kinds) if kinds else 1.0


def _category(action: Action) -> str | None:
    """What an action's traced seconds fit: compute, send, optimizer, all-reduce, or nothing."""
    if action.kind in COMPUTE_KINDS:
        return "compute"
    if action.kind in SEND_KINDS:
        return "send"
    if action.kind is Kind.OPTIMIZER_STEP:
        return "optimizer"
    if action.kind is Kind.ALL_REDUCE:
        return "allreduce"
    return None


def slowest_steps(rank_ends: Sequence[Sequence[float]]) -> list[float]:
    """Each step's seconds on the slowest rank, from each rank's step end times (one more end than steps)."""
    per_rank = [[b - a for a, b in zip(ends, ends[1:])] for ends in rank_ends]
    slowest = [max(steps) for steps in zip(*per_rank)]
    if not slowest:
        raise ValueError("a trial needs at least two step ends on every rank")
    return slowest


def trial_step(rank_ends: Sequence[Sequence[float]], measured: int) -> float:
    """The median over the last ``measured`` steps of the slowest rank's step (:func:`slowest_steps`)."""
    return statistics.median(slowest_steps(rank_ends)[-measured:])


def median_error(values: Sequence[float]) -> float:
    """The standard error of ``values``' median, relative to it: ``1.2533 * 1.4826 * MAD / sqrt(n)``
    (the median absolute deviation scaled to a normal sigma, and the median's efficiency), robust
    to one outlying value; 0 for no values."""
    if not values:
        return 0.0
    median = statistics.median(values)
    mad = statistics.median(abs(x - median) for x in values)
    return 1.2533 * 1.4826 * mad / len(values) ** 0.5 / median


def host_launch_sigma(trials: Sequence[Trial]) -> float:
    """The host's launch-to-launch noise: the relative standard deviation of one launch's median
    step about its trial's mean, pooled over every trial of several launches (the sum of their
    squared relative deviations over their degrees of freedom, ``launches - 1`` each); 0 without
    such a trial. Every trial of one plan command runs on the same host under the same load, so
    this reads the host's noise from all of them rather than from the two or three launches of one."""
    squares, freedom = 0.0, 0
    for trial in trials:
        if len(trial.launches) > 1:
            mean = statistics.fmean(trial.launches)
            squares += sum((m / mean - 1) ** 2 for m in trial.launches)
            freedom += len(trial.launches) - 1
    return (squares / freedom) ** 0.5 if freedom else 0.0


def measured_spreads(trials: Sequence[Trial]) -> dict[tuple[PipelinePlan, int], float]:
    """Each trial's spread, by plan and microbatch size: the larger of its own
    (:attr:`Trial.spread`) and the standard error of its step with the host's launch noise
    (:func:`host_launch_sigma`) over its launches, ``sigma / sqrt(n)`` for the mean of two and
    ``1.2533 * sigma / sqrt(n)`` for the median of more. A trial launches until two launches
    agree (:func:`~lightning_pipe.lightning.trial.until_stable`), so its own launches alone
    read its spread low on a noisy host."""
    sigma = host_launch_sigma(trials)
    spreads = {}
    for t in trials:
        n = max(len(t.launches), 1)
        spreads[(t.plan, t.microbatch_size)] = max(t.spread, (1.2533 if n > 2 else 1.0) * sigma / n**0.5)
    return spreads


def median_actions(traced: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """Each action's median seconds over the traced steps."""
    return {text: statistics.median(seconds) for text, seconds in traced.items() if seconds}
