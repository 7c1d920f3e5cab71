"""The planner's cost model fitted to trial runs: a few plans trained briefly as the job runs, traced.

Block times come from profiling each block alone; a job runs them inside its executor, its
processes, its training loop. A trial run measures what that adds: each traced action's
seconds against the model's, and each step's seconds against the simulated program. Three
scales (compute, optimizer step, all-reduce) are fitted as the ratio of traced to modeled
seconds summed over every traced action of every trial, then one per-step overhead as the
median residual of the trials' steps. The fitted profile predicts the plans no trial ran.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from typing import Mapping, Sequence

from lightning_pipe.core.pipeline_plan import PipelinePlan
from lightning_pipe.planning.costs import action_cost, stage_costs
from lightning_pipe.planning.predict import predict_step
from lightning_pipe.planning.profile import Profile
from lightning_pipe.schedules import Action, Kind

#: The actions whose seconds are the blocks' compute.
COMPUTE_KINDS = frozenset({Kind.FORWARD, Kind.BACKWARD, Kind.INPUT_GRAD, Kind.WEIGHT_GRAD})


@dataclass(frozen=True)
class Trial:
    """One plan trained for a few steps the way the job will run, with its actions traced.

    Args:
        plan: the plan that ran.
        microbatch_size: its samples per microbatch.
        step: measured seconds of one step: the median over the timed steps of the slowest
            rank's time between consecutive step ends.
        actions: per rank, each traced action's median seconds, keyed by its text form (``"0F1"``).
    """

    plan: PipelinePlan
    microbatch_size: int
    step: float
    actions: tuple[Mapping[str, float], ...]


def _fitted_scale(traced: float, modeled: float) -> float:
    """``traced / modeled`` (sums over actions), 1 without data."""
    return traced / modeled if modeled > 0 and traced > 0 else 1.0


def calibrate(profile: Profile, trials: Sequence[Trial]) -> Profile:
    """``profile`` with its compute, optimizer and all-reduce scales and its per-step overhead
    fitted to ``trials`` (any earlier fit is replaced); ``profile`` itself without trials.

    Each scale is the traced seconds of its actions over the model's over all trials and ranks;
    a compute action's executor overhead (``action_overhead``) is taken off both sides first.
    The step overhead is the median over trials of measured minus predicted step, at least 0.
    """
    if not trials:
        return profile
    base = dataclasses.replace(profile, compute_scale=1.0, optimizer_scale=1.0, allreduce_scale=1.0, step_overhead=0.0)
    sums = {"compute": [0.0, 0.0], "optimizer": [0.0, 0.0], "allreduce": [0.0, 0.0]}
    for trial in trials:
        cost = action_cost(base, trial.plan, stage_costs(base, trial.plan, trial.microbatch_size))
        for rank in trial.actions:
            for text, seconds in rank.items():
                action = Action.parse(text)
                key = _category(action)
                if key is None:
                    continue
                overhead = base.action_overhead if key == "compute" else 0.0
                modeled = cost(action) - overhead
                if modeled > 0:
                    sums[key][0] += max(seconds - overhead, 0.0)
                    sums[key][1] += modeled
    fitted = dataclasses.replace(
        base,
        compute_scale=_fitted_scale(*sums["compute"]),
        optimizer_scale=_fitted_scale(*sums["optimizer"]),
        allreduce_scale=_fitted_scale(*sums["allreduce"]),
    )
    residuals = [t.step - predict_step(fitted, t.plan, t.microbatch_size)[0] for t in trials]
    overhead = max(statistics.median(residuals), 0.0)
    meta = dict(profile.meta)
    meta["calibration"] = {
        "trials": [
            {
                "plan": dataclasses.asdict(t.plan),
                "microbatch_size": t.microbatch_size,
                "step": t.step,
                "actions": t.actions,
            }
            for t in trials
        ],
        "compute_scale": fitted.compute_scale,
        "optimizer_scale": fitted.optimizer_scale,
        "allreduce_scale": fitted.allreduce_scale,
        "step_overhead": overhead,
    }
    return dataclasses.replace(fitted, step_overhead=overhead, meta=meta)


def _category(action: Action) -> str | None:
    """Which scale an action's traced seconds fit: compute, optimizer, all-reduce, or none."""
    if action.kind in COMPUTE_KINDS:
        return "compute"
    if action.kind is Kind.OPTIMIZER_STEP:
        return "optimizer"
    if action.kind is Kind.ALL_REDUCE:
        return "allreduce"
    return None


def trial_step(rank_ends: Sequence[Sequence[float]], measured: int) -> float:
    """The median over the last ``measured`` steps of the slowest rank's step, from each rank's
    step end times (one more end than steps)."""
    per_rank = [[b - a for a, b in zip(ends, ends[1:])] for ends in rank_ends]
    slowest = [max(steps) for steps in zip(*per_rank)]
    if not slowest:
        raise ValueError("a trial needs at least two step ends on every rank")
    return statistics.median(slowest[-measured:])


def median_actions(traced: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """Each action's median seconds over the traced steps."""
    return {text: statistics.median(seconds) for text, seconds in traced.items() if seconds}
