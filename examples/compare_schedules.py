"""Train the GPT example under several schedules, same seed and steps, and compare loss curves.

    python examples/compare_schedules.py --schedules 1f1b 2bw --out docs

Writes ``<out>/loss_<names>.png`` and prints a markdown table (final losses, wall time).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def train(schedule: str, logs: Path, extra: list[str]) -> float:
    """Run the example with ``configs/gpt_<schedule>.yaml``; return its wall time in seconds."""
    cmd = [
        sys.executable,
        str(ROOT / "examples" / "gpt.py"),
        "fit",
        f"--config={ROOT / 'configs' / f'gpt_{schedule}.yaml'}",
        f"--trainer.logger.init_args.save_dir={logs}",
        "--trainer.enable_progress_bar=false",
        *extra,
    ]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT)
    return time.perf_counter() - start


def curves(logs: Path, schedule: str) -> dict[str, list[tuple[int, float]]]:
    """The run's logged train and validation losses as (step, value) pairs."""
    acc = EventAccumulator(str(max((logs / f"gpt_{schedule}").glob("version_*"))))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in ("train_loss", "val_loss")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "2bw"])
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    parser.add_argument("--logs", type=Path, default=ROOT / "logs" / "compare")
    parser.add_argument("extra", nargs="*", help="more overrides for every run, e.g. --trainer.max_steps=600")
    args = parser.parse_args()
    results = {}
    for schedule in args.schedules:
        seconds = train(schedule, args.logs, args.extra)
        results[schedule] = (seconds, curves(args.logs, schedule))
    fig, ax = plt.subplots(figsize=(7, 4))
    for schedule, (_, data) in results.items():
        steps, values = zip(*data["train_loss"])
        ax.plot(steps, values, label=f"{schedule} train")
        vsteps, vvalues = zip(*data["val_loss"])
        ax.plot(vsteps, vvalues, "o--", label=f"{schedule} validation")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats/byte)")
    ax.set_title("Character-level GPT on the Python stdlib, 2 CPU processes")
    ax.legend()
    args.out.mkdir(parents=True, exist_ok=True)
    png = args.out / f"loss_{'_'.join(args.schedules)}.png"
    fig.savefig(png, dpi=120, bbox_inches="tight")
    print("\n| schedule | wall time (s) | final train loss (mean of last 5 logs) | final val loss |\n|---|---|---|---|")
    for schedule, (seconds, data) in results.items():
        tail = [v for _, v in data["train_loss"][-5:]]
        print(f"| {schedule} | {seconds:.1f} | {sum(tail) / len(tail):.4f} | {data['val_loss'][-1][1]:.4f} |")
    print(f"\nwrote {png}")


if __name__ == "__main__":
    main()
