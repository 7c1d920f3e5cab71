"""Benchmark split backward (2BP): its overhead on a transformer block, and its gain on a pipeline.

    python benchmarks/bench_split_backward.py                       # writes docs/results/bench_split_backward.md
    python benchmarks/bench_split_backward.py --reps 10 --rounds 1 --no-page   # a quick check

1. Overhead: a GPT block's and a convolutional residual block's backward done whole vs as I
   then W, interleaved; W from the deferred linear and convolution calls (the runtime's split on
   such blocks) and from autograd (its split elsewhere). The split must not compute anything
   twice, so I + W should cost about one backward.
2. Gain: a 4-stage pipeline of blocks that sleep a set time in F, I and W (so 4 processes fit
   on 2 cores and the schedule, not the cores, sets the time), for GPipe and 1F1B with and
   without split, against the simulator's prediction for the same cost model.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]  # lightning_pipe, benchmarks, gpt

import gpt  # noqa: E402
from gpt import Block  # noqa: E402

from benchmarks.results_page import add_page_flag, command_line, markdown_table, write_page
from benchmarks.sleep_chain import SleepChain
from lightning_pipe import PipelineGroups, PipelinePlan, Topology, place
from lightning_pipe.runtime.autograd.backward_split import input_grads, weight_grads
from lightning_pipe.runtime.autograd.deferred_weights import DeferredGrads, DeferWeightGrads
from lightning_pipe.runtime.spawn import run_gloo
from lightning_pipe.schedules import build_schedule
from lightning_pipe.schedules.simulate import simulate

DEPTH, BLOCKS_PER_STAGE = 4, 2


class ConvBlock(nn.Module):
    """A ResNet basic block: two 3x3 convolutions with batch norms, and the residual."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.c1, self.n1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)
        self.c2, self.n2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``relu(x + n2(c2(relu(n1(c1(x))))))``."""
        return torch.relu(x + self.n2(self.c2(torch.relu(self.n1(self.c1(x))))))


def _backward_seconds(block: nn.Module, x: torch.Tensor, mode: str) -> tuple[float, int]:
    """One backward of ``block`` on ``x``, whole or split (``mode``): its seconds and the minor page faults it took."""
    inp = x.clone().requires_grad_()
    store = DeferredGrads(list(block.parameters())) if mode == "deferred" else None
    with DeferWeightGrads(store) if store is not None else nullcontext():
        out = block(inp)
    grad = torch.ones_like(out)
    faults, start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
    if mode == "whole":
        out.backward(grad)
    else:
        _, work = input_grads([out], [grad], [inp], store)
        weight_grads(work)
    seconds = time.perf_counter() - start
    block.zero_grad()
    return seconds, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults


def backward_overhead(
    block: nn.Module, x: torch.Tensor, reps: int, warmup: int = 5
) -> dict[str, list[tuple[float, int]]]:
    """Per split mode (linear and convolution weight gradients ``"deferred"``, or the ``"autograd"``
    split): (I + W time) / (full backward time) of ``block`` on ``x``, and the split's page faults,
    for each interleaved repetition after ``warmup``."""
    ratios: dict[str, list[tuple[float, int]]] = {"deferred": [], "autograd": []}
    for _ in range(reps):
        whole, _ = _backward_seconds(block, x, "whole")
        for mode in ratios:
            seconds, faults = _backward_seconds(block, x, mode)
            ratios[mode].append((seconds / whole, faults))
    return {mode: r[warmup:] for mode, r in ratios.items()}


def _pipeline_worker(rank: int, world: int, configs: list, costs: tuple, steps: int, rounds: int) -> dict:
    import torch.distributed as dist

    groups = PipelineGroups.build(Topology(world, world), rank)
    engines = {}
    for schedule, m, split in configs:
        model = SleepChain(DEPTH, BLOCKS_PER_STAGE, costs)
        engines[(schedule, m, split)] = (
            place(model, PipelinePlan(1, world, m, schedule, split, partition="uniform"), rank, groups=groups),
            torch.optim.SGD(model.parameters(), lr=0.0),
        )
    times: dict = {c: [] for c in configs}
    for _ in range(rounds):  # interleaved, so drift hits every configuration alike
        for config in configs:
            engine, opt = engines[config]
            batch = torch.randn(8 * config[1], 16)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                engine.train_step(batch, opt)
            dist.barrier()
            times[config].append((time.perf_counter() - start) / steps)
    return {c: statistics.median(t) for c, t in times.items()}


def pipeline_gain(costs: tuple[float, float, float], steps: int, rounds: int) -> list[dict]:
    """Measured and simulated split-backward gain for GPipe and 1F1B at m = d and m = 2d."""
    configs = [(s, m, split) for s in ("gpipe", "1f1b") for m in (DEPTH, 2 * DEPTH) for split in (False, True)]
    out = run_gloo(_pipeline_worker, DEPTH, configs, costs, steps, rounds, timeout=900)
    if any(status != "ok" for status, _ in out):
        raise RuntimeError([v for s, v in out if s != "ok"])
    measured = out[0][1]
    rows = []
    for schedule in ("gpipe", "1f1b"):
        for m in (DEPTH, 2 * DEPTH):
            sim = {
                split: simulate(
                    build_schedule(schedule, DEPTH, m, split=split),
                    SleepChain(DEPTH, BLOCKS_PER_STAGE, costs).predicted_cost(),
                ).makespan
                for split in (False, True)
            }
            meas = {split: measured[(schedule, m, split)] for split in (False, True)}
            rows.append({"schedule": schedule, "m": m, "measured": meas, "simulated": sim})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=30, help="interleaved repetitions per block, after 5 warm-up")
    parser.add_argument("--cost-ms", type=float, default=20.0, help="sleep of each F, I and W per block")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--overhead-only", action="store_true", help="measure the overhead, not the pipeline gain")
    add_page_flag(parser)
    args = parser.parse_args()
    sections = []
    heading = (
        f"Split backward overhead: a GPT block ({Path(gpt.__file__).name}, 8 x 128 tokens) and a "
        "convolutional residual block (8 x 64 channels x 32 x 32)"
    )
    torch.manual_seed(0)
    blocks = [(f"GPT, d_model {dim}", Block(dim, 8), torch.randn(8, 128, dim)) for dim in (256, 512)]
    blocks.append(("ResNet basic, 64 channels", ConvBlock(64), torch.randn(8, 64, 32, 32)))
    rows = []
    for name, block, x in blocks:
        for mode, reps in backward_overhead(block, x, args.reps + 5).items():
            ratios = [r for r, _ in reps]
            rows.append(
                [
                    name,
                    mode,
                    f"{statistics.median(ratios):.3f}",
                    f"{min(ratios):.3f}",
                    f"{max(ratios):.3f}",
                    f"{statistics.median(f for _, f in reps):.0f}",
                    f"{len(ratios)} interleaved, after 5 warm-up",
                ]
            )
    sections.append(
        (
            heading,
            markdown_table(
                [
                    "block",
                    "split",
                    "median (I + W) / full backward",
                    "min",
                    "max",
                    "minor page faults per split backward",
                    "pairs",
                ],
                rows,
            ),
        )
    )
    print(f"## {sections[-1][0]}\n\n{sections[-1][1]}\n", flush=True)
    if not args.overhead_only:
        costs = (args.cost_ms / 1000,) * 3
        heading = (
            f"Split backward gain, cost-model chain: d={DEPTH}, {BLOCKS_PER_STAGE} blocks/stage, "
            f"F = I = W = {args.cost_ms:g} ms per block"
        )
        rows = []
        for row in pipeline_gain(costs, args.steps, args.rounds):
            meas, sim = row["measured"], row["simulated"]
            gain, pred = meas[False] / meas[True], sim[False] / sim[True]
            rows.append(
                [
                    row["schedule"],
                    row["m"],
                    f"{meas[False]:.3f}",
                    f"{meas[True]:.3f}",
                    f"{gain:.3f}",
                    f"{pred:.3f}",
                    f"{gain / pred:.3f}",
                    f"{meas[False] / sim[False]:.3f}, {meas[True] / sim[True]:.3f}",
                ]
            )
        sections.append(
            (
                heading,
                markdown_table(
                    [
                        "schedule",
                        "m",
                        "step without split (s)",
                        "step with split (s)",
                        "measured gain",
                        "simulated gain",
                        "gain ratio",
                        "measured / simulated step (no split, split)",
                    ],
                    rows,
                ),
            )
        )
        print(f"## {sections[-1][0]}\n\n{sections[-1][1]}\n", flush=True)
    if not args.no_page:
        intro = (
            "Overhead: each block's backward done whole, then split into I and W (from the deferred linear and "
            "convolution calls, and from autograd), interleaved repetition by repetition; a ratio near 1 means the "
            "split computes nothing twice. Gain: a 4-stage pipeline of sleeping blocks (the schedule, not the "
            f"cores, sets the time), median step over {args.rounds} interleaved rounds of {args.steps} steps, "
            "against the simulator's step for the same costs."
        )
        print(f"page: {write_page('bench_split_backward', 'Split backward', command_line(), sections, intro)}")


if __name__ == "__main__":
    main()
