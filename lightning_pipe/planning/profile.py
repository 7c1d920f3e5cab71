"""Block profiles as data: per-block samples at each microbatch size, the host's link costs, and their JSON form."""

from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional, Sequence


@dataclass
class BlockSample:
    """One block measured at one microbatch size (seconds and bytes per microbatch)."""

    microbatch_size: int
    forward: float
    backward: float
    input_grad: float
    weight_grad: float
    saved_bytes: int  # what autograd saves, the block's own input and parameters excluded
    output_bytes: int
    saved_input_bytes: int = 0  # of the block's input, if autograd saves it
    saved_output_bytes: int = 0  # of the block's output, if autograd saves it (part of saved_bytes)
    forward_workspace_bytes: int = 0  # peak temporaries of its forward (see ``_workspace``)
    backward_workspace_bytes: int = 0  # peak temporaries of its backward
    captured_bytes: int = 0  # gradients split backward's I captures for the block's W (held until W)
    captured_input_bytes: int = 0  # of those, the block's own input (a deferred call on it keeps it for W)
    input_grad_workspace_bytes: int = (
        0  # peak temporaries of its I where it defers its weight gradients (see ``_split_workspaces``)
    )
    # peak temporaries of its W where it defers its weight gradients, its gradients existing (see ``_split_workspaces``)
    weight_grad_workspace_bytes: int = 0
    after_gradient_bytes: int = (
        0  # peak bytes alive from its backward's first weight-gradient accumulation on (see ``_workspace``)
    )
    # The bytes alive at each of its moments (each accumulation, its gradient included, and each new
    # storage), the same moments at every size. Each is a line in the microbatch size where their
    # largest is not (a gradient does not grow with it, the activations beside it do):
    # :meth:`BlockProfile.at` takes the largest of the lines.
    gradient_moment_bytes: tuple[int, ...] = ()
    cold_backward_bytes: int = 0  # peak temporaries and new gradients of its backward when no gradient exists before it
    loss_saved_bytes: int = (
        0  # the last block: what the loss saves for its backward (part of saved_bytes; outside a recomputed stage)
    )
    loss_bytes: int = (
        0  # the last block: the loss itself, kept until the microbatch's backward (the same at every size)
    )
    # The last block's backward alone, the loss's left out (as above): a recomputed last stage runs the
    # loss's backward first.
    block_backward_workspace_bytes: int = 0
    block_after_gradient_bytes: int = 0
    block_cold_backward_bytes: int = 0

    @property
    def recompute(self) -> float:
        """Extra seconds recomputation adds to a backward: one more forward."""
        return self.forward


@dataclass
class BlockProfile:
    """A block's samples at two or more microbatch sizes, and the bytes of its weights and their state."""

    name: str
    samples: list[BlockSample]
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    optimizer_step_bytes: int = 0  # the temporaries of an optimizer step over the block's parameters
    deferred_weights: bool = (
        False  # it holds a trainable nn.Linear or nn.Conv1d/2d/3d (split backward defers their weight gradients)
    )
    other_matrices: bool = (
        False  # it holds a trainable matrix that is no linear, convolution or embedding weight (it cannot)
    )
    # its output holds a tensor that is not floating point: the gradient sent back for it carries
    # fewer tensors, a message layout of its own (profiles that do not record it read False)
    mixed_output: bool = False
    # the gradients of its weights that a deferring I computes itself, returned together at the end
    # of I's autograd call (runtime/autograd/deferred_weights.py ``undeferred_gradient_bytes``;
    # profiles that do not record it read 0)
    undeferred_gradient_bytes: int = 0

    def at(self, size: int) -> BlockSample:
        """Every field at microbatch ``size``: linear in ``size`` through the two nearest samples (PipeDream-2BW paper,
        Appendix A, models T_comp(b) and |A(b)| as functions of the microbatch size)."""
        by_size = {s.microbatch_size: s for s in self.samples}  # one per size: a line needs two sizes
        pts = [by_size[b] for b in sorted(by_size)]
        if len(pts) == 1:
            return _scaled(pts[0], size)
        lo, hi = (pts[0], pts[1]) if size <= pts[0].microbatch_size else (pts[-2], pts[-1])
        for a, b in zip(pts, pts[1:]):
            if a.microbatch_size <= size <= b.microbatch_size:
                lo, hi = a, b
        return _interpolate(lo, hi, size)


_FIELDS = (
    "forward",
    "backward",
    "input_grad",
    "weight_grad",
    "saved_bytes",
    "output_bytes",
    "saved_input_bytes",
    "saved_output_bytes",
    "forward_workspace_bytes",
    "backward_workspace_bytes",
    "captured_bytes",
    "captured_input_bytes",
    "after_gradient_bytes",
    "cold_backward_bytes",
    "loss_saved_bytes",
    "block_backward_workspace_bytes",
    "block_after_gradient_bytes",
    "block_cold_backward_bytes",
    "input_grad_workspace_bytes",
    "weight_grad_workspace_bytes",
)


def _sample(size: int, values: dict[str, float], like: BlockSample, moments: Sequence[float] = ()) -> BlockSample:
    """A sample at ``size`` of these ``_FIELDS`` values, ``like``'s in every field that does not depend on the size;
    ``moments``: its after-gradient peak's parts at ``size``, where profiled (the peak is their largest)."""
    parts = tuple(int(v) for v in moments)
    if parts:
        values = {**values, "after_gradient_bytes": max(parts)}
    return BlockSample(
        size,
        **{f: int(v) if f.endswith("bytes") else v for f, v in values.items()},  # type: ignore[arg-type]
        loss_bytes=like.loss_bytes,
        gradient_moment_bytes=parts,
    )


def _moments(lo: BlockSample, hi: BlockSample, t: float) -> list[float]:
    """The after-gradient parts on the lines through ``lo``'s and ``hi``'s (none unless both have the same parts)."""
    a, b = lo.gradient_moment_bytes, hi.gradient_moment_bytes
    return [max(x + t * (y - x), 0.0) for x, y in zip(a, b)] if len(a) == len(b) else []


def _interpolate(lo: BlockSample, hi: BlockSample, size: int) -> BlockSample:
    t = (size - lo.microbatch_size) / (hi.microbatch_size - lo.microbatch_size)
    values = {f: max(getattr(lo, f) + t * (getattr(hi, f) - getattr(lo, f)), 0.0) for f in _FIELDS}
    return _sample(size, values, lo, _moments(lo, hi, t))


def _scaled(sample: BlockSample, size: int) -> BlockSample:
    r = size / sample.microbatch_size
    values = {f: getattr(sample, f) * r for f in _FIELDS}
    return _sample(size, values, sample, [v * r for v in sample.gradient_moment_bytes])


def _sample_of(fields: dict[str, Any]) -> BlockSample:
    """A sample from its JSON fields (its moments a tuple, as profiled)."""
    return BlockSample(**{**fields, "gradient_moment_bytes": tuple(fields.get("gradient_moment_bytes", ()))})


def median_sample(samples: list[BlockSample]) -> BlockSample:
    """The field-wise median of ``samples`` (all at one microbatch size)."""
    values = {f: statistics.median(getattr(s, f) for s in samples) for f in _FIELDS}
    return _sample(samples[0].microbatch_size, values, samples[0], samples[0].gradient_moment_bytes)


@dataclass
class Profile:
    """What the planner needs to predict any layout: every block's profile, plus the machine's links.

    Attributes:
        blocks: one profile per block of the chain, in order.
        optimizer_step: seconds of one optimizer step over the whole model (split by weight bytes).
        action_overhead: seconds the executor adds to each forward or backward action beyond its
            blocks' own time (dispatch, stash accounting, the loss), measured on a one-stage run.
        input_bytes_per_sample: bytes per sample that ``pipeline_inputs`` allocates (views of the
            batch are free); stage 0 keeps them for backward.
        batch_bytes_per_sample: bytes of the whole batch per sample (every rank of a pipeline holds
            its replica's batch during the step).
        link_latency: seconds of a point-to-point transfer of an empty message (on CPU measured
            between processes that compute between transfers, as pipeline ranks do, see
            :func:`profile_links`).
        link_bandwidth: bytes per second of a point-to-point transfer.
        allreduce_bandwidth: bytes per second of a gradient all-reduce across replicas (0: unknown).
        exchange_latency: seconds a message takes to arrive when the two ranks of a link send
            each other at once, beyond its bytes' time (on a CPU host under gloo milliseconds,
            where :attr:`link_latency` is a tenth of one; see :func:`profile_links`); 0: not
            measured, charged as any message.
        send_overhead: seconds a rank spends posting one transfer (header and payload sends;
            the transfer itself goes on while it computes), charged to each send action; on CPU
            measured right after computing, as :attr:`link_latency`.
        send_seconds_per_byte: seconds each byte of a send's payload adds to its posting (the
            transport takes part of a large payload in before the send returns), fitted from
            trial runs (:func:`~lightning_pipe.planning.calibration.calibrate`); 0: not fitted.
        message_stall: seconds each send and receive costs its job beyond its typical seconds:
            on a host whose cores the ranks share, a message's arrival wakes a transport thread,
            and now and then a rank waits a scheduler slice for its core back; fitted from trial
            runs' traces (:func:`~lightning_pipe.planning.calibration.traced_stalls`); 0: not fitted.
        loads_global_batch: every rank loads the whole global batch and trains on its replica's
            rows (``PipelineStrategy.enable_reconfiguration``), so holds all of it.
        cores: effective CPU cores the job's ranks share (CPU jobs on one host; ``None``: each rank
            computes on a device of its own). Block, optimizer and overhead seconds are then a
            rank's alone, and the simulator slows a rank that computes while others do
            (:class:`~lightning_pipe.schedules.simulate.SharedCores`). Measured by
            :func:`~lightning_pipe.planning.profiler.profile_concurrently` as the ranks over their
            slowdown when all compute at once.
        device: where it was measured.
        device_bytes: bytes every device holds beyond the model's tensors (on CUDA: the math
            libraries' workspaces, e.g. 32 MiB per cuBLAS handle; communication buffers),
            measured between two steps; added to every stage's predicted peak.
        shared_blocks: groups of blocks that share a parameter (tied weights), by index;
            ``None``: unknown (the planner then assumes they are split across stages).
        step_bytes_add_up: an optimizer step over several blocks allocates the sum of their
            steps' temporaries (whole-list ``foreach`` kernels), not the largest block's (one
            tensor at a time); measured by :func:`profile_blocks`, else assumed (an upper bound).
        version_copy: seconds to copy every weight of the model once: PipeDream-2BW's deferred
            step first copies the newest version into the slot it steps (``runtime/versions.py``),
            charged to its optimizer step by weight share.
        compute_scale: a forward or backward action in the job takes this many times its
            blocks' profiled seconds (fitted to trial runs of the job, see
            :mod:`lightning_pipe.planning.calibration`; 1: not fitted).
        optimizer_scale: the job's optimizer step over :attr:`optimizer_step` (fitted likewise).
        allreduce_scale: the job's gradient all-reduce waits over the ring model's seconds at
            :attr:`allreduce_bandwidth` (fitted likewise).
        allreduce_latency: seconds each all-reduce takes beyond its scaled ring seconds (fitted
            likewise; on a CPU host whose cores the ranks share, milliseconds: every hop of the
            ring waits for its rank to be scheduled).
        step_overhead: seconds a step of the job takes beyond its program's actions (the
            training loop, its hooks and data loading; fitted likewise, 0: not fitted), for a
            layout no trial ran (:meth:`overhead_of`).
        layout_overheads: the step overhead fitted per layout of the trials, keyed
            ``"<width>x<depth>"`` (:meth:`overhead_of`).
    """

    blocks: list[BlockProfile]
    optimizer_step: float = 0.0
    action_overhead: float = 0.0
    input_bytes_per_sample: float = 0.0
    batch_bytes_per_sample: float = 0.0
    link_latency: float = 0.0
    link_bandwidth: float = float("inf")
    allreduce_bandwidth: float = 0.0
    send_overhead: float = 0.0
    send_seconds_per_byte: float = 0.0
    exchange_latency: float = 0.0
    message_stall: float = 0.0
    loads_global_batch: bool = False
    cores: Optional[float] = None
    device: str = "cpu"
    device_bytes: int = 0
    shared_blocks: Optional[list[list[int]]] = None
    step_bytes_add_up: bool = True
    version_copy: float = 0.0
    compute_scale: float = 1.0
    optimizer_scale: float = 1.0
    allreduce_scale: float = 1.0
    allreduce_latency: float = 0.0
    step_overhead: float = 0.0
    layout_overheads: dict[str, float] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def overhead_of(self, width: int, depth: int) -> float:
        """Seconds a step of a ``width`` x ``depth`` layout takes beyond its program's actions: as
        fitted to trials of that layout; else the median of the fitted layouts of its kind
        (pipelined, ``depth > 1``, or data-parallel only); else :attr:`step_overhead`. What a
        step costs outside its program depends on its layout's processes: which collectives they
        join, how many share the host's cores while each runs its own training loop. A pipeline's
        stages also wait for each other around the program (its first receive, the loss
        broadcast): on a 2-core host a data-parallel layout's fitted overhead measured a quarter
        to three quarters of a pipelined one's, in every workload of the planner's user-path
        benchmark."""
        fitted = self.layout_overheads.get(layout_key(width, depth))
        if fitted is not None:
            return fitted
        alike = [v for key, v in self.layout_overheads.items() if (_layout_depth(key) > 1) == (depth > 1)]
        return statistics.median(alike) if alike else self.step_overhead

    def to_json(self) -> str:
        """A JSON document of the whole profile."""
        return json.dumps(asdict(self), indent=1, default=str)

    @classmethod
    def from_json(cls, text: str) -> "Profile":
        """The profile :meth:`to_json` wrote."""
        data = json.loads(text)
        for b in data["blocks"]:  # written before convolutions deferred too
            if "linear_weights" in b:
                b["deferred_weights"] = b.pop("linear_weights")
        blocks = [BlockProfile(**{**b, "samples": [_sample_of(s) for s in b["samples"]]}) for b in data.pop("blocks")]
        data["link_bandwidth"] = float(data["link_bandwidth"])
        return cls(blocks=blocks, **data)


def layout_key(width: int, depth: int) -> str:
    """The key of a ``width`` x ``depth`` layout in :attr:`Profile.layout_overheads`."""
    return f"{width}x{depth}"


def _layout_depth(key: str) -> int:
    """The depth of a :func:`layout_key`."""
    return int(key.split("x")[1])


def alone(profile: Profile, slowdown: float, processes: int) -> Profile:
    """A profile taken by ``processes`` ranks of one host computing at once, as each rank's times
    alone: every time over ``slowdown`` (how many times slower a rank computed while all did, see
    :func:`~lightning_pipe.planning.profiler.host_slowdown`), with ``processes / slowdown``
    effective cores (:attr:`Profile.cores`). The per-action overhead stays as measured: the
    profiler times it in CPU time, which ranks sharing the cores do not inflate."""
    cores, slowdown = effective_cores(processes, slowdown), max(slowdown, 1.0)
    times = ("forward", "backward", "input_grad", "weight_grad")
    blocks = [
        dataclasses.replace(
            b, samples=[dataclasses.replace(s, **{f: getattr(s, f) / slowdown for f in times}) for s in b.samples]
        )
        for b in profile.blocks
    ]
    return dataclasses.replace(
        profile,
        blocks=blocks,
        optimizer_step=profile.optimizer_step / slowdown,
        version_copy=profile.version_copy / slowdown,
        cores=cores,
        meta={**profile.meta, "slowdown": slowdown},
    )


def effective_cores(processes: int, slowdown: float) -> float:
    """The cores ``processes`` ranks of one host effectively share: their number over how many
    times slower each computes while all do than alone (a ratio under 1 is noise: no rank runs
    faster beside others)."""
    return processes / max(slowdown, 1.0)


def mean_profile(profiles: Sequence[Profile]) -> Profile:
    """The profiles of one model taken by several processes at once, their times averaged.

    Each time (a block's F, B, I and W at each size, the optimizer step, the executor's
    overhead per action) is the mean over the processes; bytes and everything else are the
    first profile's (the processes ran the same model on the same batch).

    Raises:
        ValueError: if there is no profile, or they differ in blocks or microbatch sizes.
    """
    return combined_profile(profiles, statistics.fmean)


def median_profile(profiles: Sequence[Profile]) -> Profile:
    """The profiles of one model taken one after another, each time their median (robust to a slow round).

    Raises:
        ValueError: if there is no profile, or they differ in blocks or microbatch sizes.
    """
    return combined_profile(profiles, statistics.median)


def combined_profile(profiles: Sequence[Profile], statistic: Callable[[Sequence[float]], float]) -> Profile:
    """Every time of ``profiles`` combined by ``statistic``; bytes and the rest from the first.

    Raises:
        ValueError: if there is no profile, or they differ in blocks or microbatch sizes.
    """
    if not profiles:
        raise ValueError("combining profiles needs at least one profile")
    first = profiles[0]
    layout = [[s.microbatch_size for s in b.samples] for b in first.blocks]
    for p in profiles[1:]:
        if [[s.microbatch_size for s in b.samples] for b in p.blocks] != layout:
            raise ValueError("profiles of different blocks or microbatch sizes cannot be averaged")
    times = ("forward", "backward", "input_grad", "weight_grad")

    def sample(b: int, k: int) -> BlockSample:
        return dataclasses.replace(
            first.blocks[b].samples[k],
            **{f: statistic([getattr(p.blocks[b].samples[k], f) for p in profiles]) for f in times},
        )

    blocks = [
        dataclasses.replace(bp, samples=[sample(b, k) for k in range(len(bp.samples))])
        for b, bp in enumerate(first.blocks)
    ]
    return dataclasses.replace(
        first,
        blocks=blocks,
        meta=dict(first.meta),
        optimizer_step=statistic([p.optimizer_step for p in profiles]),
        version_copy=statistic([p.version_copy for p in profiles]),
        action_overhead=statistic([p.action_overhead for p in profiles]),
        cores=statistic([p.cores for p in profiles]) if all(p.cores is not None for p in profiles) else first.cores,
    )
