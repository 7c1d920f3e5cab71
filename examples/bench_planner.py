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

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(DIM))

    def forward(self, x: Tensor) -> Tensor:
        n = x.shape[0]
        time.sleep(FORWARD * n)
        return _Hold.apply(x, self.w, torch.zeros(n, ACT), BACKWARD * n)


class HoldChain(nn.Module):
    """The chain, with the pipeline hooks of PipelineMixin."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(HoldBlock() for _ in range(BLOCKS))

    def pipeline_blocks(self) -> list[nn.Module]:
        return list(self.blocks)

    def pipeline_inputs(self, batch: Tensor) -> Tensor:
        return batch

    def pipeline_loss(self, output: Tensor, batch: Tensor) -> Tensor:
        return output.pow(2).mean()


def _plan(config: tuple, partition: tuple[int, ...]) -> PipelinePlan:
    w, d, b, schedule, recompute = config
    return PipelinePlan(w, d, GLOBAL_BATCH // (w * b), schedule, partition=partition, recompute=recompute)


def _measure(rank: int, world: int, plan: PipelinePlan, b: int, steps: int) -> dict[str, Any]:
    """One configuration on this rank: median step seconds and peak tensor bytes of one step."""
    torch.set_num_threads(1)
    groups = PipelineGroups.build(plan.topology, rank)
    model = HoldChain()
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
    rows, time_errors, memory_errors = [], [], []
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


if __name__ == "__main__":
    main()
