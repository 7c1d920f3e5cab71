"""The planner on the user's path: the plan command run once, then its top plans trained by ``Trainer.fit``.

    python benchmarks/bench_planner.py --user-path                   # gpt and nonuniform, 2 and 4 processes
    python benchmarks/bench_planner.py --user-path --busy --cli-runs 3

For each workload and process count the plan command runs as a subprocess, as a user runs it
(``--config``, ``--script``, ``--devices``, ``--top``, ``--output``), and writes its whole ranking
with ``--ranking-json``. After it has exited, each of the top plans trains in launches of its own:
the workload's script under ``fit``, with the user's config and the plan's strategy arguments
(what ``--output`` would hold for that plan), through Lightning's own launcher. A callback on
every rank records the wall time between consecutive training-step ends; a layout's measured
step is the median, over the steps after warm-up of all its launches, of the slowest rank's.
The launches go round-robin over the layouts (every layout once, then again), so that a slow
minute of the host falls on one launch of several layouts, not on every launch of one (two
launches of one layout can differ by as much as the planner's top plans do). Two more steps
run under a tracker of every CPU tensor storage (``PeakTensorBytes``, independent of the
planner's accounting): each rank's peak tensor bytes, the largest over replicas and launches per
pipeline rank.

``--busy`` keeps one core busy with a spinning process through the plan commands and the
training; ``--cli-runs N`` runs the plan command N times and reports whether its first choice
held.

Beside the planner's scores the page scores a repeat measurement (:func:`repeat_scores`): each
layout's launches taken one at a time as the prediction of its others, the most a trial of each
plan can tell on this host; and the plan command's trials against the same plans trained later.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, NamedTuple, Optional, Sequence

import lightning as L
from torch import Tensor
from torch.utils._pytree import tree_leaves

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.results_page import markdown_table  # noqa: E402
from lightning_pipe import PipelinePlan  # noqa: E402
from lightning_pipe.lightning.trial import short_run_config, strategy_init_args  # noqa: E402
from lightning_pipe.planning.calibration import slowest_steps  # noqa: E402

#: The memory check: every predicted peak within this fraction above the measured one, never under.
MEMORY_TOLERANCE = 0.02
#: The time check of ``--cli-runs``: the top 5 predictions within this fraction of the measured steps.
TOP5_TOLERANCE = 0.25
#: The step check on a quiet host: every layout's predicted step within this fraction of its measured one.
STEP_TOLERANCE = 0.15


class Workload(NamedTuple):
    """A user's job: the LightningCLI config and the script that defines its model and data."""

    name: str
    config: Path
    script: Path


WORKLOADS = {
    "gpt": Workload("gpt", ROOT / "configs" / "gpt_1f1b.yaml", ROOT / "examples" / "gpt.py"),
    "nonuniform": Workload(
        "nonuniform", ROOT / "benchmarks" / "nonuniform.yaml", ROOT / "benchmarks" / "nonuniform.py"
    ),
}


@dataclass
class Options:
    """How much to measure.

    Args:
        plans: The top plans of the (first) ranking trained per workload and process count.
        steps: Timed training steps per launch.
        launches: Launches per layout (round-robin over the layouts); its measured step is the
            median over all of them.
        measured: The last ``measured`` step times give the median (the earlier ones warm up).
        cli_runs: Plan commands per workload and process count (the first one's ranking is trained).
        busy: Keep one core busy through the plan commands and the training.
        memory: The plan command's ``--memory`` (``None``: not passed).
        allow_stale: Pass ``--allow-stale`` (PipeDream-2BW's 1-stale updates), and train the best
            2BW plan of the ranking too.
        timeout: Seconds a plan command or a training launch may take.
        workdir: Where rankings, configs and per-rank results go.
    """

    plans: int = 6
    steps: int = 16
    measured: int = 12
    launches: int = 3
    cli_runs: int = 1
    busy: bool = False
    memory: Optional[str] = None
    allow_stale: bool = False
    timeout: float = 900.0
    workdir: Path = Path("/tmp/bench_planner_user_path")


class StepRecorder(L.Callback):
    """On every rank: the wall time at each training-step end, and one tracked step's peak tensor bytes.

    Steps ``0 .. tracked_step - 1`` are timed; steps ``tracked_step`` and ``tracked_step + 1``
    run under a tracker of every CPU tensor storage (slower, so they are not timed), and the
    peak is the second one's: what the first leaves alive is counted from the second's start on.
    A 2BW step starts with the microbatches the one before forwarded still held (its stream is
    never flushed), which a tracker entered at that step's start could not see. At the end of
    training each rank writes ``rank<r>.json`` in ``out_dir``.

    Args:
        out_dir: Where the per-rank results go.
        tracked_step: The first step run under the tensor tracker; the next one's peak is kept.
    """

    def __init__(self, out_dir: str, tracked_step: int) -> None:
        self.out_dir, self.tracked_step = Path(out_dir), tracked_step
        self.ends: list[float] = []
        self.tracker: Any = None
        self.peak: Optional[int] = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if len(self.ends) == self.tracked_step + 1 and self.tracker is not None:
            self.tracker.peak = self.tracker.now()  # the measured step: from what is alive at its start
            for t in tree_leaves(batch):
                if isinstance(t, Tensor):
                    self.tracker._track(t)
            return
        if len(self.ends) != self.tracked_step:
            return
        from benchmarks.bench_pipelines import PeakTensorBytes
        from lightning_pipe.lightning.monitor import held_tensors

        engine = trainer.strategy.engine
        held = held_tensors(engine.parameters(), trainer.optimizers)
        # 2BW's second weight version and its gradients live across steps beside the module's own.
        second = [t for slot in engine.versions.slots[1:] if slot for p in slot for t in (p, p.grad) if t is not None]
        persistent = held + second + [t for t in tree_leaves(batch) if isinstance(t, Tensor)]
        self.tracker = PeakTensorBytes(persistent, ignored=_dataset_tensors(trainer.train_dataloader))
        self.tracker.__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self.tracker is not None and len(self.ends) == self.tracked_step + 1:
            self.tracker.__exit__(None, None, None)
            self.peak, self.tracker = self.tracker.peak, None  # its references to weights end with it
        self.ends.append(time.perf_counter())

    def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        import torch

        rank = trainer.global_rank
        result = {
            "rank": rank,
            "position": trainer.strategy.topology.position_of(rank),
            "ends": self.ends,
            "peak": self.peak,
            "threads": torch.get_num_threads(),
        }
        (self.out_dir / f"rank{rank}.json").write_text(json.dumps(result))


def _dataset_tensors(loader: Any, depth: int = 4) -> list[Tensor]:
    """The tensors the training data loader's dataset holds (attributes, lists, dicts, ``depth``
    levels down): what the job holds beyond the step, which a view taken inside the tracked steps
    (the next batch's rows) would otherwise count whole."""
    found: list[Tensor] = []

    def walk(obj: Any, left: int) -> None:
        if isinstance(obj, Tensor):
            found.append(obj)
        elif left and isinstance(obj, (list, tuple)):
            for item in obj:
                walk(item, left - 1)
        elif left and isinstance(obj, dict):
            for item in obj.values():
                walk(item, left - 1)
        elif left and hasattr(obj, "__dict__"):
            for item in vars(obj).values():
                walk(item, left - 1)

    for each in loader if isinstance(loader, (list, tuple)) else [loader]:
        walk(getattr(each, "dataset", None), depth)
    return found


@contextlib.contextmanager
def busy_core(busy: bool) -> Iterator[None]:
    """While inside: with ``busy``, a process spinning on one core (a plain Python loop)."""
    if not busy:
        yield
        return
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()


def _run(cmd: Sequence[str], timeout: float, log: Path) -> tuple[int, float]:
    """Run ``cmd`` from the repository root in its own session, output to ``log``: exit code and seconds.

    On timeout the whole session (the command and the processes it launched) is killed, and the
    exit code is -9.
    """
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = -9
    return code, time.perf_counter() - start


def _tail(log: Path, lines: int = 25) -> str:
    """The last ``lines`` lines of a log."""
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def run_cli(work: Workload, devices: int, opts: Options, out: Path) -> dict[str, Any]:
    """One plan command, as a user runs it; its ranking (``--ranking-json``) with ``seconds`` added."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "lightning_pipe.plan", "--config", str(work.config), "--script", str(work.script)]
    cmd += ["--devices", str(devices), "--top", str(opts.plans), "--output", str(out / "plan.yaml")]
    cmd += ["--ranking-json", str(out / "ranking.json")] + (["--memory", opts.memory] if opts.memory else [])
    cmd += ["--allow-stale"] if opts.allow_stale else []
    cmd += ["--profile-json", str(out / "profile.json")]  # the fitted profile, to read a miss afterwards
    code, seconds = _run(cmd, opts.timeout, out / "cli.log")
    if code != 0:
        raise RuntimeError(f"plan command failed ({code}): {' '.join(cmd)}\n{_tail(out / 'cli.log')}")
    return {**json.loads((out / "ranking.json").read_text()), "seconds": seconds}


def plan_key(row: dict[str, Any]) -> tuple:
    """What identifies a plan in a ranking (its layout and microbatch size)."""
    fields = ("width", "depth", "virtual_stages", "microbatches", "microbatch_size", "schedule", "split_backward")
    rest = ("split_placement", "inner", "placement", "data_parallel", "reshard_after_forward")
    return tuple(row.get(k) for k in fields + rest) + (tuple(row["partition"]), tuple(row["recompute"]))


def describe(row: dict[str, Any]) -> str:
    """A plan in one short line: ``(w,d) v b m schedule split partition recompute``."""
    split = (
        "no" if not row["split_backward"] else f"yes ({row['split_placement']})" if row["split_placement"] else "yes"
    )
    recompute = "".join("y" if r else "n" for r in row["recompute"])
    shape = " (V)" if row.get("placement") == "v" else ""
    sharded = (
        f" fsdp(zero{3 if row.get('reshard_after_forward', True) else 2})" if row.get("data_parallel") == "fsdp" else ""
    )
    return (
        f"({row['width']},{row['depth']}) v={row['virtual_stages']}{shape} b={row['microbatch_size']} "
        f"m={row['microbatches']} {row['schedule']} split={split}{sharded} {row['partition']} rc={recompute}"
    )


def row_plan(row: dict[str, Any]) -> PipelinePlan:
    """The plan a ranking row (``--ranking-json``) describes."""
    fields = ("width", "depth", "microbatches", "schedule", "split_backward", "split_placement", "virtual_stages")
    plan = {k: row[k] for k in fields} | {"inner": row["inner"], "placement": row.get("placement")}
    sharding = {k: row[k] for k in ("data_parallel", "reshard_after_forward") if k in row}
    return PipelinePlan(**plan, **sharding, partition=tuple(row["partition"]), recompute=tuple(row["recompute"]))


def strategy_args(row: dict[str, Any], global_batch: int) -> dict[str, Any]:
    """The plan as ``trainer.strategy.init_args``, as the plan command's ``--output`` writes its best plan."""
    return strategy_init_args(row_plan(row), global_batch)


def fit_config(work: Workload, row: dict[str, Any], ranking: dict[str, Any], opts: Options, out: Path) -> Path:
    """The user's config with the plan's strategy arguments, a short run and the recorder as its only callback."""
    recorder = {
        "class_path": "benchmarks.planner_user_path.StepRecorder",
        "init_args": {"out_dir": str(out), "tracked_step": opts.steps},
    }
    init = strategy_args(row, ranking["global_batch"])
    return short_run_config(work.config, init, ranking["devices"], out, recorder, opts.steps + 2)


def measured_steps(ranks: Sequence[dict[str, Any]], measured: int) -> list[float]:
    """The last ``measured`` timed steps, each the slowest rank's (end to end)."""
    return slowest_steps([r["ends"][:-2] for r in ranks])[-measured:]  # the last two ends close the tracked steps


def peaks_per_position(ranks: Sequence[dict[str, Any]], depth: int) -> list[int]:
    """Each pipeline rank's peak tensor bytes: the largest over its replicas."""
    return [max(r["peak"] for r in ranks if r["position"] == p) for p in range(depth)]


def train(work: Workload, row: dict[str, Any], ranking: dict[str, Any], opts: Options, out: Path) -> dict[str, Any]:
    """One plan trained in its own launch (``<script> fit --config``): measured steps, peaks and launch seconds."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("rank*.json"):
        old.unlink()
    config = fit_config(work, row, ranking, opts, out)
    code, seconds = _run(
        [sys.executable, str(work.script), "fit", "--config", str(config)], opts.timeout, out / "fit.log"
    )
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    if code != 0 or len(ranks) != ranking["devices"]:
        raise RuntimeError(
            f"training {describe(row)} failed ({code}), see {out / 'fit.log'}:\n{_tail(out / 'fit.log')}"
        )
    return {
        "steps": measured_steps(ranks, opts.measured),
        "peaks": peaks_per_position(ranks, row["depth"]),
        "seconds": seconds,
        "threads": max(r["threads"] for r in ranks),
    }


def to_train(rankings: Sequence[dict[str, Any]], count: int, stale: bool = False) -> list[dict[str, Any]]:
    """The first ranking's top ``count // 2`` feasible plans and ``count - count // 2`` more spread
    evenly over the rest of its feasible plans (a model is judged over its whole range, not only its
    near-equal top), then every run's chosen plan not among them, and with ``stale`` the first
    ranking's best 2BW plan. The top and the spread take one plan per layout (its best-ranked
    schedule): a layout's schedules are often predicted, and measured, within a few percent of
    each other, so ranking them against each other ranks noise.

    Every plan carries the first ranking's predictions where that ranking lists it, so that the
    layouts of a group are compared with one profile's predictions.
    """
    feasible = [p for p in rankings[0]["plans"] if p["feasible"]]
    first = {plan_key(p): p for p in rankings[0]["plans"]}
    distinct: list[dict[str, Any]] = []
    for p in feasible:
        if not any(_same_layout(p, q) for q in distinct):
            distinct.append(p)
    top = distinct[: count // 2]
    rest = distinct[len(top) :]
    more = count - len(top)
    spread = [rest[round(i * (len(rest) - 1) / max(more - 1, 1))] for i in range(min(more, len(rest)))]
    chosen = top + [p for i, p in enumerate(spread) if p not in spread[:i]]
    keys = {plan_key(p) for p in chosen}
    for ranking in rankings:  # every run's choice, the first's included
        choice = ranking["plans"][ranking.get("chosen") or 0] if ranking["plans"] else None
        if choice is not None and choice["feasible"] and plan_key(choice) not in keys:
            chosen.append(first.get(plan_key(choice), choice))
            keys.add(plan_key(choice))
    two_bw = [p for p in feasible if p["schedule"] == "2bw"]
    if stale and two_bw and plan_key(two_bw[0]) not in keys:
        chosen.append(two_bw[0])
    return chosen


def _same_layout(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Two plans of one layout: the same replicas, stages, placement, partition, recompute and
    microbatches, whatever their schedules and split backward."""
    layout = ("width", "depth", "virtual_stages", "placement", "inner", "microbatches", "microbatch_size")
    layout += ("partition", "recompute", "data_parallel", "reshard_after_forward")
    return all(a.get(k) == b.get(k) for k in layout)


def measure_group(work: Workload, devices: int, opts: Options) -> dict[str, Any]:
    """The plan command ``opts.cli_runs`` times, then each plan to train in its own launch (a line per layout)."""
    base = opts.workdir / f"{work.name}_{devices}"
    rankings = []
    for i in range(opts.cli_runs):
        rankings.append(run_cli(work, devices, opts, base / f"cli{i}"))
        first = rankings[-1]["plans"][0]
        print(
            f"[{work.name} {devices}p] plan command {i + 1}/{opts.cli_runs} ({rankings[-1]['seconds']:.0f} s): "
            f"first choice {describe(first)}, predicted {first['step_seconds']:.4f} s",
            flush=True,
        )
    plans = to_train(rankings, opts.plans, opts.allow_stale)
    launches: list[list[dict[str, Any]]] = [[] for _ in plans]
    for k in range(opts.launches):
        for i, row in enumerate(plans):
            ran = train(work, row, rankings[0], opts, base / f"fit{i}" / f"launch{k}")
            launches[i].append(ran)
            print(
                f"[{work.name} {devices}p] launch {k + 1}/{opts.launches} of layout {i + 1}/{len(plans)} "
                f"({ran['seconds']:.0f} s, {ran['threads']} threads per rank): {describe(row)}: predicted "
                f"{row['step_seconds']:.4f} s, measured {statistics.median(ran['steps']):.4f} s; peak per rank "
                f"predicted / measured {_ratios(row['peak_bytes_per_rank'], ran['peaks'])}",
                flush=True,
            )
    order = [plan_key(p) for p in rankings[0]["plans"]]
    layouts = [
        {"row": row, "ranked": order.index(plan_key(row)) + 1 if plan_key(row) in order else "-", **pooled(ran)}
        for row, ran in zip(plans, launches)
    ]
    return {"workload": work.name, "devices": devices, "rankings": rankings, "layouts": layouts}


def pooled(launches: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A layout's launches as one measurement: the median of all their measured steps, each
    launch's median, and per rank the largest tracked peak (the tracker counts the same storages
    in every launch; the largest is the check that can fail)."""
    return {
        "step": statistics.median(t for ran in launches for t in ran["steps"]),
        "launch_steps": [statistics.median(ran["steps"]) for ran in launches],
        "peaks": [max(each) for each in zip(*(ran["peaks"] for ran in launches))],
    }


def _ratios(predicted: Sequence[int], measured: Sequence[int]) -> str:
    """Predicted over measured per rank, as ``1.003, 0.998``."""
    return ", ".join(f"{p / m:.3f}" for p, m in zip(predicted, measured))


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Spearman's rank correlation (ties get their mean rank); ``nan`` with fewer than 2 values or no spread."""

    def ranks(values: Sequence[float]) -> list[float]:
        order = sorted(range(len(values)), key=lambda i: values[i])
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    if len(xs) < 2:
        return float("nan")
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    spread = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / spread if spread else float("nan")


def memory_ok(layout: dict[str, Any]) -> bool:
    """Every rank's predicted peak at or above the measured one, by at most ``MEMORY_TOLERANCE``."""
    pairs = zip(layout["row"]["peak_bytes_per_rank"], layout["peaks"])
    return all(m <= p <= m * (1 + MEMORY_TOLERANCE) for p, m in pairs)


def chosen_layout(group: dict[str, Any]) -> dict[str, Any]:
    """The measured layout of the first plan command's chosen plan."""
    ranking = group["rankings"][0]
    first = plan_key(ranking["plans"][ranking.get("chosen") or 0])
    return next(x for x in group["layouts"] if plan_key(x["row"]) == first)


def step_scores(predicted: Sequence[float], measured: Sequence[float]) -> dict[str, Any]:
    """How ``predicted`` steps match ``measured`` ones, layout by layout: each relative error, their
    median and worst, the layouts within ``STEP_TOLERANCE``, Spearman's rank correlation, and the
    measured step of the layout predicted fastest over the fastest measured."""
    errors = [p / m - 1 for p, m in zip(predicted, measured)]
    fastest = min(range(len(predicted)), key=predicted.__getitem__)
    return {
        "errors": errors,
        "median_error": statistics.median(abs(e) for e in errors),
        "worst_error": max(errors, key=abs),
        "within": sum(abs(e) <= STEP_TOLERANCE for e in errors),
        "spearman": spearman(predicted, measured),
        "fastest_over_fastest": measured[fastest] / min(measured),
    }


def repeat_scores(group: dict[str, Any]) -> list[dict[str, Any]]:
    """The host's own noise, scored as the planner is: per launch round ``k``, the
    :func:`step_scores` of each layout's ``k``-th launch median taken as the prediction of the
    median of its other launches' medians (empty with fewer than 2 launches).

    This is what one more measurement of every plan predicts: the most a trial of each plan can
    tell. A model of each plan's exact mean step would err by the measured median's noise alone,
    one launch by its own noise as well."""
    layouts = group["layouts"]
    rounds = min(len(x["launch_steps"]) for x in layouts)
    if rounds < 2:
        return []
    scores = []
    for k in range(rounds):
        predicted = [x["launch_steps"][k] for x in layouts]
        measured = [statistics.median(x["launch_steps"][:k] + x["launch_steps"][k + 1 :]) for x in layouts]
        scores.append(step_scores(predicted, measured))
    return scores


def summary(group: dict[str, Any]) -> dict[str, Any]:
    """A group's headline numbers: step errors, the first choice against the fastest, Spearman, memory."""
    layouts = group["layouts"]
    measured = [x["step"] for x in layouts]
    scores = step_scores([x["row"]["step_seconds"] for x in layouts], measured)
    errors = scores["errors"]
    top5 = [abs(e) <= TOP5_TOLERANCE for e in errors[: min(5, len(errors))]]
    modeled = [e for x, e in zip(layouts, errors) if not x["row"].get("trial")]
    return {
        "median_error": scores["median_error"],
        "model_median_error": statistics.median(abs(e) for e in modeled) if modeled else float("nan"),
        "model_layouts": len(modeled),
        "worst_error": scores["worst_error"],
        "within": scores["within"],
        "choice_over_fastest": chosen_layout(group)["step"] / min(measured),
        "spearman": scores["spearman"],
        "memory_ok": all(memory_ok(x) for x in layouts),
        "top5_within": sum(top5),
        "top5": len(top5),
    }


def layout_table(group: dict[str, Any]) -> str:
    """Per layout: predicted and measured step and their ratio, predicted / measured peak per rank."""
    rows = [
        [
            x["ranked"],
            describe(x["row"]),
            "trial" if x["row"].get("trial") else "layout's trial" if x["row"].get("layout_trial") else "model",
            f"{x['row']['step_seconds']:.4f}",
            f"{x['step']:.4f}",
            ", ".join(f"{t:.4f}" for t in x["launch_steps"]),
            f"{x['row']['step_seconds'] / x['step']:.3f}",
            ", ".join(f"{b / 2**20:.2f}" for b in x["row"]["peak_bytes_per_rank"]),
            ", ".join(f"{b / 2**20:.2f}" for b in x["peaks"]),
            _ratios(x["row"]["peak_bytes_per_rank"], x["peaks"]),
        ]
        for x in group["layouts"]
    ]
    header = ["planner's rank", "plan", "step from", "predicted step (s)", "measured step (s)"]
    header += ["each launch's median (s)", "predicted / measured step"]
    header += ["predicted peak per rank (MiB)", "measured peak per rank (MiB)", "predicted / measured peak"]
    return markdown_table(header, rows)


def stability(group: dict[str, Any]) -> str:
    """Over the plan commands: did the first choice hold, and if not, do the choices' predictions overlap?"""
    rankings = group["rankings"]
    firsts = [r["plans"][r.get("chosen") or 0] for r in rankings]  # each run's chosen plan
    keys = list(dict.fromkeys(plan_key(p) for p in firsts))
    seconds = ", ".join(f"{r['seconds']:.0f}" for r in rankings)
    head = f"{len(rankings)} plan commands ({seconds} s each)"
    if len(keys) == 1:
        return f"{head}: the same first choice every time, {describe(firsts[0])}."
    spreads = []
    for key in keys:
        predicted = [p["step_seconds"] for r in rankings for p in r["plans"] if plan_key(p) == key]
        spreads.append((min(predicted), max(predicted)))
    overlap = max(low for low, _ in spreads) <= min(high for _, high in spreads)
    lines = [f"{head}: {len(keys)} different first choices; their predicted steps over the runs:"]
    lines += [
        f"    - {describe(next(p for p in firsts if plan_key(p) == k))}: {lo:.4f} to {hi:.4f} s"
        for k, (lo, hi) in zip(keys, spreads)
    ]
    lines.append(f"  The choices' predictions lie within each other's spread: {'yes' if overlap else 'no'}.")
    noted = [f"±{r['noise']:.1%}" for r in rankings if "noise" in r]
    lines.append(
        f"  Every plan command's table puts every run's choice within the noise of its best ({', '.join(noted)}): "
        f"{'yes' if choices_within_noise(rankings, keys) else 'no'}."
    )
    return "\n".join(lines)


def choices_within_noise(rankings: Sequence[dict[str, Any]], keys: Sequence[tuple]) -> bool:
    """Whether every ranking marks each of the plans ``keys`` (the runs' choices) as predicted
    within the noise of its best plan's step (the plan command's ``within_noise``)."""
    for ranking in rankings:
        marked = {plan_key(p) for p in ranking["plans"] if p.get("within_noise")}
        if not set(keys) <= marked:
            return False
    return True


def launch_spread(group: dict[str, Any]) -> str:
    """Where the choice is not the fastest layout: both layouts' launch medians, lowest to highest
    (a first choice whose launches overlap the fastest's is within the host's noise of it)."""
    chosen, fastest = chosen_layout(group), min(group["layouts"], key=lambda x: x["step"])
    if fastest is chosen:
        return ""
    return (
        f" (the fastest: {describe(fastest['row'])}; launch medians {min(fastest['launch_steps']):.4f} to "
        f"{max(fastest['launch_steps']):.4f} s, the choice's {min(chosen['launch_steps']):.4f} to "
        f"{max(chosen['launch_steps']):.4f} s)"
    )


def group_section(group: dict[str, Any]) -> tuple[str, str]:
    """A group's page section: the layout table, its headline numbers and the plan commands' stability."""
    s = summary(group)
    lines = [
        f"- Step error (predicted / measured - 1): median |error| {s['median_error']:.1%}, "
        f"worst {s['worst_error']:+.1%}; within {STEP_TOLERANCE:.0%}: {s['within']} of {len(group['layouts'])}; "
        f"of the {s['model_layouts']} layouts no trial ran (the fitted model's prediction): median |error| "
        f"{s['model_median_error']:.1%}.",
        *trial_drift(group),
        *repeat_line(group),
        f"- The first choice's measured step over the fastest measured layout's: {s['choice_over_fastest']:.3f}"
        f"{launch_spread(group)}.",
        f"- Spearman rank correlation of predicted and measured steps: {s['spearman']:.2f}.",
        f"- Every memory prediction within {MEMORY_TOLERANCE:.0%} above the measured peak and never under: "
        f"{'yes' if s['memory_ok'] else 'no'}.",
        f"- Top {s['top5']} predictions within {TOP5_TOLERANCE:.0%} of measured: {s['top5_within']} of {s['top5']}.",
        f"- {stability(group)}",
    ]
    body = layout_table(group) + "\n\n" + "\n".join(lines)
    return f"{group['workload']} on {group['devices']} processes (user path)", body


def overview(groups: Sequence[dict[str, Any]]) -> str:
    """One row per workload and process count: the headline numbers side by side."""
    rows = []
    for g in groups:
        s = summary(g)
        choices = list(dict.fromkeys(plan_key(r["plans"][r.get("chosen") or 0]) for r in g["rankings"]))
        same = (
            "yes"
            if len(choices) == 1
            else "no, within the noise"
            if choices_within_noise(g["rankings"], choices)
            else "no"
        )
        rows.append(
            [
                g["workload"],
                g["devices"],
                len(g["layouts"]),
                f"{s['median_error']:.1%}",
                f"{s['model_median_error']:.1%} ({s['model_layouts']})",
                f"{s['worst_error']:+.1%}",
                f"{s['within']}/{len(g['layouts'])}",
                f"{s['choice_over_fastest']:.3f}",
                f"{s['spearman']:.2f}",
                "yes" if s["memory_ok"] else "no",
                f"{s['top5_within']}/{s['top5']}",
                f"{same} ({len(g['rankings'])} runs)",
            ]
        )
    header = ["workload", "processes", "layouts", "median abs step error", "of layouts no trial ran"]
    header += ["worst step error", f"within {STEP_TOLERANCE:.0%}", "choice / fastest"]
    header += [
        "Spearman",
        f"memory within {MEMORY_TOLERANCE:.0%}, never under",
        "top 5 within 25%",
        "same first choice",
    ]
    return markdown_table(header, rows)


def repeat_overview(groups: Sequence[dict[str, Any]]) -> str:
    """One row per group: the planner's step scores beside those of one launch of each layout
    predicting its other launches (:func:`repeat_scores`, the range over the launch rounds)."""
    rows = []
    for g in groups:
        s, rounds = summary(g), repeat_scores(g)
        if not rounds:
            continue
        n = len(g["layouts"])
        rows.append(
            [
                g["workload"],
                g["devices"],
                f"{s['within']} of {n}",
                _span([r["within"] for r in rounds], "{}") + f" of {n}",
                f"{s['median_error']:.1%}",
                _span([r["median_error"] for r in rounds], "{:.1%}"),
                f"{s['spearman']:.2f}",
                _span([r["spearman"] for r in rounds], "{:.2f}"),
                f"{s['choice_over_fastest']:.3f}",
                _span([r["fastest_over_fastest"] for r in rounds], "{:.3f}"),
            ]
        )
    header = ["workload", "processes", f"planner: within {STEP_TOLERANCE:.0%}", "one launch: within"]
    header += ["planner: median abs error", "one launch: median abs error", "planner: Spearman"]
    header += ["one launch: Spearman", "planner: choice / fastest", "one launch: its fastest / fastest"]
    note = (
        "How well a repeat measurement predicts the page's: each layout's launches taken one at a time as "
        "the prediction of the median of its other launches (the range over the launch rounds). That is "
        "the most a trial of each plan can tell, without the host's drift between planning and training "
        "(each group's section lists the plan command's trials against the same plans trained later); a "
        "model of each plan's exact mean step would err by the measurement's noise alone, somewhat less."
    )
    return note + "\n\n" + markdown_table(header, rows)


def _span(values: Sequence[float], form: str) -> str:
    """``values``' lowest and highest, as ``low to high`` (one value where they are equal)."""
    low, high = form.format(min(values)), form.format(max(values))
    return low if low == high else f"{low} to {high}"


def trial_drift(group: dict[str, Any]) -> list[str]:
    """A line on the layouts the plan command's trials ran: their trial's step against the same
    plan trained later (the host's drift between planning and training, which the model inherits)."""
    ran = [x for x in group["layouts"] if x["row"].get("trial")]
    if not ran:
        return []
    drift = ", ".join(f"{x['row']['step_seconds'] / x['step'] - 1:+.1%}" for x in ran)
    return [f"- The plan command's trials against the same plans trained later: {drift}."]


def repeat_line(group: dict[str, Any]) -> list[str]:
    """A line on :func:`repeat_scores`: how well one launch of each layout predicts its others."""
    rounds = repeat_scores(group)
    if not rounds:
        return []
    n = len(group["layouts"])
    return [
        f"- One launch of each layout as the prediction of its other launches' median ({len(rounds)} rounds): "
        f"median |error| {_span([r['median_error'] for r in rounds], '{:.1%}')}, worst "
        f"{max((r['worst_error'] for r in rounds), key=abs):+.1%}, within {STEP_TOLERANCE:.0%}: "
        f"{_span([r['within'] for r in rounds], '{}')} of {n}, Spearman "
        f"{_span([r['spearman'] for r in rounds], '{:.2f}')}, the layout it finds fastest measured at "
        f"{_span([r['fastest_over_fastest'] for r in rounds], '{:.3f}')} the fastest."
    ]


def user_path(workloads: Sequence[str], devices: Sequence[int], opts: Options) -> list[tuple[str, str]]:
    """Every workload at every process count on the user's path; prints and returns the page's sections."""
    groups = []
    with busy_core(opts.busy):
        for name in workloads:
            for n in devices:
                groups.append(measure_group(WORKLOADS[name], n, opts))
                heading, body = group_section(groups[-1])
                print(f"\n## {heading}\n\n{body}\n", flush=True)
    table, repeat = overview(groups), repeat_overview(groups)
    print(f"{table}\n\n{repeat}", flush=True)
    sections = [("User path: overview", table), ("The planner against one more launch of each plan", repeat)]
    return sections + [group_section(g) for g in groups]


def intro(opts: Options) -> str:
    """The page's introduction: what ran and how it was measured."""
    busy = " A spinning process kept one core busy throughout." if opts.busy else ""
    stale = (
        " The plan command ran with `--allow-stale` (PipeDream-2BW plans ranked too), and the best 2BW plan "
        "was trained as well."
        if opts.allow_stale
        else ""
    )
    return (
        "The planner as a user runs it: `python -m lightning_pipe.plan --config <config> --script <script> "
        f"--devices N` once per workload and process count ({opts.cli_runs} time(s)), with its default trial "
        f"runs, then, after it has exited, {opts.plans} of its plans (the top {opts.plans // 2} and the rest "
        "spread evenly over its ranking, plus its choice) trained through `Trainer.fit` in its own launch (the "
        "workload's script under `fit`, Lightning's launcher, the user's config with the plan's strategy "
        f"arguments), {opts.launches} launches per plan, round-robin over the plans. Measured step: the slowest "
        f"rank's wall time between consecutive step ends, median over the last {opts.measured} of {opts.steps} "
        "steps of every launch. Measured peak: two more steps under a tracker of every CPU "
        "tensor storage on each rank (the second's peak, counting what the first left alive: a 2BW step starts "
        "with the last one's microbatches in flight), the largest over replicas and launches per pipeline rank. "
        "Workloads: `gpt` "
        "(configs/gpt_1f1b.yaml with examples/gpt.py: 4 layers, width 128, context 64, global batch 32, AdamW) "
        "and `nonuniform` (benchmarks/nonuniform.yaml with benchmarks/nonuniform.py: about 1M parameters in "
        f"blocks of very different widths and costs, AdamW, generated tokens).{busy}{stale}"
    )
