"""Planner fidelity: predicted step time and peak tensor memory per stage against measured runs, one table.

    python examples/bench_planner.py            # about 3 minutes on 2 cores

Workload: a chain of 8 blocks that sleep in forward and backward for a set time per sample
(so 4 processes fit on 2 cores and the schedule, not the cores, sets the time) and keep a
real activation tensor for their backward (so memory is real). The planner profiles the chain
in this process and measures the links once, then predicts every configuration; each
configuration then runs for real (gloo processes, ``place`` engines) and is measured: the
median step time, and the peak tensor bytes of each stage during one step by a tracker of
every tensor storage created (independent of the planner's own accounting).
"""

from __future__ import annotations

import datetime
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_pipelines import PeakTensorBytes  # noqa: E402
from lightning_pipe import PipelineGroups, PipelinePlan, place, planner  # noqa: E402
from lightning_pipe.monitor import held_tensors  # noqa: E402
from lightning_pipe.profiler import profile_blocks, profile_links  # noqa: E402
from lightning_pipe.spawn import run_gloo  # noqa: E402

BLOCKS, DIM, ACT = 8, 64, 4096  # ACT floats per sample kept by every block for its backward
FORWARD, BACKWARD = 0.002, 0.004  # seconds per sample
GLOBAL_BATCH = 16

#: (w, d, b, schedule, recompute): w * d <= 4 processes, m = 16 / (w * b).
CONFIGS = [
    (1, 2, 2, "1f1b", False), (1, 2, 4, "1f1b", False), (1, 2, 2, "gpipe", False), (1, 2, 2, "1f1b", True),
    (2, 1, 2, "1f1b", False), (2, 1, 4, "gpipe", False), (1, 4, 1, "1f1b", False), (1, 4, 2, "1f1b", False),
    (1, 4, 2, "gpipe", True), (2, 2, 2, "1f1b", False), (2, 2, 2, "gpipe", False), (2, 2, 4, "1f1b", True),
    (4, 1, 2, "1f1b", False), (4, 1, 4, "gpipe", True),
]  # fmt: skip


class _Hold(torch.autograd.Function):
    """``x * w`` that keeps ``held`` (the block's activation) and sleeps in backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, held: Tensor, seconds: float) -> Tensor:
        ctx.save_for_backward(x, w, held)
        ctx.seconds = seconds
        return x * w

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:
        time.sleep(ctx.seconds)
        x, w, _ = ctx.saved_tensors
        return grad * w, (grad * x).sum(0), None, None


class HoldBlock(nn.Module):
    """Sleeps ``FORWARD`` per sample, keeps ``ACT`` floats per sample until backward, which sleeps ``BACKWARD`` per sample."""

    def __init__(self, act: int = ACT) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(DIM))
        self.act = act

    def forward(self, x: Tensor) -> Tensor:
        n = x.shape[0]
        time.sleep(FORWARD * n)
        return _Hold.apply(x, self.w, torch.zeros(n, self.act), BACKWARD * n)


class HoldChain(nn.Module):
    """The chain, with the pipeline hooks of PipelineMixin; ``heavy_first``: block 0 keeps 8x the activations."""

    def __init__(self, heavy_first: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(HoldBlock(8 * ACT if i == 0 and heavy_first else ACT) for i in range(BLOCKS))

    def pipeline_blocks(self) -> list[nn.Module]:
        return list(self.blocks)

    def pipeline_inputs(self, batch: Tensor) -> Tensor:
        return batch

    def pipeline_loss(self, output: Tensor, batch: Tensor) -> Tensor:
        return output.pow(2).mean()


def _plan(config: tuple, partition: tuple[int, ...]) -> PipelinePlan:
    w, d, b, schedule, recompute = config
    return PipelinePlan(w, d, GLOBAL_BATCH // (w * b), schedule, partition=partition, recompute=recompute)


def _measure(rank: int, world: int, plan: PipelinePlan, b: int, steps: int, heavy_first: bool = False) -> dict[str, Any]:
    """One configuration on this rank: median step seconds and peak tensor bytes of one step."""
    torch.set_num_threads(1)
    groups = PipelineGroups.build(plan.topology, rank)
    model = HoldChain(heavy_first)
    engine = place(model, plan, rank, groups=groups)
    opt = torch.optim.Adam(engine.stage.parameters(), lr=1e-3)
    batch = torch.randn(plan.microbatches * b, DIM)
    times = []
    for _ in range(steps + 1):
        dist.barrier()
        start = time.perf_counter()
        engine.train_step(batch, opt)
        times.append(time.perf_counter() - start)
    for p in engine.stage.parameters():
        p.grad = None  # the step creates them again, tracked
    dist.barrier()
    with PeakTensorBytes(held_tensors(engine.stage.parameters(), [opt])) as tracker:
        engine.train_step(batch, opt)
    return {"step": statistics.median(times[1:]), "peak": tracker.peak, "stage": engine.stage_index}


def main() -> None:
    print(f"{datetime.date.today()} on {platform.node()}, torch {torch.__version__}", flush=True)
    model = HoldChain()
    sizes = sorted({c[2] for c in CONFIGS})
    profile = profile_blocks(model, torch.randn(max(sizes), DIM), [min(sizes), max(sizes)], repeats=3)
    profile.__dict__.update(profile_links(world=2))
    rows, time_errors, memory_errors, results = [], [], [], []
    for i, config in enumerate(CONFIGS):
        w, d, b, schedule, recompute = config
        plan = _plan(config, planner.time_balanced(profile, d, b))
        predicted = planner.predict(profile, plan, b)
        out = run_gloo(_measure, w * d, plan, b, 4, timeout=300.0)
        assert all(s == "ok" for s, _ in out), [v for s, v in out if s != "ok"]
        measured = [v for _, v in out]
        step = max(v["step"] for v in measured)
        peaks = [max(v["peak"] for v in measured if v["stage"] == s) for s in range(d)]
        t_err = predicted.step_time / step - 1
        m_err = max(abs(p / q - 1) for p, q in zip(predicted.stage_memory, peaks))
        time_errors.append(abs(t_err))
        results.append({"config": (w, d), "predicted": predicted, "measured": step, "peaks": peaks})
        memory_errors.append(m_err)
        rows.append(f"| ({w},{d}) | {b} | {plan.microbatches} | {schedule} | {'yes' if recompute else 'no'} | "
                    f"{predicted.step_time:.3f} | {step:.3f} | {t_err:+.1%} | "
                    f"{', '.join(f'{p / 2**20:.2f}' for p in predicted.stage_memory)} | "
                    f"{', '.join(f'{q / 2**20:.2f}' for q in peaks)} | {m_err:.1%} |")  # fmt: skip
        print(f"[{i + 1}/{len(CONFIGS)}] {rows[-1]}", flush=True)
    print("\n| (w,d) | b | m | schedule | recompute | predicted step (s) | measured step (s) | time error | "
          "predicted peak per stage (MiB) | measured peak per stage (MiB) | worst memory error |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print(f"\nstep time error: median {statistics.median(time_errors):.1%}, worst {max(time_errors):.1%}; "
          f"peak memory error: median {statistics.median(memory_errors):.1%}, worst {max(memory_errors):.1%}")
    _ranking(results)
    _verdicts(results)
    _madpipe_order(profile)


def _ranking(results: list[dict[str, Any]]) -> None:
    """The planner's first choice among the 4-process configurations against the best measured one."""
    four = [r for r in results if r["config"][0] * r["config"][1] == 4]
    chosen = min(four, key=lambda r: r["predicted"].step_time)  # same global batch: shortest step is fastest
    best = min(four, key=lambda r: r["measured"])
    print(f"\nranking (4 processes, {len(four)} configurations): planner's first choice {chosen['config']} measured "
          f"{chosen['measured']:.3f} s; best measured {best['config']} {best['measured']:.3f} s; "
          f"ratio {chosen['measured'] / best['measured']:.3f}")


def _verdicts(results: list[dict[str, Any]]) -> None:
    """With a budget at the median measured peak: does 'feasible' agree with the measured peak?"""
    budget = statistics.median(max(r["peaks"]) for r in results)
    agree = sum((max(r["predicted"].stage_memory) <= budget) == (max(r["peaks"]) <= budget) for r in results)
    print(f"memory verdicts at a budget of {budget / 2**20:.3f} MiB (the median measured peak): {agree} of {len(results)} agree")


def _madpipe_order(profile: Any) -> None:
    """A chain whose first block keeps 8x the activations: time-balanced vs memory-aware partition, measured."""
    from lightning_pipe.madpipe import madpipe_partition

    heavy = profile_blocks(HoldChain(heavy_first=True), torch.randn(2, DIM), [1, 2], repeats=2)
    heavy.__dict__.update({k: getattr(profile, k) for k in ("link_latency", "link_bandwidth", "allreduce_bandwidth")})
    plan = PipelinePlan(1, 4, 8, "1f1b", partition=planner.time_balanced(heavy, 4, 2))
    balanced = planner.predict(heavy, plan, 2)
    limit = 0.9 * max(balanced.stage_memory)  # the time-balanced split does not fit
    found = madpipe_partition(heavy, plan, 2, limit)
    assert found is not None, "no memory-aware partition fits"
    aware = planner.predict(heavy, plan.replace(partition=found.sizes), 2)
    rows = []
    for name, predicted in (("time-balanced", balanced), ("memory-aware", aware)):
        out = run_gloo(_measure, 4, predicted.plan, 2, 4, True, timeout=300.0)
        assert all(s == "ok" for s, _ in out), [v for s, v in out if s != "ok"]
        peaks = [max(v["peak"] for _, v in out if v["stage"] == s) for s in range(4)]
        rows.append((name, predicted, max(v["step"] for _, v in out), max(peaks)))
    print(f"\nMadPipe case (block 0 keeps 8x the activations; budget {limit / 2**20:.3f} MiB):")
    for name, predicted, step, peak in rows:
        print(f"  {name} {list(predicted.plan.partition)}: predicted {predicted.step_time:.3f} s, peak "
              f"{max(predicted.stage_memory) / 2**20:.3f} MiB; measured {step:.3f} s, peak {peak / 2**20:.3f} MiB, "
              f"fits: {peak <= limit}")
    same = (rows[0][1].step_time < rows[1][1].step_time) == (rows[0][2] < rows[1][2])
    print(f"  measured order of step times matches the predicted one: {same}")


if __name__ == "__main__":
    main()
