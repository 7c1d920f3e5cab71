"""PipelineMonitor: logs per-stage compute, bubble, stash, memory and throughput, and draws the timeline."""

from __future__ import annotations

import os
import time
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor
from torch.utils._pytree import tree_leaves

from lightning_pipe.core.sizes import storages
from lightning_pipe.lightning.strategy import PipelineStrategy
from lightning_pipe.runtime.engine import PipelineEngine
from lightning_pipe.runtime.sharding import local
from lightning_pipe.schedules import timeline


class PipelineMonitor(Callback):
    """Log where a pipeline's time and memory go, and draw the schedule that actually ran.

    Every ``log_every_n_steps`` it logs to the Trainer's loggers, per stage ``s`` (averaged
    over the stage's data-parallel replicas):

    - ``pipeline/stage{s}/compute_s``: seconds of forward and backward work in the step;
    - ``pipeline/stage{s}/bubble``: idle fraction of the step (everything but F, B, I, W);
    - ``pipeline/stage{s}/peak_stash`` and ``peak_stash_bytes``: activations held for backward;
    - ``pipeline/stage{s}/memory_bytes``: peak CUDA allocation on GPU; on CPU the accounted
      tensor bytes (weight versions, gradients, optimizer state and the peak stash);

    and ``pipeline/bubble`` (all ranks), ``pipeline/step_time_s``, ``pipeline/samples_per_s``
    and ``pipeline/tokens_per_s`` over the steps since the last log. Every
    ``timeline_every_n_steps`` it draws the step that ran (one row per rank, one box per
    action, from measured timestamps), saves it as a PNG and logs it to TensorBoard.

    Times come from each rank's ``time.time()``; ranks on one host share that clock.

    Args:
        log_every_n_steps: how often to log scalars; default the Trainer's ``log_every_n_steps``.
        timeline_every_n_steps: how often to draw the timeline; 0 never.
        dirpath: folder for the timeline PNGs; default ``<log_dir>/pipeline_timeline``.
        tokens_per_sample: tokens in one sample; default the second dimension of an integer
            input tensor (token ids), else no tokens/s.

    Example::

        Trainer(strategy=PipelineStrategy(...), callbacks=[PipelineMonitor()])
    """

    def __init__(
        self,
        log_every_n_steps: Optional[int] = None,
        timeline_every_n_steps: int = 100,
        dirpath: Optional[str] = None,
        tokens_per_sample: Optional[int] = None,
    ) -> None:
        if log_every_n_steps is not None and log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps must be >= 1, got {log_every_n_steps}")
        if timeline_every_n_steps < 0:
            raise ValueError(f"timeline_every_n_steps must be >= 0, got {timeline_every_n_steps}")
        self.log_every_n_steps, self.timeline_every_n_steps = log_every_n_steps, timeline_every_n_steps
        self.dirpath, self.tokens_per_sample = dirpath, tokens_per_sample
        self.saved: list[str] = []  # timeline PNGs written (rank 0)
        self.last_records: list[dict] = []  # every rank's record at the last log (rank 0)
        self._folder = ""
        self._records_group: Any = None  # a gloo group of every rank for the records alone
        self._reset(time.perf_counter())

    def _reset(self, start: float) -> None:
        self._since, self._steps, self._samples, self._tokens = start, 0, 0, 0

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Refuse to run without a pipeline strategy."""
        if not isinstance(trainer.strategy, PipelineStrategy):
            raise TypeError(
                f"PipelineMonitor needs Trainer(strategy=PipelineStrategy(...)), got {type(trainer.strategy).__name__}"
            )

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Resolve the PNG folder (on every rank: ``trainer.log_dir`` is a collective), make the
        group the records travel over, and start the throughput clock."""
        self._folder = self.dirpath or os.path.join(trainer.log_dir or trainer.default_root_dir, "pipeline_timeline")
        if self._records_group is None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # Its own group: on the default one a record could meet a receive the pipeline posted
            # ahead for a peer's next message (2BW keeps them across steps).
            self._records_group = dist.new_group(backend="gloo")
        self._reset(time.perf_counter())

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        """Have the engine record the step's trace and the bytes it holds for backward (off by default)."""
        trainer.strategy.engine.instrument = True

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Count the batch; every N steps gather every rank's record and log (and draw) it."""
        engine: PipelineEngine = trainer.strategy.engine
        samples, tokens = self._count(engine, trainer.strategy.replica_batch(batch))
        self._steps, self._samples, self._tokens = self._steps + 1, self._samples + samples, self._tokens + tokens
        step = trainer.global_step
        log = step % (self.log_every_n_steps or trainer.log_every_n_steps or 1) == 0
        draw = bool(self.timeline_every_n_steps) and step % self.timeline_every_n_steps == 0
        if not (log or draw):
            return
        records = _gather(_record(engine, trainer), self._records_group)
        if trainer.is_global_zero:
            self.last_records = records
            if log:
                metrics = {**stage_metrics(records, engine), **self._throughput(engine)}
                for logger in trainer.loggers:
                    logger.log_metrics(metrics, step=step)
            if draw:
                self._draw(trainer, engine, records, step)
        if log:
            self._reset(time.perf_counter())

    # -- throughput ------------------------------------------------------------------------
    def _count(self, engine: PipelineEngine, batch: Any) -> tuple[int, int]:
        """Samples and tokens in this pipeline's batch."""
        leaves = [t for t in tree_leaves(batch) if isinstance(t, Tensor) and t.dim() > 0]
        samples = int(leaves[0].shape[0]) if leaves else 0
        per_sample = self.tokens_per_sample
        if per_sample is None:
            ids = [t for t in tree_leaves(engine.module.pipeline_inputs(batch)) if isinstance(t, Tensor)]
            per_sample = int(ids[0].shape[1]) if ids and ids[0].dim() >= 2 and not ids[0].is_floating_point() else 0
        return samples, samples * per_sample

    def _throughput(self, engine: PipelineEngine) -> dict[str, float]:
        elapsed = max(time.perf_counter() - self._since, 1e-9)
        width = engine.topology.width  # every replica reads its own batch of the same size
        out = {
            "pipeline/step_time_s": elapsed / max(self._steps, 1),
            "pipeline/samples_per_s": width * self._samples / elapsed,
        }
        if self._tokens:
            out["pipeline/tokens_per_s"] = width * self._tokens / elapsed
        return out

    # -- timeline --------------------------------------------------------------------------
    def _draw(self, trainer: Trainer, engine: PipelineEngine, records: list[dict], step: int) -> None:
        intervals = [i for r in records for i in r["intervals"]]
        _, bubble = timeline.bubble_fraction(intervals)
        split = " + split backward" if engine.split_backward else ""
        split += f" ({engine.plan.split_placement})" if engine.plan.split_placement else ""
        if engine.plan.virtual_stages > 1:
            split += f", interleaved ({engine.plan.virtual_stages} stages per rank)"
        title = (
            f"{engine.schedule}{split}, step {step}: w={engine.topology.width}, d={engine.topology.depth}, "
            f"m={engine.microbatches}, measured bubble {bubble:.0%}"
        )
        labels = {r["rank"]: f"rank {r['rank']} ({_stages_label(engine.plan.stages_of(r['stage']))})" for r in records}
        fig = timeline.draw(intervals, title, labels)
        os.makedirs(self._folder, exist_ok=True)
        path = os.path.join(self._folder, f"timeline_step{step:06d}.png")
        fig.savefig(path, dpi=120)
        self.saved.append(path)
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_figure("pipeline/timeline", fig, global_step=step, close=False)


def _stages_label(stages: list[int]) -> str:
    return f"stage {stages[0]}" if len(stages) == 1 else "stages " + ", ".join(map(str, stages))


def _gather(record: dict, group: Any) -> list[dict]:
    """Every rank's record, in rank order, on rank 0 (other ranks get only their own), over
    ``group`` (every rank; ``None``: one process).

    Point-to-point on purpose: a gloo collective's work object can outlive the call in the
    group's worker thread, and when it holds the last reference to Python-made tensors it
    needs the GIL to free them. Ranks leave ``fit`` right after the last step's gather while
    rank 0 still draws, so the interpreter could already be finalizing then, and the worker
    thread aborted the process ("terminate called without an active exception"). A send's
    work is freed by its caller.
    """
    if group is None:
        return [record]
    if dist.get_rank() != 0:
        dist.send_object_list([record], dst=0, group=group)
        return [record]
    out = [record]
    for src in range(1, dist.get_world_size()):
        received: list[Any] = [None]
        dist.recv_object_list(received, src=src, group=group)
        out.append(received[0])
    return out


def _record(engine: PipelineEngine, trainer: Trainer) -> dict:
    """What this rank measured in its last step."""
    return {
        "rank": engine.rank,
        "stage": engine.stage_index,
        "replica": engine.topology.replica_of(engine.rank),
        "intervals": list(engine.trace.intervals),
        "peak_stash": engine.last_peak_stash,
        "peak_stash_bytes": engine.last_peak_stash_bytes,
        "memory_bytes": memory_bytes(engine, trainer.optimizers),
    }


def memory_bytes(engine: PipelineEngine, optimizers: list[Any]) -> int:
    """Peak CUDA bytes allocated since the last call on GPU; on CPU the accounted tensor bytes:
    every weight version, its gradient, the optimizer state and the last step's peak stash (this
    rank's shards of them with FSDP replicas)."""
    if engine.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(engine.device)
        torch.cuda.reset_peak_memory_stats(engine.device)
        return int(peak)
    tensors = held_tensors([p for slot in engine.versions.slots for p in slot or ()], optimizers)
    return storage_bytes(tensors) + engine.last_peak_stash_bytes


def storage_bytes(tensors: Sequence[Tensor]) -> int:
    """Bytes of the storages under ``tensors``, each once; an FSDP shard (a DTensor) by its local
    tensor (a DTensor's own storage is a zero-address stand-in)."""
    return sum(storages(local(t) for t in tensors).values())


def held_tensors(params: Sequence[Tensor], optimizers: Sequence[Any]) -> list[Tensor]:
    """What a stage keeps between steps: its weights, their gradients and the optimizers' state."""
    state = [v for opt in optimizers for st in opt.state.values() for v in st.values() if isinstance(v, Tensor)]
    return list(params) + [p.grad for p in params if p.grad is not None] + state


def logged_value_bytes(trainer: Trainer) -> int:
    """Bytes of the values the module logged that Lightning holds between steps: its copy of each
    (``callback_metrics``, ``logged_metrics``, ``progress_bar_metrics``), each storage once. They
    stay alive through the next step until it logs them again, beside every other tensor."""
    metrics = (trainer.callback_metrics, trainer.logged_metrics, trainer.progress_bar_metrics)
    return storage_bytes([v for values in metrics for v in values.values() if isinstance(v, Tensor)])


def stage_metrics(records: list[dict], engine: PipelineEngine) -> dict[str, float]:
    """Per-stage means over replicas, and the bubble of all ranks, from every rank's record."""
    bubbles, total = {}, []
    for replica in sorted({r["replica"] for r in records}):
        per_rank, whole = timeline.bubble_fraction(
            i for r in records if r["replica"] == replica for i in r["intervals"]
        )
        bubbles.update(per_rank)
        total.append(whole)
    busy = timeline.compute_time(i for r in records for i in r["intervals"])
    out = {"pipeline/bubble": sum(total) / len(total)}
    for s in range(engine.topology.depth):
        mine = [r for r in records if r["stage"] == s]
        out[f"pipeline/stage{s}/compute_s"] = _mean(busy.get(r["rank"], 0.0) for r in mine)
        out[f"pipeline/stage{s}/bubble"] = _mean(bubbles.get(r["rank"], 0.0) for r in mine)
        out[f"pipeline/stage{s}/peak_stash"] = float(max(r["peak_stash"] for r in mine))
        out[f"pipeline/stage{s}/peak_stash_bytes"] = float(max(r["peak_stash_bytes"] for r in mine))
        out[f"pipeline/stage{s}/memory_bytes"] = float(max(r["memory_bytes"] for r in mine))
    return out


def _mean(values: Any) -> float:
    items = list(values)
    return sum(items) / len(items) if items else 0.0
