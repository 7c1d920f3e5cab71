"""Benchmark FSDP stage replicas against DDP ones: peak tensor memory per rank and step time, side by side.

    python benchmarks/bench_fsdp.py                                   # writes docs/results/bench_fsdp.md
    python benchmarks/bench_fsdp.py --layouts 2x1 --rounds 1 --steps 1 --blocks 2 --width 64 --no-page   # a quick check

A model whose optimizer state dominates: a chain of wide MLP blocks (two square ``Linear``
layers and a ReLU each, ``--width`` features) trained with AdamW on a small batch, so weights,
gradients and Adam's two moments (16 bytes per parameter) outweigh the activations. Each layout
``(w, d)`` (``w`` replicas of a ``d``-stage 1F1B pipeline, ``w * d`` gloo processes on CPU, one
torch thread each) runs three contenders on the same model and global batch: DDP replicas
(every rank holds its whole stage), FSDP ZeRO-2 (``reshard_after_forward=False``) and FSDP
ZeRO-3 (``True``); the ZeRO paper (Rajbhandari et al., "ZeRO: Memory Optimizations Toward
Training Trillion Parameter Models") predicts the sharded state to fall as ``1/w``.

Contenders are interleaved round by round, each round building all three afresh in a rotated
order and timing each in that order (the slowest rank's seconds per step), so machine drift hits
them alike; each FSDP contender's step is divided by DDP's of the same round, and the table
gives the median of those ratios. After the last round each contender runs one extra untimed
step under bench_pipelines.py's ``PeakTensorBytes`` (every CPU tensor storage at its size at
each moment: FSDP frees a gathered weight by resizing its storage to 0), beside the memory model's prediction
for that rank (``predict.predict``, from a profile of the blocks taken before the run), and
the bytes of weights, reduced gradients and AdamW state the rank keeps between steps.
The peak falls by less than that state: a stage holds its whole gradients, unsharded, from its
first backward to the reduce-scatter, and a running block's weights gathered (docs/fsdp.md).
Rank 0 shows progress (one tick per timed contender).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from benchmarks.bench_pipelines import PeakTensorBytes  # noqa: E402
from benchmarks.results_page import add_page_flag, command_line, markdown_table, write_page  # noqa: E402
from lightning_pipe import PipelineGroups, PipelineMixin, PipelinePlan, place  # noqa: E402
from lightning_pipe.lightning.monitor import held_tensors  # noqa: E402
from lightning_pipe.planning import predict  # noqa: E402
from lightning_pipe.planning.profile import Profile  # noqa: E402
from lightning_pipe.planning.profiler import profile_blocks  # noqa: E402
from lightning_pipe.runtime.sharding import local  # noqa: E402
from lightning_pipe.runtime.spawn import run_gloo  # noqa: E402

#: The contenders, in the order a round starts from: name -> (data_parallel, reshard_after_forward).
CONTENDERS = {"ddp": ("ddp", True), "fsdp zero-2": ("fsdp", False), "fsdp zero-3": ("fsdp", True)}
#: The layouts ``(w, d)`` the full run measures.
LAYOUTS = ((2, 1), (4, 1), (2, 2))
SCHEDULE = "1f1b"


class WideMLP(PipelineMixin, L.LightningModule):
    """``blocks`` MLP blocks of ``width`` features (two square ``Linear`` layers and a
    ReLU each), a mean-squared-error loss; AdamW. Batches are ``(inputs, targets)``, both ``[n, width]``."""

    def __init__(self, blocks: int, width: int) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.chain = nn.ModuleList(
            [nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width)) for _ in range(blocks)]
        )

    def pipeline_blocks(self) -> list[nn.Module]:
        return list(self.chain)

    def pipeline_loss(self, output: Tensor, batch: Any) -> Tensor:
        return F.mse_loss(output, batch[1])


def adamw(params: Any) -> torch.optim.Optimizer:
    """The benchmark's optimizer: AdamW, two fp32 moments per parameter."""
    return torch.optim.AdamW(params, lr=1e-4)


def make_batch(samples: int, width: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    """``samples`` random inputs and targets of ``width`` features."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(samples, width, generator=g), torch.randn(samples, width, generator=g)


@dataclass(frozen=True)
class Workload:
    """What every contender of every layout trains: the model, the global batch and its microbatches."""

    blocks: int
    width: int
    global_batch: int
    microbatches: int

    def microbatch_size(self, width: int) -> int:
        """Samples per microbatch at ``width`` replicas: the global batch split over them, then into microbatches."""
        return self.global_batch // (width * self.microbatches)

    def plan(self, width: int, depth: int, contender: str) -> PipelinePlan:
        """The contender's plan at layout ``(width, depth)``: blocks split evenly over the stages."""
        data_parallel, reshard = CONTENDERS[contender]
        return PipelinePlan(
            width,
            depth,
            self.microbatches,
            SCHEDULE,
            partition=tuple(self.blocks // depth + (s < self.blocks % depth) for s in range(depth)),
            data_parallel=data_parallel,
            reshard_after_forward=reshard,
        )


def parse_layouts(text: str) -> list[tuple[int, int]]:
    """``"2x1,4x1"`` -> ``[(2, 1), (4, 1)]``: ``w x d`` per layout, ``w >= 2`` (nothing to shard at 1)."""
    layouts = []
    for item in text.split(","):
        w, _, d = item.strip().partition("x")
        if not (w.isdigit() and d.isdigit()) or int(w) < 2 or int(d) < 1:
            raise argparse.ArgumentTypeError(f"layout {item!r} is not WxD with W >= 2 and D >= 1")
        layouts.append((int(w), int(d)))
    return layouts


def check_workload(work: Workload, layouts: Sequence[tuple[int, int]]) -> None:
    """Refuse a workload some layout cannot run: every replica needs whole microbatches, every stage a block.

    Raises:
        ValueError: naming the layout and what it lacks.
    """
    for w, d in layouts:
        if work.global_batch % (w * work.microbatches):
            raise ValueError(f"global batch {work.global_batch} is not {w} replicas x {work.microbatches} microbatches")
        if work.blocks < d:
            raise ValueError(f"{work.blocks} blocks cannot fill {d} stages")


def microbatch_sizes(work: Workload, layouts: Sequence[tuple[int, int]]) -> list[int]:
    """The sizes to profile at: every layout's microbatch size, and twice the largest if only one
    (the profile fits bytes and times as functions of the size: it needs two)."""
    sizes = sorted({work.microbatch_size(w) for w, _ in layouts})
    return sizes if len(sizes) > 1 else [sizes[0], 2 * sizes[0]]


def state_bytes(params: Sequence[Tensor], opt: torch.optim.Optimizer) -> int:
    """Bytes a rank keeps between steps: its weights, their reduced gradients (one per weight, as
    its shard under FSDP) and the optimizer's state (a DTensor's by its local shard)."""
    weights = sum(local(p).nbytes for p in params)
    moments = sum(local(v).nbytes for st in opt.state.values() for v in st.values() if isinstance(v, Tensor))
    return 2 * weights + moments


def _timed(engine: Any, opt: Any, batch: Any, steps: int) -> float:
    """Seconds per step after a barrier and one untimed step: the slowest rank's mean of ``steps``."""
    dist.barrier()
    engine.train_step(batch, opt)
    start = time.perf_counter()
    for _ in range(steps):
        engine.train_step(batch, opt)
    seconds = torch.tensor((time.perf_counter() - start) / steps, dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return seconds.item()


def _worker(rank: int, world: int, work: Workload, depth: int, rounds: int, steps: int) -> dict:
    """Each round places every contender afresh in a rotated order, then times each in that order;
    after the last, one tracked step of each (its peak tensor bytes) and its kept state bytes."""
    torch.set_num_threads(1)
    width = world // depth
    names = list(CONTENDERS)
    times: dict[str, list[float]] = {n: [] for n in names}
    peaks: dict[str, int] = {}
    state: dict[str, int] = {}
    stage = 0
    progress = tqdm(total=rounds * len(names), desc=f"w={width} d={depth}", disable=rank != 0, file=sys.stderr)
    for r in range(rounds):
        shift = r % len(names)
        order = names[shift:] + names[:shift]
        placed = {}
        for name in order:
            plan = work.plan(width, depth, name)
            torch.manual_seed(0)
            groups = PipelineGroups.build(plan.topology, rank)
            engine = place(WideMLP(work.blocks, work.width), plan, rank, groups=groups)
            batch = make_batch(work.global_batch // width, work.width, seed=plan.topology.replica_of(rank))
            placed[name] = (engine, adamw(engine.parameters()), batch, groups)
            stage = engine.stage_index
        for name in order:
            engine, opt, batch, _ = placed[name]
            times[name].append(_timed(engine, opt, batch, steps))
            progress.set_postfix_str(f"round {r + 1}: {name} {times[name][-1]:.3f} s/step")
            progress.update()
        if r == rounds - 1:
            for name in order:
                engine, opt, batch, _ = placed[name]
                dist.barrier()
                with PeakTensorBytes(held_tensors(engine.parameters(), [opt]) + list(batch)) as tracker:
                    engine.train_step(batch, opt)
                peaks[name] = tracker.peak
                state[name] = state_bytes(engine.parameters(), opt)
        for engine, _, _, groups in placed.values():
            engine.close()
        dist.barrier()
        for _, _, _, groups in placed.values():
            groups.destroy()
        del placed
        gc.collect()
    progress.close()
    return {"stage": stage, "times": times, "peaks": peaks, "state": state}


def run_layout(work: Workload, profile: Profile, width: int, depth: int, rounds: int, steps: int) -> list[dict]:
    """Run the three contenders at ``(width, depth)``; one row per contender, per-rank lists inside."""
    out = run_gloo(_worker, width * depth, work, depth, rounds, steps, timeout=3600, pg_timeout=600)
    if any(status != "ok" for status, _ in out):
        raise RuntimeError("\n".join(str(v) for s, v in out if s != "ok"))
    ranks = [value for _, value in out]
    b = work.microbatch_size(width)
    rows = []
    for name in CONTENDERS:
        predicted = predict.predict(profile, work.plan(width, depth, name), b).stage_memory
        rows.append(
            {
                "layout": (width, depth),
                "name": name,
                "rounds": ranks[0]["times"][name],
                "stages": [r["stage"] for r in ranks],
                "peaks": [r["peaks"][name] for r in ranks],
                "predicted": [predicted[r["stage"]] for r in ranks],
                "state": [r["state"][name] for r in ranks],
            }
        )
    return rows


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.2f}"


def step_table(rows: Sequence[dict]) -> str:
    """Per layout and contender: median seconds per step over the rounds, and the median over
    rounds of its step over DDP's of the same round."""
    body = []
    for row in rows:
        ddp = next(r for r in rows if r["layout"] == row["layout"] and r["name"] == "ddp")
        ratios = [mine / theirs for mine, theirs in zip(row["rounds"], ddp["rounds"])]
        w, d = row["layout"]
        body.append(
            [
                f"({w}, {d})",
                row["name"],
                f"{statistics.median(row['rounds']):.4f}",
                f"{statistics.median(ratios):.3f}",
                " ".join(f"{t:.4f}" for t in row["rounds"]),
            ]
        )
    return markdown_table(["(w, d)", "replicas", "s/step (median)", "step / DDP's", "s/step per round"], body)


def memory_table(rows: Sequence[dict]) -> str:
    """Per layout, contender and rank: tracked peak, its ratio to DDP's on that rank, the memory
    model's prediction over it, and the kept state (weights, reduced gradients, AdamW state)."""
    body = []
    for row in rows:
        ddp = next(r for r in rows if r["layout"] == row["layout"] and r["name"] == "ddp")
        w, d = row["layout"]
        for rank, stage in enumerate(row["stages"]):
            peak, state = row["peaks"][rank], row["state"][rank]
            body.append(
                [
                    f"({w}, {d})",
                    row["name"],
                    rank,
                    stage,
                    _mb(peak),
                    f"{peak / ddp['peaks'][rank]:.3f}",
                    _mb(row["predicted"][rank]),
                    f"{row['predicted'][rank] / peak:.3f}",
                    _mb(state),
                    f"{state / ddp['state'][rank]:.3f}",
                ]
            )
    header = [
        "(w, d)",
        "replicas",
        "rank",
        "stage",
        "peak MB",
        "peak / DDP's",
        "predicted MB",
        "predicted / peak",
        "state MB",
        "state / DDP's",
    ]
    return markdown_table(header, body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", type=parse_layouts, default=list(LAYOUTS), help="WxD,... (default 2x1,4x1,2x2)")
    parser.add_argument("--blocks", type=int, default=8, help="MLP blocks in the chain")
    parser.add_argument("--width", type=int, default=512, help="features of every block")
    parser.add_argument("--global-batch", type=int, default=32, help="samples per step, over all replicas")
    parser.add_argument("--microbatches", type=int, default=4, help="microbatches per replica and step")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the three contenders per layout")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per contender and round")
    add_page_flag(parser)
    args = parser.parse_args()
    work = Workload(args.blocks, args.width, args.global_batch, args.microbatches)
    check_workload(work, args.layouts)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = WideMLP(work.blocks, work.width)
    sizes = microbatch_sizes(work, args.layouts)
    profile = profile_blocks(model, make_batch(max(sizes), work.width), sizes, repeats=1, optimizer=adamw)
    rows = []
    for w, d in args.layouts:
        rows += run_layout(work, profile, w, d, args.rounds, args.steps)
    steps, memory = step_table(rows), memory_table(rows)
    print(steps, memory, sep="\n\n")
    if args.no_page:
        return
    parameters = sum(p.numel() for p in model.parameters())
    intro = (
        __doc__.split("\n\n", 2)[2].replace("\nRank 0 shows progress (one tick per timed contender).", "")
        + f"\n\nHere: {work.blocks} blocks of width {work.width} ({parameters / 1e6:.2f}M parameters),"
        f" global batch {work.global_batch} in {work.microbatches} microbatches per replica, {SCHEDULE},"
        f" {args.rounds} rounds of {args.steps} timed steps."
    )
    sections = [("Step time", steps), ("Peak tensor memory per rank", memory)]
    path = write_page("bench_fsdp", "FSDP replicas against DDP replicas", command_line(), sections, intro)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
