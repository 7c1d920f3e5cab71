"""Planner fidelity: predicted step time and peak tensor memory per stage against measured runs, one table.

    python benchmarks/bench_planner.py                  # 3 rounds, then the planning time; writes the page
    python benchmarks/bench_planner.py --rounds 1       # one round of each workload
    python benchmarks/bench_planner.py --planning-time  # the planning-time part only
    python benchmarks/bench_planner.py --memory-only    # the memory model only
    python benchmarks/bench_planner.py --workload gpt   # one workload's configurations only
    python benchmarks/bench_planner.py --user-path      # the plan command, then Trainer.fit of its top plans

Every mode but ``--user-path`` prints its tables and writes docs/results/bench_planner.md
(``--no-page``: print only); ``--user-path`` writes docs/results/bench_planner_user_path.md
(``--busy``: bench_planner_user_path_busy.md).

``--user-path`` measures the planner as users run it (:mod:`benchmarks.planner_user_path`):
``python -m lightning_pipe.plan`` once per workload and process count, as a subprocess, then,
after it has exited, each of its top plans trained through ``Trainer.fit`` in its own launch,
with ``--busy`` (one core kept busy throughout) and ``--cli-runs N`` (does the first choice hold).
The other modes profile and run side by side in the same processes, seconds apart: a diagnostic
of the cost model that the host's drift cannot blur, not what a user sees.

Workloads:

- ``chain``: 8 blocks that sleep in forward and backward for a set time per sample (so 4
  processes fit on 2 cores and the schedule, not the cores, sets the time) and keep a real
  activation tensor for their backward (so memory is real).
- ``gpt``: the GPT example's model (configs/gpt_1f1b.yaml: 4 layers, width 128, context 64,
  AdamW), real compute, at most 2 processes (one core each).

In each round the planner measures the links, then profiles each group of configurations (a
workload at one process count) in as many concurrent processes. That profile is the planner's
view: it partitions every configuration of the group and predicts its ``planned`` step. The
group then runs side by side in one launch (gloo processes, ``place`` engines): in each pass
every rank profiles the workload again (all at once, one timed run per block and size) and
times one step of every configuration. A configuration's error in a round is the median over
its passes of the step that pass's profile predicts over the step that pass measured (its
slowest rank), less 1: a small shared VM's speed drifts by tens of percent for seconds at a
time (every process at once), so that a profile and a run even seconds apart disagree by that
much whatever the model, while a pass's profile and steps see the same drift. The table gives the medians
over the rounds. Each engine then runs one step
under a tracker of every tensor storage created (independent of the planner's own accounting):
the peak tensor bytes of each stage.

The ranking: the planner's first choice among the configurations with the most processes (the
shortest ``planned`` step, median over rounds) against the fastest of them measured, the ratio
the median over passes of the two configurations' steps in the same pass.

Each configuration also runs 3 steps with the executor's trace on, and the simulator replays
its program with every traced action's median seconds, replica by replica (receives as the link model charges them): a
second table splits each time error into the profile's action costs (predicted / replayed) and
what the simulator misses given the step's own action times (replayed / traced step).
"""

from __future__ import annotations

import functools
import statistics
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]  # lightning_pipe, benchmarks, gpt

from bench_pipelines import PeakTensorBytes  # noqa: E402

from benchmarks.results_page import add_page_flag, command_line, markdown_table, write_page
from lightning_pipe import PipelineGroups, PipelinePlan, place  # noqa: E402
from lightning_pipe.lightning.monitor import held_tensors  # noqa: E402
from lightning_pipe.planning import costs, predict, programs, search  # noqa: E402
from lightning_pipe.planning.links import profile_links  # noqa: E402
from lightning_pipe.planning.profile import mean_profile  # noqa: E402
from lightning_pipe.planning.profiler import profile_blocks, profile_concurrently  # noqa: E402
from lightning_pipe.runtime.spawn import run_gloo  # noqa: E402

BLOCKS, DIM, ACT = 8, 64, 4096  # ACT floats per sample kept by every block for its backward
FORWARD, BACKWARD = 0.002, 0.004  # seconds per sample


class Config(NamedTuple):
    """One measured configuration: chain w * d <= 4 processes, m = 16 / (w * b); gpt w * d <= 2
    processes, m = 32 / (w * b); ``virtual`` stages per rank (above 1: interleaved 1F1B)."""

    workload: str
    w: int
    d: int
    b: int
    schedule: str
    recompute: bool
    virtual: int = 1


CONFIGS = [
    Config(*c)
    for c in [
        ("chain", 1, 2, 2, "1f1b", False),
        ("chain", 1, 2, 4, "1f1b", False),
        ("chain", 1, 2, 2, "gpipe", False),
        ("chain", 1, 2, 2, "1f1b", True),
        ("chain", 2, 1, 2, "1f1b", False),
        ("chain", 2, 1, 4, "gpipe", False),
        ("chain", 1, 4, 1, "1f1b", False),
        ("chain", 1, 4, 2, "1f1b", False),
        ("chain", 1, 4, 2, "gpipe", True),
        ("chain", 2, 2, 2, "1f1b", False),
        ("chain", 2, 2, 2, "gpipe", False),
        ("chain", 2, 2, 4, "1f1b", True),
        ("chain", 4, 1, 2, "1f1b", False),
        ("chain", 4, 1, 4, "gpipe", True),
        ("chain", 1, 2, 2, "1f1b", False, 2),
        ("chain", 1, 4, 2, "1f1b", False, 2),
        ("chain", 2, 2, 2, "1f1b", False, 2),
        ("gpt", 1, 2, 4, "1f1b", False),
        ("gpt", 1, 2, 8, "1f1b", False),
        ("gpt", 1, 2, 8, "gpipe", False),
        ("gpt", 1, 2, 8, "1f1b", True),
        ("gpt", 2, 1, 8, "1f1b", False),
        ("gpt", 2, 1, 16, "gpipe", True),
        ("gpt", 1, 2, 8, "1f1b", False, 2),
    ]
]


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
    """Sleeps ``FORWARD`` per sample, keeps ``ACT`` floats per sample until backward, which sleeps
    ``BACKWARD`` per sample (``sleeps``: False for the memory alone)."""

    def __init__(self, act: int = ACT, sleeps: bool = True) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(DIM))
        self.act, self.sleeps = act, sleeps

    def forward(self, x: Tensor) -> Tensor:
        n = x.shape[0]
        time.sleep(FORWARD * n * self.sleeps)
        return _Hold.apply(x, self.w, torch.zeros(n, self.act), BACKWARD * n * self.sleeps)


class HoldChain(nn.Module):
    """The chain, with the pipeline hooks of PipelineMixin; ``heavy_first``: block 0 keeps 8x the activations."""

    def __init__(self, heavy_first: bool = False, sleeps: bool = True) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            HoldBlock(8 * ACT if i == 0 and heavy_first else ACT, sleeps) for i in range(BLOCKS)
        )

    def pipeline_blocks(self) -> list[nn.Module]:
        return list(self.blocks)

    def pipeline_inputs(self, batch: Tensor) -> Tensor:
        return batch

    def pipeline_loss(self, output: Tensor, batch: Tensor) -> Tensor:
        return output.pow(2).mean()


class Chain:
    """The sleeping chain: global batch 16, Adam."""

    global_batch, sizes = 16, (1, 2, 4)
    passes = 6  # profiles and steps of every configuration per round (a pass of the 4-process group takes about 5 s)

    def model(self, heavy_first: bool = False) -> nn.Module:
        return HoldChain(heavy_first)

    def batch(self, n: int) -> Tensor:
        return torch.randn(n, DIM)

    def optimizer(self, params: Any) -> torch.optim.Optimizer:
        return torch.optim.Adam(params, lr=1e-3)


class GPTWorkload:
    """The GPT example's model and byte windows: global batch 32, AdamW."""

    global_batch, sizes = 32, (4, 8, 16)
    passes = 10  # a pass takes about 2.5 s

    def model(self, heavy_first: bool = False) -> nn.Module:
        from gpt import GPT

        torch.manual_seed(0)
        return GPT(n_layer=4, n_embd=128, n_head=4, block_size=64)

    def batch(self, n: int) -> tuple[Tensor, Tensor]:
        tokens = torch.randint(0, 256, (n, 65))
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def optimizer(self, params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)


WORKLOADS = {"chain": Chain(), "gpt": GPTWorkload()}


def _plan(config: Config, partition: tuple[int, ...]) -> PipelinePlan:
    return PipelinePlan(
        config.w,
        config.d,
        plan_m(config),
        config.schedule,
        partition=partition,
        recompute=config.recompute,
        virtual_stages=config.virtual,
    )


def _measure(
    rank: int, world: int, name: str, plan: PipelinePlan, b: int, steps: int, heavy_first: bool = False
) -> dict[str, Any]:
    """One configuration on this rank: median step seconds and peak tensor bytes of one step."""
    torch.set_num_threads(1)
    engine, opt, batch = _engine(name, plan, b, rank, heavy_first)
    times = []
    for _ in range(steps + 1):
        dist.barrier()
        start = time.perf_counter()
        engine.train_step(batch, opt)
        times.append(time.perf_counter() - start)
    traced = _traced_step(engine, batch, opt)
    peak = _peak_bytes(engine, batch, opt)
    return {"step": statistics.median(times[1:]), "peak": peak, "stage": engine.stage_index, **traced}


def _engine(
    name: str, plan: PipelinePlan, b: int, rank: int, heavy_first: bool = False
) -> tuple[Any, torch.optim.Optimizer, Any]:
    """This rank's engine for ``plan``, its optimizer, and its replica's batch (one per pipeline)."""
    work = WORKLOADS[name]
    engine = place(work.model(heavy_first), plan, rank, groups=PipelineGroups.build(plan.topology, rank))
    opt = work.optimizer(engine.parameters())
    torch.manual_seed(plan.topology.replica_of(rank))
    return engine, opt, work.batch(plan.microbatches * b)


def _stage_peaks(measured: Sequence[dict[str, Any]], depth: int) -> list[int]:
    """Each stage's peak tensor bytes: the largest over its replicas' ``_measure`` results."""
    return [max(v["peak"] for v in measured if v["stage"] == s) for s in range(depth)]


def _run_group(
    rank: int, world: int, name: str, plans: Sequence[tuple[PipelinePlan, int]], passes: int
) -> dict[str, Any]:
    """A group of configurations (same process count) profiled and measured side by side, in one launch.

    Every plan's engine is built, then each of ``passes`` passes (after one that warms up)
    profiles the workload (:func:`profile_blocks`, every rank at once behind barriers, one timed
    run per block and size) and times one step of every plan, the order rotating from pass to
    pass. The host's drift (tens of percent for seconds at a time, every process at once) then
    slows a pass's profile and its steps alike, which a profile and a run in separate launches
    cannot promise. Afterwards each engine runs its traced steps and one step under the tensor
    tracker (its peak bytes).

    Returns:
        ``times``: per plan, this rank's step seconds per pass; ``profiles``: this rank's profile
        per pass; ``each``: per plan, its traced step, action times, peak bytes and stage.
    """
    torch.set_num_threads(1)
    work, runs = WORKLOADS[name], [_engine(name, plan, b, rank) for plan, b in plans]
    model, sample, sizes = work.model(), work.batch(max(work.sizes)), [min(work.sizes), max(work.sizes)]
    times: list[list[float]] = [[] for _ in runs]
    profiles = []
    for p in range(passes + 1):
        profiles.append(profile_blocks(model, sample, sizes, repeats=1, optimizer=work.optimizer, sync=dist.barrier))
        for k in range(len(runs)):
            i = (p + k) % len(runs)
            engine, opt, batch = runs[i]
            dist.barrier()
            start = time.perf_counter()
            engine.train_step(batch, opt)
            times[i].append(time.perf_counter() - start)
    each = [
        {**_traced_step(engine, batch, opt), "peak": _peak_bytes(engine, batch, opt), "stage": engine.stage_index}
        for engine, opt, batch in runs
    ]
    return {"times": [t[1:] for t in times], "profiles": profiles[1:], "each": each}


def _peak_bytes(engine: Any, batch: Any, opt: torch.optim.Optimizer) -> int:
    """Peak tensor bytes of one step on this rank, by a tracker of every tensor storage (gradients included)."""
    for p in engine.parameters():
        p.grad = None  # the step creates them again, tracked
    dist.barrier()
    with PeakTensorBytes(held_tensors(engine.parameters(), [opt])) as tracker:
        engine.train_step(batch, opt)
    return tracker.peak


def _traced_step(engine: Any, batch: Any, opt: torch.optim.Optimizer, steps: int = 3) -> dict[str, Any]:
    """``steps`` more steps with the executor's trace on: their median seconds, and each action's
    median seconds keyed by (kind, stage, microbatch) (a receive's from when its message was due
    to be waited on). One step alone can be an outlier on a noisy host."""
    engine.record_trace = True  # without the stash counting, whose hooks slow the step
    seconds, actions = [], {}
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        engine.train_step(batch, opt)
        seconds.append(time.perf_counter() - start)
        for i in engine.trace.intervals:
            actions.setdefault((i.action.kind.name, i.action.stage, i.action.microbatch), []).append(i.end - i.start)
    engine.record_trace = False
    return {"traced_step": statistics.median(seconds), "actions": {k: statistics.median(v) for k, v in actions.items()}}


def replayed_step(profile: Any, plan: PipelinePlan, b: int, measured: Sequence[dict[str, Any]]) -> float:
    """The simulator's step for ``plan`` with every action a replica's ranks traced charged its
    traced seconds, receives charged as the planner does (the link model); the slowest replica's.
    ``measured``: each rank's result, in rank order.

    Against the prediction it isolates the profile's action costs; against the traced step,
    what the simulator misses with the step's own action times (waits, synchronisation,
    the executor between actions). Each replica is replayed on its own: replicas stall at
    different moments, and the slowest time of each action over them is a step none ran."""
    model = costs.action_cost(profile, plan, costs.stage_costs(profile, plan, b))
    replicas: dict[int, dict[tuple, float]] = {}
    for rank, result in enumerate(measured):
        replicas.setdefault(plan.topology.replica_of(rank), {}).update(result["actions"])

    def replay(traced: dict[tuple, float]) -> float:
        def cost(a: Any) -> float:
            if a.kind.name.startswith("RECV"):
                return model(a)
            return traced.get((a.kind.name, a.stage, a.microbatch), model(a))

        return predict.step_time(plan, cost, None, predict.exchange(profile))  # traced seconds hold the contention

    return max(replay(traced) for traced in replicas.values())


def _profile(name: str, processes: int, links: Optional[dict[str, float]] = None) -> Any:
    """The workload profiled in ``processes`` concurrent processes of one thread each (as the
    measured ranks run), so that the times include their contention for the 2 cores; ``links``:
    the round's measured links, set on the profile."""
    work = WORKLOADS[name]
    sizes = [min(work.sizes), max(work.sizes)]
    profile = profile_concurrently(
        work.model, work.batch(max(sizes)), sizes, processes, repeats=3, optimizer=work.optimizer
    )
    profile.__dict__.update(links or {})
    return profile


def _round(links: dict[str, float], workloads: Sequence[str]) -> dict[tuple, dict[str, Any]]:
    """One round: each group of configurations (a workload at one process count) profiled once in
    as many processes (the planner's view: every plan, its partition and its ``planned`` step
    from that profile), then run side by side in one launch (:func:`_run_group`). A
    configuration's prediction in a pass comes from that pass's profile (the ranks' mean), its
    error in the round is the median over passes of its predicted over measured step, less 1."""
    out = {}
    for name, n in sorted({(c.workload, c.w * c.d) for c in CONFIGS if c.workload in workloads}):
        group = _profile(name, n, links)
        out[("profile", name, n)] = group
        configs = [c for c in CONFIGS if (c.workload, c.w * c.d) == (name, n)]
        plans = [(_plan(c, costs.time_balanced(group, c.d * c.virtual, c.b)), c.b) for c in configs]
        ran = run_gloo(_run_group, n, name, plans, WORKLOADS[name].passes, timeout=1200.0)
        assert all(s == "ok" for s, _ in ran), [v for s, v in ran if s != "ok"]
        ranks = [v for _, v in ran]
        for profile in (p for r in ranks for p in r["profiles"]):
            profile.__dict__.update(links)
        passes = [mean_profile([r["profiles"][k] for r in ranks]) for k in range(WORKLOADS[name].passes)]
        whole = mean_profile([p for r in ranks for p in r["profiles"]])
        for i, (config, (plan, b)) in enumerate(zip(configs, plans)):
            steps = [max(r["times"][i][k] for r in ranks) for k in range(len(passes))]  # its slowest rank's
            predicted = [predict.predict(profile, plan, b).step_time for profile in passes]
            measured = [r["each"][i] for r in ranks]
            out[config] = {
                "predicted": predict.predict(whole, plan, b),
                "predicted_step": statistics.median(predicted),
                "measured": statistics.median(steps),
                "steps": steps,
                "error": statistics.median(p / q - 1 for p, q in zip(predicted, steps)),
                "planned": predict.predict(group, plan, b).step_time,
                "plan": plan,
                "peaks": _stage_peaks(measured, config.d),
                "replayed": replayed_step(whole, plan, b, measured),
                "traced": max(v["traced_step"] for v in measured),
            }
            x = out[config]
            print(
                f"  {name} ({config.w},{config.d}) b={b} {_schedule(config)}"
                f"{' recompute' if config.recompute else ''}: "
                f"predicted {x['predicted_step']:.3f} s, measured {x['measured']:.3f} s "
                f"(median over {len(steps)} passes), "
                f"error {x['error']:+.1%}; replayed with the traced actions {x['replayed']:.3f} s, "
                f"traced step {x['traced']:.3f} s",
                flush=True,
            )
    return out


def main(rounds: int, workloads: Sequence[str]) -> list[tuple[str, str]]:
    """``rounds`` rounds of every configuration of ``workloads``; prints each part and returns
    the page's sections: the fidelity table, the time error's decomposition, each workload's
    ranking and memory verdicts, the MadPipe case (chain)."""
    print(f"torch {torch.__version__}; {rounds} rounds; workloads {', '.join(workloads)}", flush=True)
    torch.set_num_threads(1)
    runs = []
    for r in range(rounds):
        print(f"round {r + 1}/{rounds}", flush=True)
        runs.append(_round(profile_links(world=2), workloads))
    rows, time_errors, memory_errors, results = [], [], [], []
    for config in (c for c in CONFIGS if c.workload in workloads):
        name, w, d, b, _, recompute, _ = config
        mine = [run[config] for run in runs]
        predicted = mine[-1]["predicted"]  # the plan and its memory (the profiled bytes do not drift)
        predicted_step = statistics.median(x["predicted_step"] for x in mine)
        step = statistics.median(x["measured"] for x in mine)
        peaks = [max(x["peaks"][s] for x in mine) for s in range(d)]
        t_err = statistics.median(x["error"] for x in mine)  # each round's paired pass by pass
        m_err = max(abs(p / q - 1) for x in mine for p, q in zip(x["predicted"].stage_memory, x["peaks"]))
        time_errors.append(abs(t_err))
        memory_errors.append(m_err)
        results.append(
            {
                "workload": name,
                "config": (w, d),
                "schedule": _schedule(config),
                "predicted": predicted,
                "b": b,
                "recompute": recompute,
                "planned_step": statistics.median(x["planned"] for x in mine),
                "plan": mine[-1]["plan"],
                "measured": step,
                "steps": [t for x in mine for t in x["steps"]],
                "peaks": peaks,
            }
        )
        each = ", ".join(f"{x['error']:+.0%}" for x in mine)
        rows.append(
            [
                name,
                f"({w},{d})",
                b,
                plan_m(config),
                _schedule(config),
                "yes" if recompute else "no",
                f"{predicted_step:.3f}",
                f"{step:.3f}",
                f"{t_err:+.1%} ({each})",
                ", ".join(f"{p / 2**20:.2f}" for p in predicted.stage_memory),
                ", ".join(f"{q / 2**20:.2f}" for q in peaks),
                f"{m_err:.1%}",
            ]
        )
    fidelity = markdown_table(
        [
            "workload",
            "(w,d)",
            "b",
            "m",
            "schedule",
            "recompute",
            "predicted step (s)",
            "measured step (s)",
            "time error: median (each round)",
            "predicted peak per stage (MiB)",
            "measured peak per stage (MiB)",
            "worst memory error",
        ],
        rows,
    )
    fidelity += (
        f"\n\nStep time error (each configuration's median over rounds): median {statistics.median(time_errors):.1%}, "
        f"worst {max(time_errors):.1%}; peak memory error (every round): median "
        f"{statistics.median(memory_errors):.1%}, worst {max(memory_errors):.1%}."
    )
    sections = [
        ("Predicted against measured", fidelity),
        ("Where the time error comes from", _decomposition(runs, workloads)),
    ]
    for name in workloads:
        mine = [r for r in results if r["workload"] == name]
        sections.append((f"{name}: the planner's ranking", _ranking(mine, name)))
        verdicts = _verdicts(mine, name)
        if verdicts:
            sections.append((f"{name}: memory verdicts", verdicts))
    if "chain" in workloads:
        sections.append(("MadPipe case", _madpipe_order(runs[-1][("profile", "chain", 4)])))
    for heading, body in sections:
        print(f"\n{heading}\n\n{body}", flush=True)
    return sections


def _decomposition(runs: list[dict], workloads: Sequence[str]) -> str:
    """Where each configuration's time error comes from, medians over the rounds: the profile's
    action costs against the ones the step traced (predicted / replayed), and the simulator
    against the traced step with those same action times (replayed / traced). A Markdown table."""
    rows = []
    for config in (c for c in CONFIGS if c.workload in workloads):
        mine = [run[config] for run in runs]
        part = lambda f: statistics.median(f(x) for x in mine)  # noqa: E731
        costs = part(lambda x: x["predicted"].step_time / x["replayed"] - 1)
        simulator = part(lambda x: x["replayed"] / x["traced"] - 1)
        total = part(lambda x: x["predicted"].step_time / x["traced"] - 1)
        rows.append(
            [
                config.workload,
                f"({config.w},{config.d})",
                config.b,
                _schedule(config),
                "yes" if config.recompute else "no",
                f"{costs:+.1%}",
                f"{simulator:+.1%}",
                f"{total:+.1%}",
            ]
        )
    return markdown_table(
        [
            "workload",
            "(w,d)",
            "b",
            "schedule",
            "recompute",
            "predicted / replayed - 1 (action costs)",
            "replayed / traced step - 1 (simulator)",
            "predicted / traced step - 1",
        ],
        rows,
    )


def plan_m(config: Config) -> int:
    """Microbatches of a configuration: the workload's global batch over w * b."""
    return WORKLOADS[config.workload].global_batch // (config.w * config.b)


def _schedule(config: Config) -> str:
    """The schedule column: its name, and interleaved the stages per rank (``v=2``)."""
    return f"{config.schedule} v={config.virtual}" if config.virtual > 1 else config.schedule


def _ranking(results: list[dict[str, Any]], name: str) -> str:
    """The planner's first choice among the configurations with the most processes against the
    best measured one, as Markdown. The choice: the shortest step its one profile per round
    predicts (the median over rounds; same global batch, so the shortest step is the fastest).
    The measurement: the configurations ran side by side (:func:`_run_group`), so the ratio is
    the median over every pass of every round of the chosen plan's step over the best plan's in
    the same pass."""
    most = max(r["config"][0] * r["config"][1] for r in results)
    same = [r for r in results if r["config"][0] * r["config"][1] == most]
    steps, passes = [r["steps"] for r in same], len(same[0]["steps"])
    chosen = min(range(len(same)), key=lambda i: same[i]["planned_step"])
    best = min(range(len(same)), key=lambda i: statistics.median(steps[i]))
    ratio = statistics.median(c / b for c, b in zip(steps[chosen], steps[best]))
    rows = [
        [
            f"{same[i]['config']}",
            same[i]["schedule"],
            same[i]["b"],
            "yes" if same[i]["recompute"] else "no",
            f"{same[i]['planned_step']:.3f}",
            f"{statistics.median(steps[i]):.3f}",
        ]
        for i in sorted(range(len(same)), key=lambda i: same[i]["planned_step"])
    ]
    table = markdown_table(
        ["(w,d)", "schedule", "b", "recompute", "planned step (s)", "measured side by side (s)"], rows
    )
    return (
        f"{most} processes, {len(same)} configurations measured side by side, {passes} passes; in the planner's "
        f"order:\n\n{table}\n\nThe planner's first choice: {same[chosen]['config']} {same[chosen]['schedule']} "
        f"b={same[chosen]['b']}; the best measured: {same[best]['config']} {same[best]['schedule']} "
        f"b={same[best]['b']}; "
        f"step of the choice / step of the best, pass by pass: {ratio:.3f}."
    )


def _verdicts(results: list[dict[str, Any]], name: str) -> str:
    """Does 'feasible' agree with the measured peak, at budgets between the measured peaks? Markdown ("" with one peak).

    Headline: the budget midway between the measured peaks on either side of the median, so
    that half of the configurations fit. A budget equal to a measured peak would leave that
    configuration no margin at all (any overestimate, however small, calls it infeasible), so
    every budget lies midway between two neighbouring measured peaks; the sweep tries each gap."""
    peaks = sorted({max(r["peaks"]) for r in results})
    gaps = [(low + high) / 2 for low, high in zip(peaks, peaks[1:])]
    if not gaps:
        return ""
    headline = gaps[(len(gaps) - 1) // 2]
    swept = [(budget, r) for budget in gaps for r in _disagreements(results, budget)]
    wrong = [r for budget, r in swept if budget == headline]
    lines = [
        (
            f"- At a budget of {headline / 2**20:.3f} MiB (midway between the measured peaks around the median): "
            f"{len(results) - len(wrong)} of {len(results)} verdicts agree."
        ),
        (
            f"- At each of the {len(gaps)} budgets midway between neighbouring measured peaks: "
            f"{len(gaps) * len(results) - len(swept)} of {len(gaps) * len(results)} verdicts agree."
        ),
    ]
    for budget, r in swept:  # "called feasible, measured over" is the one that lets a job run out of memory
        verdict = (
            "called feasible, measured over"
            if max(r["predicted"].stage_memory) <= budget
            else "called infeasible, measured within"
        )
        lines.append(
            f"    - budget {budget / 2**20:.3f} MiB, {r['config']} {r['schedule']} b={r['predicted'].microbatch_size}: "
            f"{verdict} (predicted {max(r['predicted'].stage_memory) / 2**20:.3f} MiB, measured "
            f"{max(r['peaks']) / 2**20:.3f} MiB)"
        )
    return "\n".join(lines)


def _disagreements(results: list[dict[str, Any]], budget: float) -> list[dict[str, Any]]:
    """The configurations whose predicted verdict at ``budget`` differs from the measured one."""
    return [r for r in results if (max(r["predicted"].stage_memory) <= budget) != (max(r["peaks"]) <= budget)]


def _madpipe_order(profile: Any) -> str:
    """A chain whose first block keeps 8x the activations: time-balanced vs memory-aware partition (Markdown)."""
    from lightning_pipe.planning.madpipe import madpipe_partition

    heavy = profile_concurrently(
        functools.partial(HoldChain, True), torch.randn(2, DIM), [1, 2], 4, repeats=2, optimizer=Chain().optimizer
    )
    heavy.__dict__.update(
        {k: getattr(profile, k) for k in ("link_latency", "link_bandwidth", "allreduce_bandwidth", "send_overhead")}
    )
    plan = PipelinePlan(1, 4, 8, "1f1b", partition=costs.time_balanced(heavy, 4, 2))
    balanced = predict.predict(heavy, plan, 2)
    limit = 0.9 * max(balanced.stage_memory)  # the time-balanced split does not fit
    found = madpipe_partition(heavy, plan, 2, limit)
    assert found is not None, "no memory-aware partition fits"
    aware = predict.predict(heavy, plan.replace(partition=found.sizes), 2)
    rows = []
    for name, predicted in (("time-balanced", balanced), ("memory-aware", aware)):
        out = run_gloo(_measure, 4, "chain", predicted.plan, 2, 4, True, timeout=300.0)
        assert all(s == "ok" for s, _ in out), [v for s, v in out if s != "ok"]
        peaks = _stage_peaks([v for _, v in out], 4)
        rows.append((name, predicted, max(v["step"] for _, v in out), max(peaks)))
    table = markdown_table(
        [
            "partition",
            "stages",
            "predicted step (s)",
            "predicted peak (MiB)",
            "measured step (s)",
            "measured peak (MiB)",
            "fits",
        ],
        [
            [
                name,
                list(predicted.plan.partition),
                f"{predicted.step_time:.3f}",
                f"{max(predicted.stage_memory) / 2**20:.3f}",
                f"{step:.3f}",
                f"{peak / 2**20:.3f}",
                "yes" if peak <= limit else "no",
            ]
            for name, predicted, step, peak in rows
        ],
    )
    same = (rows[0][1].step_time < rows[1][1].step_time) == (rows[0][2] < rows[1][2])
    return (
        f"Block 0 keeps 8x the activations; budget {limit / 2**20:.3f} MiB (0.9 of the time-balanced split's "
        f"predicted peak), d=4, m=8, b=2.\n\n{table}\n\nThe measured order of the step times matches the "
        f"predicted one: {'yes' if same else 'no'}."
    )


def synthetic_profile(blocks: int, seed: int = 0) -> Any:
    """A profile of ``blocks`` blocks with times and bytes varying up to 2x, linear in b (samples at 1 and 8),
    and links like this host's (an exchange 25 times slower than a message to a waiting rank)."""
    import random

    from lightning_pipe.planning.profile import BlockProfile, BlockSample, Profile

    rng = random.Random(seed)

    def block(i: int) -> BlockProfile:
        t, a = rng.uniform(1e-3, 2e-3), rng.randint(2**20, 2**21)
        samples = [BlockSample(k, k * t, 2 * k * t, k * t, k * t, k * a, k * 2**16) for k in (1, 8)]
        return BlockProfile(f"b{i}", samples, 2**22, 2**22, 2**23)

    return Profile(
        [block(i) for i in range(blocks)],
        optimizer_step=0.01,
        link_latency=1e-4,
        link_bandwidth=1e9,
        allreduce_bandwidth=1e9,
        exchange_latency=2.5e-3,
    )


def planning_time() -> str:
    """Seconds of a whole search (every candidate simulated), with and without a memory limit
    (MadPipe too), each as the first search of a process (no program cached). Prints each row;
    returns the Markdown table."""
    rows = []
    for blocks, devices, batch in ((8, 8, 64), (64, 64, 512)):
        profile = synthetic_profile(blocks)
        for limit in (None, 2**30):
            programs.clear_caches()
            start = time.perf_counter()
            found = search.search(profile, devices, batch, memory_limit=limit, allow_stale=True)
            seconds = time.perf_counter() - start
            rows.append([blocks, devices, batch, "none" if limit is None else "1 GiB", len(found), f"{seconds:.2f}"])
            print(
                f"planning time: {blocks} blocks on {devices} devices, global batch {batch}, "
                f"memory limit {rows[-1][3]}: "
                f"{len(found)} candidates in {seconds:.2f} s",
                flush=True,
            )
    return markdown_table(["blocks", "devices", "global batch", "memory limit", "candidates", "seconds"], rows)


def memory_check(workloads: Sequence[str]) -> list[tuple[str, str]]:
    """Only the memory model: every configuration's predicted and measured peak per stage, in bytes,
    and the verdicts. Tensor bytes do not depend on the machine's speed, so one profile in one
    process and one measured step per configuration give the same numbers run after run.
    Prints each row; returns the page's sections."""
    sections = []
    for name in workloads:
        profile, results, errors, rows = _profile(name, 1), [], [], []
        for config in (c for c in CONFIGS if c.workload == name):
            plan = _plan(config, costs.time_balanced(profile, config.d * config.virtual, config.b))
            predicted = predict.predict(profile, plan, config.b)
            ran = run_gloo(_measure, config.w * config.d, name, plan, config.b, 1, timeout=300.0)
            assert all(s == "ok" for s, _ in ran), [v for s, v in ran if s != "ok"]
            peaks = _stage_peaks([v for _, v in ran], config.d)
            errors.append(max(abs(p / q - 1) for p, q in zip(predicted.stage_memory, peaks)))
            rows.append(
                [
                    f"({config.w},{config.d})",
                    config.b,
                    _schedule(config),
                    "yes" if config.recompute else "no",
                    ", ".join(str(p - q) for p, q in zip(predicted.stage_memory, peaks)),
                    f"{errors[-1]:.2%}",
                ]
            )
            print(
                f"  {name} {rows[-1][0]} b={config.b} {rows[-1][2]}{' recompute' if config.recompute else ''}: "
                f"predicted - measured peak per stage [{rows[-1][4]}] bytes (worst {errors[-1]:.2%})",
                flush=True,
            )
            results.append(
                {
                    "workload": name,
                    "config": (config.w, config.d),
                    "schedule": _schedule(config),
                    "predicted": predicted,
                    "peaks": peaks,
                }
            )
        body = (
            markdown_table(
                ["(w,d)", "b", "schedule", "recompute", "predicted - measured peak per stage (bytes)", "worst error"],
                rows,
            )
            + f"\n\nPeak memory error: median {statistics.median(errors):.2%}, worst {max(errors):.2%}.\n\n"
            + _verdicts(results, name)
        )
        print(body, flush=True)
        sections.append((f"{name}: predicted against measured peak memory", body))
    return sections


INTRO = """Each configuration is planned from a profile taken in as many concurrent processes as it runs
on (the planner's view), then run side by side with the configurations of the same process count
in one launch: in each pass every rank profiles the workload again and times one step of every
configuration. A configuration's time error is the median over passes of the step that pass's
profile predicts over the step that pass measured (its slowest rank), less 1; medians over the
rounds. Peak memory: one step per engine under a tracker of every tensor storage created.
Workloads: `chain`, 8 sleeping blocks that keep a real activation tensor for their backward;
`gpt`, the GPT example's model (4 layers, width 128, context 64, AdamW) with real compute."""


def _user_path_flags(parser: Any) -> None:
    """The ``--user-path`` mode's flags (see :mod:`benchmarks.planner_user_path`)."""
    from benchmarks.planner_user_path import WORKLOADS as USER_WORKLOADS
    from benchmarks.planner_user_path import Options

    defaults = Options()
    group = parser.add_argument_group("user path (--user-path)")
    group.add_argument(
        "--user-path",
        action="store_true",
        help="run the plan command once per workload and process count, then train its top plans through "
        "Trainer.fit, each in its own launch; writes docs/results/bench_planner_user_path.md",
    )
    group.add_argument("--user-workload", nargs="+", choices=sorted(USER_WORKLOADS), default=sorted(USER_WORKLOADS))
    group.add_argument("--devices", type=int, nargs="+", default=[2, 4], help="process counts to plan and train")
    group.add_argument("--plans", type=int, default=defaults.plans, help="top plans trained per process count")
    group.add_argument("--steps", type=int, default=defaults.steps, help="timed training steps per launch")
    group.add_argument(
        "--measured", type=int, default=defaults.measured, help="the median is over the last MEASURED steps"
    )
    group.add_argument(
        "--launches", type=int, default=defaults.launches, help="launches per layout, round-robin over the layouts"
    )
    group.add_argument(
        "--cli-runs", type=int, default=defaults.cli_runs, help="plan commands per process count (the first is trained)"
    )
    group.add_argument("--busy", action="store_true", help="keep one core busy through planning and training")
    group.add_argument("--memory", default=None, help="the plan command's --memory (default: not passed)")
    group.add_argument(
        "--allow-stale", action="store_true", help="pass --allow-stale to the plan command and train its best 2BW plan"
    )
    group.add_argument("--workdir", type=Path, default=defaults.workdir, help="rankings, configs and logs")


def _run_user_path(args: Any) -> None:
    """``--user-path``: measure, print, and write docs/results/bench_planner_user_path.md (with ``--busy``:
    bench_planner_user_path_busy.md; not with ``--no-page``)."""
    from benchmarks.planner_user_path import Options, intro, user_path

    opts = Options(
        plans=args.plans,
        steps=args.steps,
        measured=min(args.measured, args.steps - 1),
        launches=args.launches,
        cli_runs=args.cli_runs,
        busy=args.busy,
        memory=args.memory,
        allow_stale=args.allow_stale,
        workdir=args.workdir,
    )
    sections = user_path(args.user_workload, args.devices, opts)
    if not args.no_page:
        title = "Planner fidelity on the user's path" + (" on a busy host" if args.busy else "")
        name = "bench_planner_user_path" + ("_busy" if args.busy else "")
        print(f"page: {write_page(name, title, command_line(), sections, intro(opts))}")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--planning-time", action="store_true", help="only time the planner's search")
    parser.add_argument(
        "--memory-only", action="store_true", help="only the memory model: predicted and measured peaks, verdicts"
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds of profiling then measuring; medians are reported"
    )
    parser.add_argument(
        "--workload",
        nargs="+",
        choices=sorted(WORKLOADS),
        default=sorted(WORKLOADS),
        help="only these workloads (and no planning-time part)",
    )
    _user_path_flags(parser)
    add_page_flag(parser)
    args = parser.parse_args()
    intro = INTRO
    if args.user_path:
        _run_user_path(args)
    elif args.planning_time:
        sections = [("Planning time", planning_time())]
        intro = "Seconds of a whole search on synthetic profiles, each as the first search of a process."
    elif args.memory_only:
        sections = memory_check(args.workload)
        intro = (
            "The memory model alone: one profile in one process, one measured step per configuration under a "
            "tracker of every tensor storage created."
        )
    else:
        sections = main(args.rounds, args.workload)
        if set(args.workload) == set(WORKLOADS):
            sections.append(("Planning time", planning_time()))
    if not args.no_page and not args.user_path:
        print(f"page: {write_page('bench_planner', 'Planner fidelity', command_line(), sections, intro)}")
