"""Benchmark split backward (2BP): its overhead on a transformer block, and its gain on a pipeline.

    python examples/bench_split_backward.py

1. Overhead: a transformer block's backward done whole vs as I then W, interleaved.
   Seed 001's split must not compute anything twice, so I + W should cost about one backward.
2. Gain: a 4-stage pipeline of blocks that sleep a set time in F, I and W (so 4 processes fit
   on 2 cores and the schedule, not the cores, sets the time), for GPipe and 1F1B with and
   without split, against the simulator's prediction for the same cost model.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pipe import PipelineEngine, Topology
from lightning_pipe.runtime.split import input_grads, weight_grads
from lightning_pipe.schedules import build_schedule
from lightning_pipe.schedules.actions import Action, Kind
from lightning_pipe.simulate import simulate
from lightning_pipe.spawn import run_gloo

DEPTH, BLOCKS_PER_STAGE = 4, 2


def backward_overhead(reps: int, dim: int, seq: int, batch: int, warmup: int = 5) -> list[float]:
    """(I + W time) / (full backward time) for each interleaved repetition after ``warmup``."""
    torch.manual_seed(0)
    block = nn.TransformerEncoderLayer(dim, 8, 4 * dim, dropout=0.0, batch_first=True)
    x = torch.randn(batch, seq, dim)
    ratios = []
    for _ in range(reps):
        times = []
        for split in (False, True):
            inp = x.clone().requires_grad_()
            out = block(inp)
            grad = torch.ones_like(out)
            start = time.perf_counter()
            if split:
                _, work = input_grads([out], [grad], [inp])
                weight_grads(work)
            else:
                out.backward(grad)
            times.append(time.perf_counter() - start)
            block.zero_grad()
        ratios.append(times[1] / times[0])
    return ratios[warmup:]


class _SleepInBackward(torch.autograd.Function):
    """Identity whose backward sleeps: put on the input path it costs I, on the weight path W.
    Plain ops around it (the multiply) let autograd run each path only when it is needed."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, seconds: float) -> Tensor:
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        time.sleep(ctx.seconds)
        return grad, None


class SleepBlock(nn.Module):
    """``x * w`` whose forward, input-gradient and weight-gradient take set times."""

    def __init__(self, dim: int, costs: tuple[float, float, float]) -> None:
        super().__init__()
        self.w, self.costs = nn.Parameter(torch.ones(dim)), costs

    def forward(self, x: Tensor) -> Tensor:
        forward, input_grad, weight_grad = self.costs
        time.sleep(forward)
        return _SleepInBackward.apply(x, input_grad) * _SleepInBackward.apply(self.w, weight_grad)


class SleepChain(nn.Module):
    """DEPTH * BLOCKS_PER_STAGE sleeping blocks with a mean-square loss."""

    def __init__(self, costs: tuple[float, float, float], dim: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(SleepBlock(dim, costs) for _ in range(DEPTH * BLOCKS_PER_STAGE))

    def pipeline_blocks(self) -> list[nn.Module]:
        return list(self.blocks)

    def pipeline_inputs(self, batch: Tensor) -> Tensor:
        return batch

    def pipeline_loss(self, output: Tensor, batch: Tensor) -> Tensor:
        return output.pow(2).mean()


def predicted_cost(costs: tuple[float, float, float]) -> Any:
    """Simulator cost of each action for SleepChain. Stage 0's input needs no gradient, so its
    whole backward (including the input-path part of its later blocks) is weight work."""
    f, i, w = costs
    k = BLOCKS_PER_STAGE

    def cost(a: Action) -> float:
        first = a.stage == 0
        table = {
            Kind.FORWARD: k * f,
            Kind.BACKWARD: (k - first) * i + k * w,
            Kind.INPUT_GRAD: 0.0 if first else k * i,
            Kind.WEIGHT_GRAD: ((k - 1) * i + k * w) if first else k * w,
        }
        return table.get(a.kind, 0.0)

    return cost


def _pipeline_worker(rank: int, world: int, configs: list, costs: tuple, steps: int, rounds: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "pp"))
    engines = {}
    for schedule, m, split in configs:
        model = SleepChain(costs)
        engines[(schedule, m, split)] = (PipelineEngine(model, Topology(world, world), rank, schedule, m, "uniform",
                                                        mesh=mesh, split_backward=split),
                                         torch.optim.SGD(model.parameters(), lr=0.0))  # fmt: skip
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
            sim = {split: simulate(build_schedule(schedule, DEPTH, m, split=split), predicted_cost(costs)).makespan for split in (False, True)}
            meas = {split: measured[(schedule, m, split)] for split in (False, True)}
            rows.append({"schedule": schedule, "m": m, "measured": meas, "simulated": sim})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--cost-ms", type=float, default=20.0, help="sleep of each F, I and W per block")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print("## Split backward overhead: TransformerEncoderLayer, 8 x 128 tokens, CPU\n")
    print("| d_model | median (I + W) / full backward | min | max | pairs |\n|---|---|---|---|---|")
    for dim in (256, 512):
        ratios = backward_overhead(args.reps + 5, dim=dim, seq=128, batch=8)
        print(f"| {dim} | {statistics.median(ratios):.3f} | {min(ratios):.3f} | {max(ratios):.3f} | "
              f"{len(ratios)} interleaved, after 5 warm-up |")  # fmt: skip
    print()
    costs = (args.cost_ms / 1000,) * 3
    print(f"## Split backward gain, cost-model chain: d={DEPTH}, {BLOCKS_PER_STAGE} blocks/stage, "
          f"F = I = W = {args.cost_ms:g} ms per block\n")  # fmt: skip
    print("| schedule | m | step without split (s) | step with split (s) | measured gain | simulated gain | gain ratio | measured / simulated step (no split, split) |")
    print("|---|---|---|---|---|---|---|---|")
    for row in pipeline_gain(costs, args.steps, args.rounds):
        meas, sim = row["measured"], row["simulated"]
        gain, pred = meas[False] / meas[True], sim[False] / sim[True]
        print(f"| {row['schedule']} | {row['m']} | {meas[False]:.3f} | {meas[True]:.3f} | {gain:.3f} | {pred:.3f} | "
              f"{gain / pred:.3f} | {meas[False] / sim[False]:.3f}, {meas[True] / sim[True]:.3f} |")  # fmt: skip


if __name__ == "__main__":
    main()
