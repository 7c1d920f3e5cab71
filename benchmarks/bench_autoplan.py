"""AutoPlanner on the GPT example over 4 processes: throughput after its switch against a measured sweep, its cost.

    python benchmarks/bench_autoplan.py                          # writes docs/results/bench_autoplan.md
    python benchmarks/bench_autoplan.py --measured 6 --no-page   # a quick check

Two ``torchrun`` launches of 4 gloo processes, each from fresh processes as a job starts (a
process that has run other fits holds their threads, which disturb the AutoPlanner's measurement
of how the ranks share the host's cores), through ``Trainer.fit`` (the same harness for every
row): the AutoPlanner started ``--repeats`` times from the poor plan ``(1,4)`` GPipe, uniform
partition, one microbatch; then a sweep of fixed 4-process plans of the GPT example
(configs/gpt_auto.yaml's model and global batch of 32). Step time is the median wall time between
consecutive training steps (data loading, Lightning and the step), after a warm-up. The
AutoPlanner profiles for 5 steps, predicts every plan and switches to its choice; each run
reports whether it switched and its measured over predicted step after the switch; the first
run's throughput after the switch is compared with the best plan of the sweep, and the switch
(drain, state move, rebuild) is counted in steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]  # lightning_pipe, benchmarks, gpt

from gpt import GPT, StdlibText  # noqa: E402

from benchmarks.results_page import add_page_flag, command_line, markdown_table, write_page
from lightning_pipe import AutoPlanner, PipelinePlan, PipelineStrategy  # noqa: E402

GLOBAL, WARMUP = 32, 3
POOR = PipelinePlan(1, 4, 1, "gpipe", partition="uniform")
#: The sweep: the poor start, and plans across every (w, d) with w * d = 4.
SWEEP = [
    POOR,
    PipelinePlan(1, 4, 2, "1f1b", partition="uniform"),
    PipelinePlan(1, 4, 2, "1f1b", partition=(2, 1, 1, 2)),
    PipelinePlan(1, 4, 4, "1f1b", partition=(2, 1, 1, 2)),
    PipelinePlan(1, 4, 2, "1f1b", True, partition=(2, 1, 1, 2)),
    PipelinePlan(1, 4, 8, "1f1b", partition=(2, 1, 1, 2)),
    PipelinePlan(2, 2, 1, "1f1b", partition=(3, 3)),
    PipelinePlan(2, 2, 2, "1f1b", partition=(3, 3)),
    PipelinePlan(2, 2, 4, "1f1b", partition=(3, 3)),
    PipelinePlan(2, 2, 1, "gpipe", True, partition=(3, 3)),
    PipelinePlan(4, 1, 1, "gpipe"),
    PipelinePlan(4, 1, 2, "1f1b"),
]


class StepClock(L.Callback):
    """Wall seconds between consecutive training-step ends."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, *args: Any) -> None:
        self.ends.append(time.perf_counter())

    def steps(self, first: int = 0) -> list[float]:
        """Durations of the steps after step ``first``."""
        return [b - a for a, b in zip(self.ends[first:], self.ends[first + 1 :])]


def _fit(plan: PipelinePlan, steps: int, auto: Optional[AutoPlanner] = None) -> tuple[StepClock, Any]:
    torch.manual_seed(0)
    clock = StepClock()
    callbacks = [clock] + ([auto] if auto is not None else [])
    trainer = L.Trainer(
        accelerator="cpu",
        devices=4,
        max_steps=steps,
        max_epochs=-1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        strategy=PipelineStrategy(plan=plan, global_batch_size=GLOBAL, timeout=timedelta(seconds=120)),
    )
    trainer.fit(GPT(n_layer=4, n_embd=128, n_head=4, block_size=64), StdlibText(block_size=64, batch_size=8))
    return clock, trainer


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--measured", type=int, default=15, help="measured steps of each plan, after 3 warm-up steps")
    parser.add_argument("--repeats", type=int, default=5, help="AutoPlanner runs from the poor start")
    parser.add_argument("--no-sweep", action="store_true", help="only the AutoPlanner runs, no sweep of fixed plans")
    add_page_flag(parser)
    return parser.parse_args()


def _auto_runs(args: argparse.Namespace, say: Any) -> dict[str, Any]:
    """The AutoPlanner ``args.repeats`` times from the poor start: each run's decision and measured step after it."""
    runs = []
    for r in range(max(args.repeats, 1)):
        auto = AutoPlanner(profile_steps=5, min_gain=0.05)
        clock, _ = _fit(POOR, 5 + 1 + WARMUP + args.measured, auto)
        d = auto.decisions[0]
        after = statistics.median(clock.steps(5 + WARMUP))
        runs.append(
            {
                "reason": d["reason"],
                "chosen": d["chosen"].plan.describe(),
                "predicted": d["chosen"].step_time,
                "after": after,
                "switched": d["chosen"] is not d["current"] and not d["reverted"],
                "current_predicted": d["current"].step_time,
                "current_measured": d["current_measured_step_s"] or float("nan"),
                "switch_seconds": d["switch_seconds"],
                "before": statistics.median(clock.steps(1)[:4]),  # steps 2-5, on the poor plan
            }
        )
        say(
            f"[autoplanner {r + 1}/{args.repeats}] {'switched to' if runs[-1]['switched'] else 'kept'} "
            f"{runs[-1]['chosen']}: predicted {d['chosen'].step_time:.4f} s, measured after "
            f"{after:.4f} s (measured / predicted {after / d['chosen'].step_time:.2f})"
        )
    return {"runs": runs}


def _sweep(args: argparse.Namespace, say: Any) -> dict[str, Any]:
    """Each plan of :data:`SWEEP` trained as a fixed plan: its median step."""
    measured = {}
    for i, plan in enumerate(SWEEP):
        clock, _ = _fit(plan, WARMUP + args.measured + 1)
        measured[plan.describe()] = statistics.median(clock.steps(WARMUP))
        say(f"[sweep {i + 1}/{len(SWEEP)}] {plan.describe()}: {measured[plan.describe()]:.4f} s per step")
    return {"measured": measured}


def worker() -> None:
    """Runs on every rank under torchrun, one part of the benchmark a launch; rank 0 writes its results as JSON."""
    import torch.distributed as dist

    args = _arguments()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank0 = dist.get_rank() == 0
    say = (lambda text: print(text, flush=True)) if rank0 else (lambda text: None)
    part = _auto_runs if os.environ["BENCH_AUTOPLAN_WORKER"] == "auto" else _sweep
    results = part(args, say)
    if rank0:
        Path(os.environ["BENCH_AUTOPLAN_OUT"]).write_text(json.dumps(results))
    dist.destroy_process_group()


def _report(args: argparse.Namespace, runs: list[dict[str, Any]], measured: dict[str, float]) -> None:
    """Prints the AutoPlanner's runs against the sweep and writes the page (unless ``--no-page``)."""
    ratios = [run["after"] / run["predicted"] for run in runs]
    repeated = [
        f"from {POOR.describe()}, {len(runs)} runs: switched in {sum(r['switched'] for r in runs)} of {len(runs)}; "
        f"measured / predicted step after the decision: {', '.join(f'{x:.2f}' for x in ratios)} "
        f"({sum(abs(x - 1) <= 0.25 for x in ratios)} of {len(runs)} within 25%)"
    ]
    repeated += [
        f"run {i + 1}: {r['reason']}; chose {r['chosen']}, predicted {r['predicted']:.4f} s, "
        f"measured {r['after']:.4f} s; running plan predicted {r['current_predicted']:.4f} s, measured "
        f"{r['current_measured']:.4f} s"
        for i, r in enumerate(runs)
    ]
    print("\n" + "\n  ".join(repeated), flush=True)
    if not measured:
        return
    first, best_name = runs[0], min(measured, key=measured.get)
    after, before = first["after"], first["before"]
    lines = [
        f"AutoPlanner from {POOR.describe()}: chose {first['chosen']} ({first['reason']})",
        (
            f"predicted step {first['predicted']:.4f} s, measured after the switch {after:.4f} s "
            f"(poor plan before it: {before:.4f} s)"
        ),
        (
            f"best measured in the sweep: {best_name} at {measured[best_name]:.4f} s; "
            "throughput after the switch / best: "
            f"{measured[best_name] / after:.3f}"
        ),
    ]
    if first["chosen"] in measured:
        lines.append(f"the chosen plan in the sweep: {measured[first['chosen']]:.4f} s")
    lines.append(
        f"switch (drain, state move, rebuild): {first['switch_seconds']:.3f} s = "
        f"{first['switch_seconds'] / after:.2f} steps of the new plan, {first['switch_seconds'] / before:.2f} "
        "of the poor one"
    )
    print("\n" + "\n  ".join(lines), flush=True)
    if args.no_page:
        return
    sweep = markdown_table(
        ["plan", "step (s)", "throughput / best"],
        [[f"`{name}`", f"{s:.4f}", f"{measured[best_name] / s:.3f}"] for name, s in measured.items()],
    )
    intro = (
        f"4 gloo processes, one thread each, through `Trainer.fit` (the same harness for every row): the GPT "
        f"example (4 layers, width 128, context 64), global batch {GLOBAL}. Step time is the median wall time "
        f"between consecutive training steps over {args.measured} steps after {WARMUP} warm-up steps. The "
        "AutoPlanner's runs and the sweep run in two launches, each from fresh processes, as a job starts: "
        "a process that has run other fits holds their threads, which disturb the AutoPlanner's measurement "
        "of how the ranks share the host's cores."
    )
    sections = [
        ("AutoPlanner from a poor start, repeated", "\n".join(f"- {line}" for line in repeated)),
        ("AutoPlanner against the sweep (first run)", "\n".join(f"- {line}" for line in lines)),
        ("Sweep of fixed plans", sweep),
    ]
    path = write_page(
        "bench_autoplan", "AutoPlanner: throughput after its switch against a sweep", command_line(), sections, intro
    )
    print(f"page: {path}", flush=True)


def _launch(part: str, out: Path) -> dict[str, Any]:
    """One ``torchrun`` launch of 4 processes running ``part`` of the benchmark; its results."""
    env = {**os.environ, "BENCH_AUTOPLAN_WORKER": part, "BENCH_AUTOPLAN_OUT": str(out)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4", __file__]
    subprocess.run(cmd + sys.argv[1:], env=env, check=True)
    return json.loads(out.read_text())


def main() -> None:
    args = _arguments()  # --help, and unknown flags fail here, before the launch
    print(f"torch {torch.__version__}, 4 gloo processes", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        runs = _launch("auto", Path(tmp) / "auto.json")["runs"]
        measured = {} if args.no_sweep else _launch("sweep", Path(tmp) / "sweep.json")["measured"]
    _report(args, runs, measured)


if __name__ == "__main__":
    worker() if os.environ.get("BENCH_AUTOPLAN_WORKER") else main()
