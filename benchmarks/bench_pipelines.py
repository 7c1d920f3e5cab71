"""Benchmark lightning_pipe against torch.distributed.pipelining, side by side in one run.

    python benchmarks/bench_pipelines.py                      # both workloads: tables, chart, results page
    python benchmarks/bench_pipelines.py --workload costmodel --depths 4
    python benchmarks/bench_pipelines.py --depths 4 --rounds 1 --steps 3 --pairs 3   # a shorter run
    python benchmarks/bench_pipelines.py --workload gpt --rounds 1 --pairs 0 --no-page   # a quick check
    python benchmarks/bench_pipelines.py --workload gpt --contenders zbv,dualpipev --pairs 20   # the V schedules
    python benchmarks/bench_pipelines.py --workload gpt --contenders looped_bfs --pairs 20

The tables, the chart and the page docs/results/bench_pipelines.md (chart beside it) are
written at the end; ``--no-page`` leaves docs/results/ alone. ``--contenders`` runs our
contenders of the schedules named (comma-separated), their torch counterparts and one process,
and writes its own page, docs/results/bench_pipelines_<schedules>.md (``--contenders
zbv,dualpipev``: bench_pipelines_zbv_dualpipev.md), so that the full page always holds every
contender. ``--only`` (contenders whose name contains a text) needs ``--no-page``.

Contenders, interleaved round by round so that machine drift hits them all alike: one process
with no pipeline; torch.distributed.pipelining ScheduleGPipe, Schedule1F1B,
ScheduleInterleavedZeroBubble (one stage per rank, and two), ScheduleInterleaved1F1B (two
stages per rank), ScheduleZBVZeroBubble and ScheduleDualPipeV (two stages per rank in a V);
lightning_pipe gpipe, 1f1b and 2bw (with loss="previous": no wait at window ends), each with
and without split backward, interleaved 1F1B (two stages per rank) with and without split
backward, and zbv and dualpipev (two stages per rank in a V: rank r holds stages r and
2d - 1 - r, for torch's as for ours). Same model, global batch and microbatches; the same
partition for every contender with as many stages per rank. Rank 0 shows progress (one tick
per timed contender).

Workloads:
  (a) costmodel: blocks sleep a set time in F, I and W, so d = 4 and d = 8 fit on 2 cores and
      the schedule, not the cores, sets the time; also reports measured / simulated step time.
  (b) gpt: the GPT blocks of examples/gpt.py at d = 2, one thread per process, sized so compute
      dominates the transfers; also reports the speedup over one process and d*m/(m+d-1). Its
      chain (embedding, ``--gpt-layers`` layers, head) needs at least 2d blocks: the contenders of
      two stages per rank cut it into 2d stages.

DualPipeV needs m >= 2d (torch's and ours); both workloads' defaults give it that (the cost
model runs m = 2d, gpt m = 8 at d = 2).

Peak memory per stage is measured for every contender the same way, in one extra untimed step
under :class:`PeakTensorBytes` (every CPU tensor storage alive, each until it is freed).

After the rounds, each of ours alternates single steps with its torch counterpart (``--pairs``
pairs): a pair's two steps are seconds apart, so the ratio of each pair's times compares the
two on the same machine where rounds minutes apart do not. Each of ours is drained after its
step, which flushes 2BW's stream: 2BW's pairs run :data:`STREAMED_STEPS` steps in a row on each
side (then 2BW's drain), as training does between validations. Both workloads are also simulated
with every block's profiled time (the cost model with its nominal cost too).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import weakref
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]  # lightning_pipe, benchmarks, gpt

from gpt import GPT  # noqa: E402

from benchmarks.results_page import RESULTS, add_page_flag, command_line, write_page
from benchmarks.sleep_chain import SleepChain  # noqa: E402
from lightning_pipe import PipelineGroups, PipelinePlan, Topology, place  # noqa: E402
from lightning_pipe.core.partition import block_cost, partition_sizes, stage_ranges  # noqa: E402
from lightning_pipe.lightning.monitor import held_tensors  # noqa: E402
from lightning_pipe.planning import costs  # noqa: E402
from lightning_pipe.planning.profile import Profile  # noqa: E402
from lightning_pipe.planning.profiler import profile_blocks  # noqa: E402
from lightning_pipe.runtime.microbatch import split_batch  # noqa: E402
from lightning_pipe.runtime.spawn import run_gloo  # noqa: E402
from lightning_pipe.schedules import Kind, build_schedule, get, two_bw_window  # noqa: E402
from lightning_pipe.schedules.simulate import simulate  # noqa: E402

#: Our contenders: (schedule, split backward, stages per rank, W placement or None for the schedule's own).
OURS = [(s, split, 1, None) for s in ("gpipe", "1f1b", "2bw") for split in (False, True)] + [
    ("1f1b", True, 1, "drain"),
    ("1f1b", False, 2, None),
    ("1f1b", True, 2, None),
    ("zbv", True, 2, None),
    ("dualpipev", True, 2, None),
    ("looped_bfs", False, 2, None),
]
TORCH = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "zb": "ScheduleInterleavedZeroBubble",
    "interleaved": "ScheduleInterleaved1F1B",
    "interleaved zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
    "looped_bfs": "ScheduleLoopedBFS",
}
VIRTUAL = {
    "interleaved": 2,
    "interleaved zb": 2,
    "zbv": 2,
    "dualpipev": 2,
    "looped_bfs": 2,
}  # stages per rank; the others run one
#: Torch schedules whose stages sit in a V: rank ``r`` holds stages ``r`` and ``2d - 1 - r`` (the others loop:
#: ``r``, ``r + d``, ...). Their first and last stages are both on rank 0.
V_PLACED = {"zbv", "dualpipev"}
# The torch.distributed.pipelining schedule each of ours is compared with: the same schedule,
# zero bubble (1F1B with split backward, ZB-H1) for split 1F1B, 1F1B for 2BW, whose steady
# state is 1F1B without the flush, and torch's zero bubble on two stages per rank for our
# interleaved 1F1B with split backward. 1F1B split only in its drain holds 1F1B's peak memory:
# it is compared with torch's 1F1B.
SAME = {
    ("gpipe", False, 1, None): "gpipe",
    ("gpipe", True, 1, None): "gpipe",
    ("1f1b", False, 1, None): "1f1b",
    ("1f1b", True, 1, None): "zb",
    ("1f1b", True, 1, "drain"): "1f1b",
    ("2bw", False, 1, None): "1f1b",
    ("2bw", True, 1, None): "zb",
    ("1f1b", False, 2, None): "interleaved",
    ("1f1b", True, 2, None): "interleaved zb",
    ("zbv", True, 2, None): "zbv",
    ("dualpipev", True, 2, None): "dualpipev",
    ("looped_bfs", False, 2, None): "looped_bfs",
}


@dataclass(frozen=True)
class Workload:
    """What is benchmarked: the model, its batch and (for the cost model) its simulated cost."""

    name: str
    depth: int
    microbatches: int
    batch_size: int
    spec: tuple

    def model(self) -> nn.Module:
        """A fresh model, seeded the same for every contender."""
        torch.manual_seed(0)
        if self.name == "costmodel":
            depth, blocks, cost = self.spec
            return SleepChain(depth, blocks, (cost, cost, cost))
        n_layer, n_embd, n_head, block = self.spec
        return GPT(n_layer=n_layer, n_embd=n_embd, n_head=n_head, block_size=block)

    def batch(self) -> Any:
        """One global batch."""
        g = torch.Generator().manual_seed(1)
        if self.name == "costmodel":
            return torch.randn(self.batch_size, 16, generator=g)
        tokens = torch.randint(0, 256, (self.batch_size, self.spec[3] + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:]

    def partition(self, model: nn.Module, virtual: int = 1) -> list[int]:
        """Blocks per stage, shared by every pipelined contender (``virtual`` stages per rank)."""
        blocks = model.pipeline_blocks()
        method = "uniform" if self.name == "costmodel" else "balanced"
        return partition_sizes(method, [block_cost(b) for b in blocks], self.depth * virtual)

    def predicted_step(
        self,
        schedule: str,
        split: bool,
        virtual: int = 1,
        placement: Optional[str] = None,
        steps: int = 2,
        profile: Optional[Profile] = None,
    ) -> Optional[float]:
        """Simulator step time of what :func:`_time` measures: for 2BW, each stage's rate over
        ``steps`` windows of a running stream (:func:`running_rate`), the slowest stage's.

        Each action costs its blocks' nominal sleep, or with ``profile`` (:meth:`profile`) their
        time measured in one process (a sleep overruns, and the block's ops after it take time);
        transfers and the executor's own work cost nothing either way."""
        if self.name != "costmodel" and profile is None:
            return None  # a GPT block has no nominal cost
        cost = (
            self.model().predicted_cost(virtual)
            if profile is None
            else self.profiled_cost(profile, schedule, split, virtual, placement)
        )
        d, m = self.depth, self.microbatches
        if get(schedule).streams:
            return max(running_rate(d, m, split, steps, cost))
        return simulate(
            build_schedule(schedule, d, m, split=split, virtual=virtual, placement=placement), cost
        ).makespan

    def profile(self, threads: int) -> Profile:
        """Every block's F, B, I and W measured in this process at the microbatch size
        (:func:`profile_blocks`), on ``threads`` threads as the contenders run."""
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return profile_blocks(self.model(), self.batch(), [self.batch_size // self.microbatches], repeats=5)
        finally:
            torch.set_num_threads(before)

    def profiled_cost(
        self, profile: Profile, schedule: str, split: bool, virtual: int = 1, placement: Optional[str] = None
    ) -> Callable[[Any], float]:
        """Each compute action's profiled seconds (its stage's blocks summed, as the planner sums
        them); every other action free."""
        plan = PipelinePlan(
            1,
            self.depth,
            self.microbatches,
            schedule,
            split,
            partition=self.partition(self.model(), virtual),
            virtual_stages=virtual,
            split_placement=placement,
        )
        stages = costs.stage_costs(profile, plan, self.batch_size // self.microbatches)
        field = {
            Kind.FORWARD: "forward",
            Kind.BACKWARD: "backward",
            Kind.INPUT_GRAD: "input_grad",
            Kind.WEIGHT_GRAD: "weight_grad",
        }
        return lambda a: getattr(stages[a.stage], field[a.kind]) if a.kind in field else 0.0

    def profiled_single(self, profile: Profile) -> float:
        """One process's profiled step: every block's forward and full backward for each microbatch."""
        size = self.batch_size // self.microbatches
        return self.microbatches * sum(s.forward + s.backward for s in (b.at(size) for b in profile.blocks))


def running_rate(depth: int, m: int, split: bool, steps: int, cost: Any) -> list[float]:
    """Each stage's simulated seconds per 2BW window as :func:`_time` measures them: a stream
    from empty (the warm-up before a timing drains the engine), window 0 untimed, each stage
    timing its windows ``1..steps`` from the end of its window 0."""
    windows = [two_bw_window(depth, m, t, split) for t in range(steps + 1)]
    timeline = simulate([[a for w in windows for a in w[s]] for s in range(depth)], cost).timeline
    rates = []
    for s in range(depth):
        ends = [iv.end for iv in timeline if iv.rank == s]
        rates.append((ends[-1] - ends[len(windows[0][s]) - 1]) / steps)
    return rates


# -- contenders ------------------------------------------------------------------------------
@dataclass
class Contender:
    """One contender's step on this rank, the tensors it keeps between steps, and its clean-up."""

    step: Callable[[Any], Any]
    persistent: Callable[[], list[Tensor]] = list
    finish: Callable[[], None] = lambda: None

    def __call__(self, batch: Any) -> None:
        self.step(batch)


def _single(rank: int, work: Workload) -> Contender:
    """One process, no pipeline: the same microbatches, accumulated, on rank 0 only."""
    if rank != 0:
        return Contender(lambda batch: None)
    model = work.model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step(batch: Any) -> None:
        microbatches, shares = split_batch(batch, work.microbatches)
        for mb, share in zip(microbatches, shares):
            x = model.pipeline_inputs(mb)
            for block in model.pipeline_blocks():
                x = block(x)
            (model.pipeline_loss(x, mb) * share).backward()
        opt.step()
        opt.zero_grad()

    return Contender(step, lambda: held_tensors(list(model.parameters()), [opt]))


def _ours(
    rank: int, work: Workload, groups: Any, schedule: str, split: bool, virtual: int, placement: Optional[str] = None
) -> Contender:
    """A lightning_pipe engine; ``finish`` drains 2BW, whose sends run on into the next window."""
    model = work.model()
    plan = PipelinePlan(
        1,
        work.depth,
        work.microbatches,
        schedule,
        split,
        partition=work.partition(model, virtual),
        virtual_stages=virtual,
        split_placement=placement,
    )
    engine = place(model, plan, rank, groups=groups, loss="previous" if get(schedule).streams else "current")
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    versions = lambda: [p for slot in engine.versions.slots for p in slot or ()]  # noqa: E731 - both 2BW versions
    return Contender(lambda batch: engine.train_step(batch, opt), lambda: held_tensors(versions(), [opt]), engine.drain)


def _torch(rank: int, work: Workload, kind: str) -> Contender:
    """A torch.distributed.pipelining stage over the same blocks, driven by its own schedule."""
    from torch.distributed import pipelining

    model = work.model()
    blocks, virtual = model.pipeline_blocks(), VIRTUAL.get(kind, 1)
    ranges = stage_ranges(work.partition(model, virtual))
    n_stages = work.depth * virtual
    if kind in V_PLACED:  # a V: rank r holds stages r and 2d - 1 - r
        ids = [rank, n_stages - 1 - rank]
    else:  # a loop: rank r holds stages r, r + d, ...
        ids = [rank + v * work.depth for v in range(virtual)]
    modules = [nn.Sequential(*(blocks[i] for i in ranges[s])) for s in ids]
    stages = [pipelining.PipelineStage(m, s, n_stages, torch.device("cpu")) for m, s in zip(modules, ids)]
    cls = getattr(pipelining, TORCH[kind])
    multi = kind not in ("gpipe", "1f1b")  # schedules that take a list of stages
    schedule = cls(stages if multi else stages[0], work.microbatches, loss_fn=_torch_loss(work, model))
    stage_module = nn.ModuleList(modules)
    opt = torch.optim.SGD(stage_module.parameters(), lr=1e-4)
    first, last = 0 in ids, n_stages - 1 in ids  # both on rank 0 in a V

    def step(batch: Any) -> None:
        inputs, target = (batch, batch) if isinstance(batch, Tensor) else batch
        args = (inputs,) if first else ()
        kwargs = {"target": target, "losses": []} if last else {}
        schedule.step(*args, **kwargs)
        opt.step()
        opt.zero_grad()

    return Contender(step, lambda: held_tensors(list(stage_module.parameters()), [opt]))


def _torch_loss(work: Workload, model: nn.Module) -> Callable[[Tensor, Tensor], Tensor]:
    if work.name == "costmodel":
        return lambda out, target: model.pipeline_loss(out, target)
    return lambda out, target: model.pipeline_loss(out, (None, target))


def _builders(
    rank: int, work: Workload, groups: Any, only: Sequence[str] = (), contenders: Sequence[str] = ()
) -> dict[str, Callable[[], Contender]]:
    out: dict[str, Callable[[], Contender]] = {"one process": lambda: _single(rank, work)}
    out.update({f"torch {k}": partial(_torch, rank, work, k) for k in TORCH})
    out.update({_name(*ours): partial(_ours, rank, work, groups, *ours) for ours in OURS})
    keep = selected(out, only, contenders)
    return {name: build for name, build in out.items() if name in keep}


#: The schedule names ``--contenders`` takes: those of :data:`OURS`, in its order.
SCHEDULES = tuple(dict.fromkeys(schedule for schedule, *_ in OURS))


def selected(names: Iterable[str], only: Sequence[str] = (), contenders: Sequence[str] = ()) -> set[str]:
    """Of ``names``, those that contain one of ``only`` and, with ``contenders``, are ours running
    one of those schedules (either filter: all when empty), with "one process" and the torch
    schedule each kept one of ours is compared with."""
    ours = {_name(*o): o for o in OURS}
    keep = {
        n
        for n in names
        if (not only or any(o in n for o in only)) and (not contenders or (n in ours and ours[n][0] in contenders))
    }
    keep.add("one process")
    return keep | {f"torch {SAME[o]}" for n, o in ours.items() if n in keep}


def _name(schedule: str, split: bool, virtual: int = 1, placement: Optional[str] = None) -> str:
    loss = " (loss=previous)" if get(schedule).streams else ""
    shape = "in a V" if get(schedule).placement(virtual) == "v" else "interleaved"
    interleaved = f" {shape} (v={virtual})" if virtual > 1 else ""
    split_name = (f" + split ({placement})" if placement else " + split") if split else ""
    return f"lightning_pipe {schedule}" + interleaved + split_name + loss


def counterparts(names: Iterable[str]) -> dict[str, str]:
    """Each of our contenders among ``names`` -> the torch contender it is compared with, where both are there."""
    pairs = {_name(*ours): f"torch {SAME[ours]}" for ours in OURS}
    return {ours: torch_name for ours, torch_name in pairs.items() if ours in names and torch_name in names}


# -- measurement -----------------------------------------------------------------------------
def _time(step: Contender, batch: Any, steps: int) -> float:
    """Seconds per step of a running job: after a barrier and one untimed step, each rank times
    its own ``steps`` steps, run back to back with no barrier among them; the slowest rank's.

    A barrier between two 2BW windows holds stage 0's next forwards until the last stage has
    finished its window, an idle stretch a running job never has; here the untimed step fills
    the stream (the warm-up drained it) and no barrier follows. A flush schedule (GPipe, 1F1B,
    interleaved 1F1B) ends every step drained, so its rate is the same either way."""
    dist.barrier()
    step(batch)
    start = time.perf_counter()
    for _ in range(steps):
        step(batch)
    seconds = torch.tensor((time.perf_counter() - start) / steps, dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    _finish(step)
    return seconds.item()


def _finish(step: Contender) -> None:
    step.finish()
    dist.barrier()


#: Steps in a row per paired sample of 2BW and of its counterpart (one for the others).
STREAMED_STEPS = 4


def _one_step(step: Contender, batch: Any, steps: int = 1) -> tuple[float, float]:
    """``steps`` steps between barriers, then drained: (wall seconds to the closing barrier, this
    process's CPU seconds before it), per step."""
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step(batch)
    step.finish()
    cpu = time.process_time() - cpu
    dist.barrier()
    return (time.perf_counter() - wall) / steps, cpu / steps


def _paired(ours: Contender, theirs: Contender, batch: Any, pairs: int, steps: int = 1) -> list[tuple[float, ...]]:
    """``pairs`` pairs of ``steps`` steps each (then drained), ours and torch's back to back, which
    one goes first swapping every pair, so both see the same machine: (our wall, our CPU, their
    wall, their CPU) per step, per pair.

    On a shared host the speed of a core drifts by 10% and more over seconds, which decides
    ratios of a few percent between contenders timed minutes apart; a pair's two steps are
    seconds apart."""
    out = []
    for i in range(pairs):
        if i % 2:
            theirs_t = _one_step(theirs, batch, steps)
            ours_t = _one_step(ours, batch, steps)
        else:
            ours_t = _one_step(ours, batch, steps)
            theirs_t = _one_step(theirs, batch, steps)
        out.append((*ours_t, *theirs_t))
    return out


class PeakTensorBytes(TorchDispatchMode):
    """Peak bytes of the CPU tensor storages alive during a block: ``persistent`` ones (weights,
    gradients, optimizer state; a DTensor's by its local shard) plus every storage an op creates
    inside, each until it is freed, at its size at each moment.

    Sizes are read at every op, not once when a storage first appears: FSDP frees a gathered
    weight by resizing its storage to 0 and gathers it again by resizing it back, and no resize
    of a storage passes the dispatcher. Counted once, at its address, every gather of a ZeRO-3
    block would count anew and none of its frees would.

    Measured the same way for every contender. (torch.distributed._tools.MemTracker refuses
    modules that run once per microbatch, so it cannot measure a pipeline stage.)
    """

    def __init__(self, persistent: list[Tensor], ignored: Sequence[Tensor] = ()) -> None:
        super().__init__()
        self.alive: dict[int, Any] = {}  # id of a storage -> a weak reference to it
        self._ignored: dict[int, Any] = {}  # storages never counted: existing ones a view may reach (a dataset's)
        for t in ignored:
            storage = _storage(t)
            if storage is not None:
                self._ignored[id(storage)] = weakref.ref(storage)
        for t in persistent:  # tracked until freed too: a step may drop what it found (last step's gradients)
            self._track(t)
        self.peak = self.now()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, Tensor):
                self._track(t)
        self.peak = max(self.peak, self.now())
        return out

    def now(self) -> int:
        """Bytes of the tracked storages alive now, each at its current size."""
        return sum(s.nbytes() for s in (ref() for ref in list(self.alive.values())) if s is not None)

    def _track(self, t: Tensor) -> None:
        storage = _storage(t)
        if storage is None:
            return
        key = id(storage)  # the storage object lives as long as its storage: it keeps its id
        ignored = self._ignored.get(key)
        if ignored is not None and ignored() is storage:
            return
        if key not in self.alive:
            self.alive[key] = weakref.ref(storage, lambda _, key=key: self.alive.pop(key, None))


def _storage(t: Tensor) -> Optional[Any]:
    """A CPU tensor's storage (a DTensor's local shard's); ``None`` for another device or a wrapper
    subclass with no storage (its inner tensors' ops are tracked)."""
    t = _local(t)
    if t.device.type != "cpu":
        return None
    try:
        return t.untyped_storage()
    except RuntimeError:
        return None


def _local(t: Tensor) -> Tensor:
    """A tensor's local part: an FSDP-sharded (DTensor) weight, gradient or state holds its shard."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _peak_bytes(step: Contender, batch: Any) -> int:
    """Peak tensor bytes on this rank during one step (after one untimed step, as timed)."""
    step(batch)
    dist.barrier()
    with PeakTensorBytes(step.persistent()) as tracker:
        step(batch)
    _finish(step)
    return tracker.peak


def _worker(
    rank: int,
    world: int,
    work: Workload,
    rounds: int,
    steps: int,
    threads: int,
    only: Sequence[str],
    pairs: int,
    contenders: Sequence[str] = (),
) -> dict:
    """Each round builds every contender afresh, in a rotated order, then times each in that order;
    after the last round, ``pairs`` paired steps of each of ours with its torch counterpart.

    Rebuilding matters: whichever model is allocated first can run several percent faster (the
    allocator's state differs), so every contender takes each place in turn.
    """

    torch.set_num_threads(threads)
    builders = _builders(rank, work, PipelineGroups.build(Topology(work.depth, work.depth), rank), only, contenders)
    batch, names = work.batch(), list(builders)
    times: dict[str, list[float]] = {name: [] for name in names}
    peaks: dict[str, int] = {}
    matched = counterparts(names) if pairs else {}
    progress = tqdm(
        total=rounds * len(names) + len(matched), desc=f"{work.name} d={work.depth}", disable=rank != 0, file=sys.stderr
    )
    paired: dict[str, list[tuple[float, ...]]] = {}
    for r in range(rounds):
        shift = r * len(names) // rounds
        order = names[shift:] + names[:shift]
        contenders = {name: builders[name]() for name in order}
        for step in contenders.values():  # warm-up: shape inference, first-call allocations
            step(batch)
            _finish(step)
        for name in order:
            times[name].append(_time(contenders[name], batch, steps))
            progress.set_postfix_str(f"round {r + 1}: {name} {times[name][-1]:.3f} s/step")
            progress.update()
        if r == rounds - 1:
            for ours, theirs in matched.items():
                steps_each = STREAMED_STEPS if "2bw" in ours else 1
                paired[ours] = _paired(contenders[ours], contenders[theirs], batch, pairs, steps_each)
                progress.set_postfix_str(f"paired: {ours} with {theirs}")
                progress.update()
            peaks = {name: _peak_bytes(step, batch) for name, step in contenders.items()}
        del contenders
        gc.collect()
    progress.close()
    return {
        "times": {n: statistics.median(t) for n, t in times.items()},
        "rounds": times,
        "peaks": peaks,
        "paired": paired,
    }


def run(
    work: Workload,
    rounds: int,
    steps: int,
    threads: int,
    only: Sequence[str] = (),
    pairs: int = 0,
    contenders: Sequence[str] = (),
) -> list[dict]:
    """Run the contenders on ``work`` (those :func:`selected` by ``only`` and ``contenders``); one row per contender."""
    profile = work.profile(threads)  # before the run, while the machine is quiet
    out = run_gloo(
        _worker, work.depth, work, rounds, steps, threads, only, pairs, contenders, timeout=3000, pg_timeout=600
    )
    if any(status != "ok" for status, _ in out):
        raise RuntimeError("\n".join(str(v) for s, v in out if s != "ok"))
    times = out[0][1]["times"]
    rows = []
    for name, seconds in times.items():
        peaks = [rank_out["peaks"][name] for _, rank_out in out]
        rows.append(
            {
                "workload": work,
                "name": name,
                "step_s": seconds,
                "samples_s": work.batch_size / seconds,
                "rounds": out[0][1]["rounds"][name],
                "peaks": peaks[:1] if name == "one process" else peaks,
            }
        )
    for ours in (o for o in OURS if _name(*o) in times):
        row = _row(rows, _name(*ours))
        ref = _row(rows, f"torch {SAME[ours]}")
        row["vs"] = (ref["name"].removeprefix("torch "), row["samples_s"] / ref["samples_s"])
        row["sim_s"] = work.predicted_step(*ours, steps=steps)
        row["profiled_s"] = work.predicted_step(*ours, steps=steps, profile=profile)
        if out[0][1]["paired"].get(row["name"]):
            row["paired"] = paired_summary([rank_out["paired"][row["name"]] for _, rank_out in out])
    simulated = {
        "gpipe": ("gpipe", False),
        "1f1b": ("1f1b", False),
        "interleaved": ("1f1b", False, VIRTUAL["interleaved"]),
    }
    for kind, args in simulated.items():
        if f"torch {kind}" in times:
            _row(rows, f"torch {kind}")["sim_s"] = work.predicted_step(*args)
            _row(rows, f"torch {kind}")["profiled_s"] = work.predicted_step(*args, profile=profile)
    if work.name == "costmodel":  # one process runs every block's F, I and W for each microbatch
        depth, blocks, cost = work.spec
        _row(rows, "one process")["sim_s"] = work.microbatches * depth * blocks * 3 * cost
    _row(rows, "one process")["profiled_s"] = work.profiled_single(profile)
    return rows


def paired_summary(per_rank: list[list[tuple[float, ...]]]) -> dict:
    """Torch's step time over ours, pair by pair (above 1: ours faster), from :func:`_paired`'s rows
    of every rank: rank 0's wall-clock ratios (median, quartiles, pairs ours won) and each rank's
    median CPU-time ratio."""
    speed = [theirs / ours for ours, _, theirs, _ in per_rank[0]]
    q1, _, q3 = statistics.quantiles(speed, n=4) if len(speed) > 1 else (speed[0],) * 3
    cpu = [statistics.median(theirs / ours for _, ours, _, theirs in rows) for rows in per_rank]
    return {
        "median": statistics.median(speed),
        "quartiles": (q1, q3),
        "won": sum(s > 1 for s in speed),
        "pairs": len(speed),
        "cpu": cpu,
    }


def _row(rows: list[dict], name: str) -> dict:
    return next(r for r in rows if r["name"] == name)


# -- report ----------------------------------------------------------------------------------
def heading(work: Workload) -> str:
    """One workload's heading: its shape and the ideal pipeline speedup."""
    ideal = work.depth * work.microbatches / (work.microbatches + work.depth - 1)
    return (
        f"{work.name}, d={work.depth}, m={work.microbatches}, batch {work.batch_size} "
        f"(ideal speedup d*m/(m+d-1) = {ideal:.2f})"
    )


def table(rows: list[dict]) -> str:
    """Markdown table of one workload's rows, then each contender's step time round by round."""
    single = _row(rows, "one process")["samples_s"]
    lines = [
        "| contender | step (s) | samples/s | speedup over one process | vs torch (same schedule) | "
        "measured / simulated step (nominal costs) | measured / simulated step (profiled costs) "
        "| peak tensor memory per stage |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        vs = f"{r['vs'][1]:.2f}x {r['vs'][0]}" if "vs" in r else ""
        sim = f"{r['step_s'] / r['sim_s']:.3f}" if r.get("sim_s") else ""
        profiled = f"{r['step_s'] / r['profiled_s']:.3f}" if r.get("profiled_s") else ""
        peaks = ", ".join(_size(p) for p in r["peaks"])
        lines.append(
            f"| {r['name']} | {r['step_s']:.3f} | {r['samples_s']:.1f} | {r['samples_s'] / single:.2f} | "
            f"{vs} | {sim} | {profiled} | {peaks} |"
        )
    lines.append(
        "\nStep time of each round (s), in the order run: "
        + "; ".join(f"{r['name']} {', '.join(f'{t:.3f}' for t in r['rounds'])}" for r in rows)
    )
    return "\n".join(lines)


def paired_table(rows: list[dict]) -> str:
    """Markdown table of the paired steps (:func:`_paired`), or "" when none were run."""
    paired = [r for r in rows if "paired" in r]
    if not paired:
        return ""
    lines = [
        "| contender | against | pairs ours won | torch's step / ours: median of pairs | quartiles | "
        "torch's CPU time / ours, per stage |",
        "|---|---|---|---|---|---|",
    ]
    for r in paired:
        p = r["paired"]
        cpu = ", ".join(f"{c:.3f}" for c in p["cpu"])
        lines.append(
            f"| {r['name']} | torch {r['vs'][0]} | {p['won']} of {p['pairs']} | {p['median']:.3f} | "
            f"{p['quartiles'][0]:.3f} to {p['quartiles'][1]:.3f} | {cpu} |"
        )
    title = (
        f"Paired steps, each of ours alternating with its torch counterpart, one step each (2BW and its "
        f"counterpart: {STREAMED_STEPS} in a row), drained:"
    )
    return title + "\n\n" + "\n".join(lines)


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"


def chart(results: list[list[dict]], path: Path) -> None:
    """Bar chart of samples/s relative to one process, one panel per workload."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6 * len(results), 4.5))
    for i, rows in enumerate(results):
        ax = fig.add_subplot(1, len(results), i + 1)
        work, single = rows[0]["workload"], _row(rows, "one process")["samples_s"]
        names = [r["name"].replace("lightning_pipe", "lp") for r in rows]
        colours = [
            "#7f7f7f" if n == "one process" else "#dd8452" if n.startswith("torch") else "#4c72b0" for n in names
        ]
        ax.barh(names, [r["samples_s"] / single for r in rows], color=colours)
        ideal = work.depth * work.microbatches / (work.microbatches + work.depth - 1)
        ax.axvline(ideal, color="black", linestyle="--", linewidth=1, label=f"ideal d*m/(m+d-1) = {ideal:.2f}")
        ax.invert_yaxis()
        ax.set_xlabel("throughput / one process")
        ax.set_title(f"{work.name}, d={work.depth}, m={work.microbatches}")
        ax.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def workloads(args: argparse.Namespace) -> list[Workload]:
    """The workloads asked for on the command line."""
    out = []
    if args.workload in ("costmodel", "all"):
        for d in args.depths:
            m = 2 * d
            out.append(Workload("costmodel", d, m, 2 * m, (d, 2, args.cost_ms / 1000)))
    if args.workload in ("gpt", "all"):
        depth = 2
        blocks = args.gpt_layers + 2  # embedding, the layers, head (GPT.pipeline_blocks)
        if blocks < 2 * depth:  # the contenders of two stages per rank cut the chain into 2d stages
            raise SystemExit(f"--gpt-layers {args.gpt_layers}: {blocks} blocks, fewer than 2d = {2 * depth} stages")
        out.append(
            Workload("gpt", depth, args.gpt_microbatches, args.gpt_batch, (args.gpt_layers, args.gpt_width, 4, 128))
        )
    return out


def page_name(contenders: Sequence[str]) -> str:
    """The results page's name (without ``.md``; its chart is ``<name>.png``): ``bench_pipelines``
    for every contender, ``bench_pipelines_<schedules>`` for a ``--contenders`` subset, so that a
    subset's page sits beside the full one and never replaces it."""
    return "_".join(["bench_pipelines", *contenders])


def _schedule_list(text: str) -> list[str]:
    """``--contenders``' value: comma-separated schedule names of :data:`SCHEDULES`."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCHEDULES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: give schedules among {', '.join(SCHEDULES)}, comma-separated")
    return list(dict.fromkeys(names))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=("costmodel", "gpt", "all"), default="all")
    parser.add_argument("--depths", type=int, nargs="+", default=[4, 8], help="cost-model pipeline depths")
    parser.add_argument("--cost-ms", type=float, default=20.0, help="cost-model sleep of each F, I and W per block")
    parser.add_argument("--gpt-layers", type=int, default=8)
    parser.add_argument("--gpt-width", type=int, default=256)
    parser.add_argument("--gpt-batch", type=int, default=32)
    parser.add_argument("--gpt-microbatches", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (one process too)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each rebuilds and times every contender")
    parser.add_argument(
        "--steps",
        type=int,
        default=8,
        help="timed steps per contender per round, back to back as in training, each rank "
        "timing its own after one untimed step",
    )
    parser.add_argument(
        "--pairs",
        type=int,
        default=20,
        help="after the rounds, pairs of single steps of each of ours and its torch counterpart, alternating (0: none)",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        default=[],
        metavar="TEXT",
        help="run only the contenders whose name contains one of these (with one process "
        "and the torch schedules they are compared with)",
    )
    parser.add_argument(
        "--contenders",
        type=_schedule_list,
        default=[],
        metavar="SCHEDULES",
        help=f"run only our contenders of these schedules, comma-separated ({','.join(SCHEDULES)}), with "
        "their torch counterparts and one process; the page is bench_pipelines_<schedules>.md",
    )
    parser.add_argument(
        "--chart",
        type=Path,
        default=None,
        help="where to save the chart (default: docs/results/<page>.png, beside the page; "
        "with --no-page, no chart unless given)",
    )
    add_page_flag(parser)
    args = parser.parse_args()
    if args.only and not args.no_page:
        parser.error("--only runs a part of the contenders: add --no-page, or select schedules with --contenders")
    name = page_name(args.contenders)
    results, sections = [], []
    for work in workloads(args):
        rows = run(work, args.rounds, args.steps, args.threads, args.only, args.pairs, args.contenders)
        results.append(rows)
        body = (table(rows) + "\n\n" + paired_table(rows)).strip()
        sections.append((heading(work), body))
        print(f"### {heading(work)}\n\n{body}\n", flush=True)
    chart_path = args.chart or (None if args.no_page else RESULTS / f"{name}.png")
    if chart_path is not None:
        chart(results, chart_path)
        print(f"chart: {chart_path}")
    if not args.no_page:
        if chart_path is not None and chart_path.resolve().parent == RESULTS:
            alt = "throughput of every contender relative to one process, per workload"
            sections.insert(0, ("Throughput relative to one process", f"![{alt}]({chart_path.name})"))
        intro = (
            f"Every contender runs the same model, global batch and microbatches on gloo processes of "
            f"{args.threads} torch thread(s) each, rebuilt every round in a rotated order; {args.rounds} round(s) of "
            f"{args.steps} timed steps after one untimed step, the slowest rank's seconds per step (median over "
            f'rounds). "vs torch" is our samples/s over the same schedule\'s in `torch.distributed.pipelining`; '
            "\"measured / simulated\" divides the step by the simulator's for the same program, with each block's "
            "nominal sleep (cost model) or its time profiled in one process. Paired steps alternate each of ours "
            f"with its torch counterpart, {args.pairs} pair(s), so that both see the same machine. Peak tensor "
            "memory counts every CPU tensor storage alive during one step."
        )
        subset = f": {', '.join(args.contenders)}" if args.contenders else ""
        path = write_page(
            name,
            f"Pipeline schedules against torch.distributed.pipelining{subset}",
            command_line(),
            sections,
            intro,
        )
        print(f"page: {path}")


if __name__ == "__main__":
    main()
