"""Checkpoint save and load per rank: peak memory and seconds, gathered on every rank vs sharded vs one file.

    python benchmarks/bench_checkpoint.py             # re-launches itself with torchrun on 4 CPU processes
    python benchmarks/bench_checkpoint.py --no-page   # print the table only

A chain of eight 1024 x 1024 linear blocks with Adam on a (1 x 4) pipeline: the whole model's
state is 4 times one stage's. Each save path runs through ``trainer.save_checkpoint`` (one
warm-up save, then the measured one); loads run through ``strategy.load_checkpoint``. The peak
is the rise of the process's resident set (VmHWM, reset before each call) over its size just
before the call. The baseline, every rank gathering the whole model with ``all_gather_object``,
shows what sharding saves: its peak grows with the whole model, a sharded save's with one stage.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]  # lightning_pipe, benchmarks, gpt

from benchmarks.results_page import add_page_flag, command_line, markdown_table, write_page
from lightning_pipe import PipelineMixin, PipelineStrategy  # noqa: E402
from lightning_pipe.lightning.checkpoint import save_file  # noqa: E402

WIDTH, BLOCKS, DEPTH = 1024, 8, 4
MiB = 2**20


class LinearChain(PipelineMixin, L.LightningModule):
    """Eight 1024 x 1024 linear blocks (4 MiB of weights each), Adam."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(BLOCKS))

    def pipeline_blocks(self) -> list[nn.Module]:
        return list(self.blocks)

    def pipeline_loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        return output.pow(2).mean()

    def training_step(self, batch: Any, batch_idx: int) -> None:
        self.pipeline_step(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-4)


class GatherEverywhere(PipelineStrategy):
    """The unsharded baseline: every rank gathers the whole model with all_gather_object, rank 0 writes it."""

    def _gather(self, obj: Any) -> list[Any]:
        parts: list[Any] = [None] * self.plan.depth
        dist.all_gather_object(parts, obj, group=self._groups.pp)
        return parts

    def lightning_module_state_dict(self) -> dict[str, Any]:
        local = {k: v.detach().cpu() for k, v in self.lightning_module.state_dict().items()}
        return {k: v for part in self._gather(local) for k, v in part.items()}

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        optimizer = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        return {"pipeline_stages": self._gather(optimizer.state_dict())}

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if self.is_global_zero:
            save_file(checkpoint, Path(filepath))


def _rss() -> tuple[int, int]:
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def measure(fn: Callable[[], Any]) -> tuple[float, float]:
    """(peak resident increase in MiB, seconds) of ``fn`` on this rank, started together on all ranks."""
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size
    before, _ = _rss()
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    return (_rss()[1] - before) / MiB, seconds


def _trained(strategy: PipelineStrategy) -> L.Trainer:
    torch.manual_seed(0)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=DEPTH,
        strategy=strategy,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(LinearChain(), torch.utils.data.DataLoader(torch.randn(8, WIDTH), batch_size=8))
    return trainer


def _stage_bytes(trainer: L.Trainer) -> int:
    state = trainer.strategy.placement.export_state(trainer.optimizers[0])
    tensors = [*state["model"].values(), *state["optimizer"].values()]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def run(folder: Path) -> dict[str, Any]:
    """Every save and load path on this rank: {row: (MiB, seconds)}, plus the stage's state size."""
    rows: dict[str, Any] = {}
    paths = {
        "save: all_gather_object on every rank (baseline)": (
            GatherEverywhere(pipeline_depth=DEPTH, partition="uniform"),
            "gathered.ckpt",
        ),
        "save: sharded DCP directory (default)": (
            PipelineStrategy(pipeline_depth=DEPTH, partition="uniform"),
            "sharded.ckpt",
        ),
        "save: one file, gathered on rank 0": (
            PipelineStrategy(pipeline_depth=DEPTH, partition="uniform", save_distributed_checkpoint=False),
            "file.ckpt",
        ),
    }
    for label, (strategy, name) in paths.items():
        trainer = _trained(strategy)
        path = folder / name
        trainer.save_checkpoint(path)  # warm-up: lazy imports, first-touch allocations
        rows[label] = measure(lambda: trainer.save_checkpoint(path))
        rows["stage"] = _stage_bytes(trainer)
        if not isinstance(strategy, GatherEverywhere):
            load = label.replace("save:", "load:").replace(", gathered on rank 0", "")
            rows[load] = measure(lambda: trainer.strategy.load_checkpoint(path))
        if dist.get_rank() == 0:
            print(f"  {label}: done", flush=True)
    return rows


def table(results: list[dict[str, Any]]) -> str:
    """Markdown: one row per path, peak increase per rank, the largest as a multiple of one stage, seconds."""
    stage = results[0]["stage"]
    header = ["path", *(f"rank {r} peak (MiB)" for r in range(len(results))), "largest / one stage", "seconds"]
    rows = []
    for label in [k for k in results[0] if k != "stage"]:
        peaks = [r[label][0] for r in results]
        seconds = max(r[label][1] for r in results)
        rows.append([label, *(f"{p:.1f}" for p in peaks), f"{max(peaks) * MiB / stage:.2f}", f"{seconds:.3f}"])
    return markdown_table(header, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_page_flag(parser)
    args = parser.parse_args()
    if "LOCAL_RANK" not in os.environ:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={DEPTH}",
            "--master_port=29561",
            __file__,
            *sys.argv[1:],
        ]
        raise SystemExit(subprocess.call(cmd))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with tempfile.TemporaryDirectory() as tmp:
        shared = [tmp]  # every rank writes under rank 0's folder
        dist.broadcast_object_list(shared, src=0)
        rows = run(Path(shared[0]))
    results: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(results, rows)
    if rank == 0:
        stage = results[0]["stage"]
        sizes = (
            f"One stage's state (weights + Adam): {stage / MiB:.1f} MiB; "
            f"the whole model's: {DEPTH * stage / MiB:.1f} MiB."
        )
        print(f"\n{sizes}\n\n{table(results)}", flush=True)
        if not args.no_page:
            intro = (
                f"{DEPTH} gloo processes, one thread each, a (1 x {DEPTH}) pipeline of {BLOCKS} linear blocks "
                f"{WIDTH} x {WIDTH} with Adam. Saves run through `trainer.save_checkpoint` (one warm-up save, then "
                "the measured one), loads through `strategy.load_checkpoint`. A rank's peak is the rise of its "
                "resident set (VmHWM, reset before each call) over its size just before the call; seconds are the "
                "slowest rank's."
            )
            sections = [("Save and load, per rank", f"{sizes}\n\n{table(results)}")]
            path = write_page(
                "bench_checkpoint", "Checkpoint save and load: memory and time", command_line(), sections, intro
            )
            print(f"page: {path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
