"""Benchmark the replica all-reduce: one blocking all-reduce after the backward vs buckets posted during it.

    python benchmarks/bench_allreduce_overlap.py [--rounds 5] [--steps 4]   # writes its docs/results page
    python benchmarks/bench_allreduce_overlap.py --rounds 2 --no-page      # a quick check

w = 2 replicas of a d = 2 pipeline on 4 gloo processes, 1F1B, a cost-model chain whose blocks
sleep in forward, input-gradient and weight-gradient (so 4 processes share 2 cores without the
cores setting the time) and hold real gradients (``--dim`` floats a block). Both variants run in
every round, in alternating order, on the same processes. The all-reduce time each variant
leaves exposed is read from the executor's trace: the seconds of each AR action (with buckets,
only the wait for the buckets not finished yet).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]  # lightning_pipe, benchmarks, gpt

from benchmarks.results_page import add_page_flag, command_line, markdown_table, write_page
from benchmarks.sleep_chain import SleepChain
from lightning_pipe import PipelineGroups, PipelinePlan, Topology, place
from lightning_pipe.runtime.spawn import run_gloo
from lightning_pipe.schedules import Kind

WIDTH, DEPTH = 2, 2


def _worker(rank: int, world: int, blocks: int, dim: int, costs: tuple, m: int, steps: int, rounds: int) -> dict:
    import torch.distributed as dist

    torch.set_num_threads(1)
    topo = Topology(world, DEPTH)
    groups = PipelineGroups.build(topo, rank)
    plan = PipelinePlan(WIDTH, DEPTH, m, "1f1b", partition="uniform")
    variants = {"blocking": 0, "buckets": dim * 4}  # one bucket per block
    engines, opts = {}, {}
    for name, bucket_bytes in variants.items():
        torch.manual_seed(0)
        engines[name] = place(
            SleepChain(DEPTH, blocks, costs, dim), plan, rank, groups=groups, bucket_bytes=bucket_bytes
        )
        engines[name].instrument = True
        opts[name] = torch.optim.SGD(engines[name].stage.parameters(), lr=1e-3)
    batch = torch.ones(m, dim)
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    steps_s: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(rounds):
        for name in variants if r % 2 == 0 else reversed(list(variants)):
            for step in range(steps + 1):
                dist.barrier()
                start = time.perf_counter()
                engines[name].train_step(batch, opts[name])
                elapsed = time.perf_counter() - start
                if step:  # the first step of a round warms up
                    steps_s[name].append(elapsed)
                    seconds[name] += [
                        i.end - i.start for i in engines[name].trace.intervals if i.action.kind is Kind.ALL_REDUCE
                    ]
        if rank == 0:
            print(f"round {r + 1}/{rounds} done", flush=True)
    return {"stage": topo.stage_of(rank), "ar": seconds, "step": steps_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=16, help="blocks per stage")
    parser.add_argument("--dim", type=int, default=2**18, help="floats per block's weight (1 MiB)")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--cost-ms", type=float, default=5.0, help="sleep of F, I and W per block")
    add_page_flag(parser)
    args = parser.parse_args()
    costs = (args.cost_ms / 1e3,) * 3
    results = run_gloo(
        _worker,
        WIDTH * DEPTH,
        args.blocks,
        args.dim,
        costs,
        args.microbatches,
        args.steps,
        args.rounds,
        timeout=1800,
        pg_timeout=300,
    )
    bad = [value for status, value in results if status != "ok"]
    if bad:
        raise SystemExit(f"a worker failed:\n{bad[0]}")
    grads_mib = args.blocks * args.dim * 4 / 2**20
    setup = (
        f"w={WIDTH} x d={DEPTH}, 1F1B m={args.microbatches}, {args.blocks} blocks a stage, {grads_mib:.0f} MiB of "
        f"gradients a stage, F = I = W = {args.cost_ms:g} ms a block; {args.rounds} rounds x {args.steps} steps"
    )
    rows = []
    for stage in range(DEPTH):
        mine = [value for _, value in results if value["stage"] == stage]
        ar = {k: statistics.median(x for v in mine for x in v["ar"][k]) for k in ("blocking", "buckets")}
        step = {k: statistics.median(x for v in mine for x in v["step"][k]) for k in ("blocking", "buckets")}
        rows.append(
            [
                stage,
                f"{ar['blocking'] * 1e3:.2f}",
                f"{ar['buckets'] * 1e3:.2f}",
                f"{1 - ar['buckets'] / ar['blocking']:.1%}",
                f"{step['blocking']:.4f}",
                f"{step['buckets']:.4f}",
            ]
        )
    table = markdown_table(
        [
            "stage",
            "blocking AR (ms, median)",
            "bucketed AR (ms, median)",
            "hidden",
            "step blocking (s)",
            "step bucketed (s)",
        ],
        rows,
    )
    print(f"\n{setup}\n\n{table}")
    if not args.no_page:
        intro = (
            "Two replicas of a two-stage 1F1B pipeline (4 gloo processes) of sleeping blocks holding real gradients. "
            "Blocking: one all-reduce of the stage's gradients after the backward. Buckets: one bucket per block, "
            "posted as its weight gradient is done, so the all-reduce runs during the rest of the backward. The AR "
            "columns are the seconds of each step's all-reduce action in the executor's trace (with buckets, the wait "
            "for those not finished yet), median over every timed step of both replicas; hidden = 1 - bucketed / "
            "blocking."
        )
        sections = [("Exposed all-reduce time per stage", f"{setup}.\n\n{table}")]
        path = write_page(
            "bench_allreduce_overlap",
            "Replica all-reduce: blocking vs buckets overlapped with the backward",
            command_line(),
            sections,
            intro,
        )
        print(f"page: {path}")


if __name__ == "__main__":
    main()
