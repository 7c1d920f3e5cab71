"""Trial runs for the plan command: a plan trained for a few steps through the user's own script, traced.

A trial runs the way the job will: the user's LightningCLI script (or LightningCLI itself when
the config names its classes), Lightning's launcher, the same processes and threads, the
user's config with the plan's strategy arguments. :class:`TrialRecorder` times each step and
traces the last few; :func:`run_trial` launches the plan until two launches agree and reads what
every rank wrote into a :class:`~lightning_pipe.planning.calibration.Trial` for
:func:`~lightning_pipe.planning.calibration.calibrate`.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import lightning as L
import yaml

from lightning_pipe.core.pipeline_plan import PipelinePlan
from lightning_pipe.lightning.monitor import logged_value_bytes
from lightning_pipe.planning.calibration import Trial, median_actions, median_error, slowest_steps, traced_stalls


def strategy_init_args(plan: PipelinePlan, global_batch: int) -> dict[str, Any]:
    """``plan`` as ``trainer.strategy.init_args`` of a LightningCLI config. A 2BW plan runs with
    ``loss="previous"``: the planner prices 2BW as its never-flushed stream (PipeDream-2BW paper,
    section 3.1), which a step returning its own loss would synchronise at every window end."""
    init = {
        "schedule": plan.schedule,
        "pipeline_depth": plan.depth,
        "microbatches": plan.microbatches,
        "partition": list(plan.partition),
        "recompute": list(plan.recompute),
        "split_backward": plan.split_backward,
        "inner": plan.inner,
        "global_batch_size": global_batch,
        "virtual_stages": plan.virtual_stages,
    }
    if plan.spec.streams:
        init["loss"] = "previous"
    if plan.split_placement is not None:
        init["split_placement"] = plan.split_placement
    if plan.stage_placement != "loop":
        init["placement"] = plan.stage_placement
    if plan.data_parallel != "ddp":
        init["data_parallel"] = plan.data_parallel
        init["reshard_after_forward"] = plan.reshard_after_forward
    return init


class TrialRecorder(L.Callback):
    """On every rank: each step's end time, then ``traced`` more steps with the executor's trace on.

    At the end of training each rank writes ``rank<r>.json`` in ``out_dir``: its step ends,
    every traced action's seconds (by its text form, one entry per traced step) and the bytes of
    the values its module logged that Lightning holds (:func:`~lightning_pipe.lightning.monitor.logged_value_bytes`).

    Args:
        out_dir: where the per-rank results go.
        timed: steps timed without the trace (after one warm-up step).
        traced: steps traced after them.
    """

    def __init__(self, out_dir: str, timed: int, traced: int) -> None:
        self.out_dir, self.timed, self.traced = Path(out_dir), timed, traced
        self.ends: list[float] = []
        self.actions: dict[str, list[float]] = {}

    def _tracing(self) -> bool:
        return len(self.ends) > self.timed

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        trainer.strategy.engine.record_trace = self._tracing()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        engine = trainer.strategy.engine
        if engine.record_trace and engine.trace is not None:
            for interval in engine.trace.intervals:
                self.actions.setdefault(str(interval.action), []).append(interval.end - interval.start)
        if not self._tracing():
            self.ends.append(time.perf_counter())

    def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        trainer.strategy.engine.record_trace = False
        result = {
            "rank": trainer.global_rank,
            "ends": self.ends,
            "actions": self.actions,
            "logged_bytes": logged_value_bytes(trainer),
        }
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


#: Steps of a trial launch: one warm-up, the timed ones, the traced ones (enough of them that a
#: trial's message stalls, a scheduler slice in some steps and not in others, average out).
TIMED_STEPS, TRACED_STEPS = 6, 6
#: Launches of a trial: at least ``TRIAL_LAUNCHES[0]``, more while no two launches' medians agree
#: within :data:`LAUNCHES_AGREE`, at most ``TRIAL_LAUNCHES[1]``. Two launches of one plan on a
#: loaded CPU host differ by several percent, as much as a ranking's top plans do, and a trial's
#: step sets its whole layout's fitted overhead.
TRIAL_LAUNCHES = (2, 4)
LAUNCHES_AGREE = 0.03


def short_run_config(
    config: Path, init_args: dict[str, Any], devices: int, out_dir: Path, callback: dict[str, Any], max_steps: int
) -> Path:
    """The user's config with ``init_args`` over its strategy's, ``max_steps`` steps on ``devices``
    processes and ``callback`` (a LightningCLI class_path/init_args entry) as its only callback: no
    logger, checkpoints, validation or progress bar. Written as ``out_dir/run.yaml``; its path."""
    cfg = yaml.safe_load(config.read_text()) or {}
    trainer = dict(cfg.get("trainer") or {})
    strategy = trainer.get("strategy")
    strategy = dict(strategy) if isinstance(strategy, dict) else {}
    strategy.setdefault("class_path", "lightning_pipe.PipelineStrategy")
    strategy["init_args"] = {**(strategy.get("init_args") or {}), **init_args}
    for key in ("val_check_interval", "max_epochs", "max_time", "min_steps", "min_epochs", "check_val_every_n_epoch"):
        trainer.pop(key, None)
    trainer.update(
        devices=devices,
        default_root_dir=str(out_dir),  # LightningCLI saves the resolved config there, not beside the user's
        strategy=strategy,
        max_steps=max_steps,
        max_epochs=-1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[callback],
    )
    path = out_dir / "run.yaml"
    path.write_text(yaml.safe_dump({**cfg, "trainer": trainer}, sort_keys=False))
    return path


def trial_config(config: Path, plan: PipelinePlan, global_batch: int, out_dir: Path) -> Path:
    """:func:`short_run_config` for a trial of ``plan``, :class:`TrialRecorder` recording it; its path."""
    recorder = {
        "class_path": f"{TrialRecorder.__module__}.{TrialRecorder.__qualname__}",
        "init_args": {"out_dir": str(out_dir), "timed": TIMED_STEPS, "traced": TRACED_STEPS},
    }
    steps = 1 + TIMED_STEPS + TRACED_STEPS
    return short_run_config(config, strategy_init_args(plan, global_batch), plan.world_size, out_dir, recorder, steps)


def run_trial(
    config: Path,
    script: Optional[Path],
    plan: PipelinePlan,
    microbatch_size: int,
    global_batch: int,
    timeout: float = 600.0,
) -> Trial:
    """Train ``plan`` for a few steps through the user's script (``<script> fit --config``; without
    a script LightningCLI itself, for a config that names its classes), in launches until two agree
    (:func:`until_stable`), and return their :class:`Trial` (:func:`pooled_trial`).

    Raises:
        RuntimeError: if a launch fails, times out or a rank wrote no result (with its output's tail).
    """
    launches = until_stable(lambda: _launch(config, script, plan, global_batch, timeout), TRIAL_LAUNCHES)
    return pooled_trial(plan, microbatch_size, launches)


def _launch(config: Path, script: Optional[Path], plan: PipelinePlan, global_batch: int, timeout: float) -> list[dict]:
    """One trial launch: every rank's result (:class:`TrialRecorder`), in rank order."""
    with tempfile.TemporaryDirectory(prefix="lightning_pipe_trial_") as tmp:
        out = Path(tmp)
        cfg = trial_config(config, plan, global_batch, out)
        entry = [str(script)] if script is not None else ["-m", __name__]
        cmd = [sys.executable, *entry, "fit", "--config", str(cfg)]
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"trial of {plan.describe()} ran past {timeout:.0f} s") from None
        ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
        if done.returncode != 0 or len(ranks) != plan.world_size:
            tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
            raise RuntimeError(f"trial of {plan.describe()} failed (exit {done.returncode}):\n{tail}")
    return sorted(ranks, key=lambda r: r["rank"])


def launch_steps(ranks: Sequence[dict]) -> list[float]:
    """A launch's measured steps: the last ``TIMED_STEPS - 1`` of the slowest rank's."""
    return slowest_steps([r["ends"] for r in ranks])[-(TIMED_STEPS - 1) :]


def launch_median(ranks: Sequence[dict]) -> float:
    """A launch's step: the median of its measured steps (:func:`launch_steps`)."""
    return statistics.median(launch_steps(ranks))


def until_stable(launch: Callable[[], list[dict]], launches: tuple[int, int] = TRIAL_LAUNCHES) -> list[list[dict]]:
    """Call ``launch`` ``launches[0]`` times, then again while no two launches' median steps lie
    within :data:`LAUNCHES_AGREE` of each other, ``launches[1]`` times at most; every launch's ranks."""
    done = [launch() for _ in range(launches[0])]
    while len(done) < launches[1] and not _agree([launch_median(r) for r in done]):
        done.append(launch())
    return done


def _agree(medians: Sequence[float]) -> bool:
    """Whether two of ``medians`` lie within :data:`LAUNCHES_AGREE` of each other."""
    ordered = sorted(medians)
    return any(b <= a * (1 + LAUNCHES_AGREE) for a, b in zip(ordered, ordered[1:]))


def pooled_trial(plan: PipelinePlan, microbatch_size: int, launches: Sequence[Sequence[dict]]) -> Trial:
    """Trial launches of one plan as one :class:`Trial`: the median of the launches' median steps
    (one odd launch of three cannot move it), each action's median over every launch's traced
    steps, and a spread that is the larger of the median's standard error over all the measured
    steps and the launches' own: their medians' median absolute deviation, scaled to a normal
    sigma, relative to the step (half the difference of two launches; one odd launch of three
    does not set it, as one that ran beside a stray process would); and each rank's stalls over
    every launch's traced steps (:func:`~lightning_pipe.planning.calibration.traced_stalls`)."""
    medians = [launch_median(ranks) for ranks in launches]
    step = statistics.median(medians)
    pooled = [t for ranks in launches for t in launch_steps(ranks)]
    between = statistics.median(abs(m - step) for m in medians) / step
    spread = max(median_error(pooled), (1.4826 if len(medians) > 2 else 1.0) * between)
    logged = max(r["logged_bytes"] for ranks in launches for r in ranks)
    traced = _pooled_actions(launches)
    actions = tuple(median_actions(rank) for rank in traced)
    stalls = tuple(traced_stalls(rank, plan.microbatches) for rank in traced)
    return Trial(plan, microbatch_size, step, actions, spread, logged, tuple(medians), stalls)


def _pooled_actions(launches: Sequence[Sequence[dict]]) -> list[dict[str, list[float]]]:
    """Per rank, each traced action's seconds in every launch's traced steps."""
    pooled = []
    for rank in range(len(launches[0])):
        traced: dict[str, list[float]] = {}
        for ranks in launches:
            for text, seconds in ranks[rank]["actions"].items():
                traced.setdefault(text, []).extend(seconds)
        pooled.append(traced)
    return pooled


def main() -> None:
    """LightningCLI for a config that names its model and data classes (a trial without a script)."""
    from lightning.pytorch.cli import LightningCLI

    LightningCLI(save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
