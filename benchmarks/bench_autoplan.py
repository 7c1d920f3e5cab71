"""AutoPlanner on the GPT example over 4 processes: throughput after its switch against a measured sweep, its cost.

    python benchmarks/bench_autoplan.py                          # writes docs/results/bench_autoplan.md
    python benchmarks/bench_autoplan.py --measured 6 --no-page   # a quick check

One ``torchrun`` launch of 4 gloo processes runs, through ``Trainer.fit`` (the same harness for
every row): a sweep of fixed 4-process plans of the GPT example (configs/gpt_auto.yaml's model
and global batch of 32), then the AutoPlanner started ``--repeats`` times from the poor plan
``(1,4)`` GPipe, uniform partition, one microbatch. Step time is the median wall time between consecutive training steps
(data loading, Lightning and the step), after a warm-up. The AutoPlanner profiles for 5 steps,
predicts every plan and switches to its choice; each run reports whether it switched and its
measured over predicted step after the switch; the first run's throughput after the switch is
compared with the best plan of the sweep, and the switch (drain, state move, rebuild) is counted
in steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
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


def worker() -> None:
    """Runs on every rank under torchrun; rank 0 prints and writes the page."""
    import torch.distributed as dist

    args = _arguments()
    measured_steps = args.measured
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank0 = dist.get_rank() == 0
    say = (lambda text: print(text, flush=True)) if rank0 else (lambda text: None)
    measured = {}
    for i, plan in enumerate([] if args.no_sweep else SWEEP):
        clock, _ = _fit(plan, WARMUP + measured_steps + 1)
        measured[plan.describe()] = statistics.median(clock.steps(WARMUP))
        say(f"[sweep {i + 1}/{len(SWEEP)}] {plan.describe()}: {measured[plan.describe()]:.4f} s per step")
    runs = []
    for r in range(max(args.repeats, 1)):
        auto = AutoPlanner(profile_steps=5, min_gain=0.05)
        clock, trainer = _fit(POOR, 5 + 1 + WARMUP + measured_steps, auto)
        decision = auto.decisions[0]
        after_run = statistics.median(clock.steps(5 + WARMUP))
        switched = decision["chosen"] is not decision["current"] and not decision["reverted"]
        runs.append((decision, after_run, switched, auto, clock))
        say(
            f"[autoplanner {r + 1}/{args.repeats}] {'switched to' if switched else 'kept'} "
            f"{decision['chosen'].plan.describe()}: predicted {decision['chosen'].step_time:.4f} s, measured after "
            f"{after_run:.4f} s (measured / predicted {after_run / decision['chosen'].step_time:.2f})"
        )
    decision, after, _, auto, clock = runs[0]
    before = statistics.median(clock.steps(1)[:4])  # steps 2-5, on the poor plan
    ratios = [a / d["chosen"].step_time for d, a, *_ in runs]
    repeated = [
        f"from {POOR.describe()}, {len(runs)} runs: switched in {sum(r[2] for r in runs)} of {len(runs)}; "
        f"measured / predicted step after the decision: {', '.join(f'{x:.2f}' for x in ratios)} "
        f"({sum(abs(x - 1) <= 0.25 for x in ratios)} of {len(runs)} within 25%)"
    ]
    repeated += [
        f"run {i + 1}: {d['reason']}; chose {d['chosen'].plan.describe()}, predicted {d['chosen'].step_time:.4f} s, "
        f"measured {a:.4f} s; running plan predicted {d['current'].step_time:.4f} s, measured "
        f"{d['current_measured_step_s'] or float('nan'):.4f} s"
        for i, (d, a, *_) in enumerate(runs)
    ]
    say("\n" + "\n  ".join(repeated))
    if not measured:
        dist.destroy_process_group()
        return
    best_name = min(measured, key=measured.get)
    chosen = decision["chosen"].plan.describe()
    lines = [
        f"AutoPlanner from {POOR.describe()}: chose {chosen} ({decision['reason']})",
        (
            f"predicted step {decision['chosen'].step_time:.4f} s, measured after the switch {after:.4f} s "
            f"(poor plan before it: {before:.4f} s)"
        ),
        (
            f"best measured in the sweep: {best_name} at {measured[best_name]:.4f} s; "
            "throughput after the switch / best: "
            f"{measured[best_name] / after:.3f}"
        ),
    ]
    if chosen in measured:
        lines.append(f"the chosen plan in the sweep: {measured[chosen]:.4f} s")
    lines.append(
        f"switch (drain, state move, rebuild): {decision['switch_seconds']:.3f} s = "
        f"{decision['switch_seconds'] / after:.2f} steps of the new plan, {decision['switch_seconds'] / before:.2f} "
        "of the poor one"
    )
    say("\n" + "\n  ".join(lines))
    if rank0 and not args.no_page:
        sweep = markdown_table(
            ["plan", "step (s)", "throughput / best"],
            [[f"`{name}`", f"{s:.4f}", f"{measured[best_name] / s:.3f}"] for name, s in measured.items()],
        )
        intro = (
            f"4 gloo processes, one thread each, through `Trainer.fit` (the same harness for every row): the GPT "
            f"example (4 layers, width 128, context 64), global batch {GLOBAL}. Step time is the median wall time "
            f"between consecutive training steps over {measured_steps} steps after {WARMUP} warm-up steps."
        )
        sections = [
            ("AutoPlanner from a poor start, repeated", "\n".join(f"- {line}" for line in repeated)),
            ("AutoPlanner against the sweep (first run)", "\n".join(f"- {line}" for line in lines)),
            ("Sweep of fixed plans", sweep),
        ]
        path = write_page(
            "bench_autoplan",
            "AutoPlanner: throughput after its switch against a sweep",
            command_line(),
            sections,
            intro,
        )
        say(f"page: {path}")
    dist.destroy_process_group()


def main() -> None:
    _arguments()  # --help, and unknown flags fail here, before the launch
    print(f"torch {torch.__version__}, 4 gloo processes", flush=True)
    env = {**os.environ, "BENCH_AUTOPLAN_WORKER": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "4",
        __file__,
        *sys.argv[1:],
    ]
    subprocess.run(cmd, env=env, check=True)


if __name__ == "__main__":
    worker() if os.environ.get("BENCH_AUTOPLAN_WORKER") else main()
