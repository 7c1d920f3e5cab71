"""Block timing: each block's F, B, I and W seconds and its saved and temporary bytes, as the executor runs them."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import statistics
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lightning_pipe.core.sizes import storages
from lightning_pipe.planning.profile import BlockProfile, BlockSample, Profile, alone, mean_profile, median_sample
from lightning_pipe.runtime.autograd import backward_split as split
from lightning_pipe.runtime.autograd.deferred_weights import (
    DeferredGrads,
    DeferWeightGrads,
    deferrable_weights_only,
    undeferred_gradient_bytes,
    weight_kinds,
)
from lightning_pipe.runtime.microbatch import batch_size, split_batch
from lightning_pipe.runtime.placement import pipeline_blocks_of
from lightning_pipe.runtime.stage import as_tuple
from lightning_pipe.runtime.ties import shared_blocks


def _tensor_bytes(values: Sequence[Any]) -> int:
    return sum(t.numel() * t.element_size() for t in values if isinstance(t, Tensor))


def _timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, out


def _inputs_for(x: tuple[Tensor, ...], first: bool) -> tuple[Tensor, ...]:
    return tuple(t.detach().requires_grad_(not first and t.is_floating_point()) for t in x)


class _SavedByBlock:
    """Storages autograd saves inside a block, parameters (and their views) and ``external``
    storages (the batch's: a loss saves its targets, views of the batch) excluded: they are held
    anyway. Inside a stage a block's input is the previous block's output, so a stage holds it
    for backward only if saved; the stage's own input is held regardless."""

    def __init__(
        self, inputs: Sequence[Tensor], weights: Iterable[Tensor], external: frozenset[int] = frozenset()
    ) -> None:
        self.inputs = {t.untyped_storage().data_ptr() for t in inputs}
        self.held = {t.untyped_storage().data_ptr() for t in weights} | external  # held anyway: never counted
        self.saved: dict[int, int] = {}

    def pack(self, t: Tensor) -> Tensor:
        key = t.untyped_storage().data_ptr()
        if key not in self.held and (key in self.inputs or not (t.is_leaf and t.requires_grad)):
            self.saved[key] = t.untyped_storage().nbytes()
        return t

    def hooks(self) -> Any:
        """The context that records what is saved."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    def bytes_of(self, tensors: Sequence[Tensor]) -> int:
        """Saved bytes that belong to ``tensors``' storages."""
        mine = {t.untyped_storage().data_ptr() for t in tensors}
        return sum(n for key, n in self.saved.items() if key in mine)

    def other_bytes(self) -> int:
        """Saved bytes of neither the inputs nor any other excluded storage."""
        return sum(n for key, n in self.saved.items() if key not in self.inputs)


Loss = Optional[Callable[[tuple[Tensor, ...]], Tensor]]


def _roots(out: tuple[Tensor, ...], loss: Loss) -> tuple[list[Tensor], list[Optional[Tensor]]]:
    """What a block's backward starts from: the loss (last block), else its float outputs with ones."""
    if loss is not None:
        return [loss(out)], [None]
    floats = [o for o in out if o.requires_grad]
    return floats, [torch.ones_like(o) for o in floats]


@dataclass
class _Forwarded:
    """A block's timed forward, its graph kept for the backward sweep, and the bytes it saved."""

    seconds: float
    roots: list[Tensor]
    grads: list[Optional[Tensor]]
    out_bytes: int
    saved_input_bytes: int
    saved_output_bytes: int
    saved_other_bytes: int


def _timed_forward(
    block: nn.Module,
    x: tuple[Tensor, ...],
    first: bool,
    device: torch.device,
    loss: Loss = None,
    external: frozenset[int] = frozenset(),
) -> tuple[_Forwarded, tuple[Tensor, ...]]:
    """Time ``block``'s forward on input ``x`` once (with ``loss``, the last block's loss is part
    of it, as on the last stage); returns the forward, its graph kept, and the detached output."""
    name = type(block).__name__
    inputs = _inputs_for(x, first)
    saved = _SavedByBlock(inputs, block.parameters(), external)
    with saved.hooks():
        t_f, (out, (roots, grads)) = _timed(lambda: _forward(block, inputs, loss, name), device)
    forwarded = _Forwarded(
        t_f, roots, grads, _tensor_bytes(out), saved.bytes_of(inputs), saved.bytes_of(out), saved.other_bytes()
    )
    return forwarded, tuple(o.detach() for o in out)


def _timed_backward(block: nn.Module, forwarded: _Forwarded, device: torch.device) -> float:
    """Time the backward of a forward :func:`_timed_forward` kept, then free its graph and gradients."""
    roots, grads = forwarded.roots, forwarded.grads
    t_b, _ = _timed(lambda: torch.autograd.backward(roots, grads) if roots else None, device)
    forwarded.roots, forwarded.grads = [], []
    block.zero_grad(set_to_none=True)
    return t_b


def _block_sample(
    block: nn.Module,
    x: tuple[Tensor, ...],
    first: bool,
    device: torch.device,
    loss: Loss,
    forwarded: _Forwarded,
    t_b: float,
) -> tuple[BlockSample, tuple[Tensor, ...]]:
    """The block's sample: its timed forward and backward, then I and W timed once after a
    forward of their own on input ``x``; and that forward's detached output."""
    needing, deferred, out, (roots, grads) = _split_forward(block, x, first, loss)
    t_i, (found, work) = _timed(lambda: split.input_grads(roots, grads, needing, deferred), device)
    captured = _captured_bytes(work, found)
    mine = {t.untyped_storage().data_ptr() for t in needing}
    captured_input = sum(n for key, n in storages(work.kept()).items() if key in mine)
    t_w, _ = _timed(lambda: split.weight_grads(work), device)
    block.zero_grad(set_to_none=True)
    sample = BlockSample(
        batch_size(x),
        forwarded.seconds,
        t_b,
        t_i,
        t_w,
        forwarded.saved_other_bytes,
        forwarded.out_bytes,
        forwarded.saved_input_bytes,
        saved_output_bytes=forwarded.saved_output_bytes,
        captured_bytes=captured,
        captured_input_bytes=captured_input,
    )
    return sample, tuple(o.detach() for o in out)


def _loss_bytes(
    out: tuple[Tensor, ...], loss: Callable[[tuple[Tensor, ...]], Tensor], external: frozenset[int] = frozenset()
) -> tuple[int, int]:
    """What the loss saves for its backward, and the loss itself, on the last block's output ``out``."""
    detached = tuple(o.detach().requires_grad_(o.is_floating_point()) for o in out)
    saved = _SavedByBlock(detached, (), external)
    with saved.hooks():
        value = loss(detached)
    return sum(saved.saved.values()), value.untyped_storage().nbytes()


def _captured_bytes(work: split.WeightWork, input_grads: Sequence[Optional[Tensor]]) -> int:
    """Bytes of the gradients I captured for W, each storage once (the input gradients are sent on, not kept)."""
    sent = {g.untyped_storage().data_ptr() for g in input_grads if g is not None}
    return sum(n for key, n in storages(work.kept()).items() if key not in sent)


def _forward(block: nn.Module, inputs: tuple[Tensor, ...], loss: Loss, name: str) -> tuple[tuple, tuple[list, list]]:
    out = as_tuple(block(*inputs), name)
    return out, _roots(out, loss)


class _Allocations(TorchDispatchMode):
    """Bytes of the tensor storages that ops create inside it: alive now (``current``), at most
    (``peak``), and at most had the gradients handed to :meth:`take` stayed (``peak_kept``)."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: dict[int, int] = {}
        self.current = self.peak = self.peak_kept = self.taken = 0  # taken: the bytes of the gradients taken away
        self.moments: list[int] = []  # from the first :meth:`take` on, alive at each take and each new storage
        self._taken: dict[
            int, int
        ] = {}  # bytes of each parameter's gradient taken away (the largest, as accumulation keeps one)
        self._refs: list[Any] = []

    def restart_peaks(self) -> None:
        """Start :attr:`peak` and :attr:`peak_kept` again from what is alive now."""
        self.peak = self.peak_kept = self.current + self.taken

    def take(self, p: Tensor) -> None:
        """Drop ``p.grad``, counting its bytes in :attr:`peak_kept`, and record this moment in :attr:`moments`."""
        self.moments.append(self.current)
        size = self.sizes.get(p.grad.untyped_storage().data_ptr(), 0) if p.grad is not None else 0
        before = self._taken.get(id(p), 0)
        self._taken[id(p)] = max(before, size)
        self.taken += self._taken[id(p)] - before
        p.grad = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, Tensor):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key not in given and key not in self.sizes and storage.nbytes():
                    self.sizes[key] = storage.nbytes()
                    self.current += storage.nbytes()
                    self.peak = max(self.peak, self.current)
                    self.peak_kept = max(self.peak_kept, self.current + self.taken)
                    if self.moments:  # a gradient was taken: from then on every new storage is a moment
                        self.moments.append(self.current)
                    self._refs.append(weakref.ref(storage, lambda _, key=key: self._free(key)))
        return out

    def _free(self, key: int) -> None:
        self.current -= self.sizes.pop(key, 0)


def _workspace(
    block: nn.Module, x: tuple[Tensor, ...], first: bool, loss: Loss
) -> tuple[int, int, tuple[int, ...], int]:
    """Bytes a block's passes allocate beyond what it keeps (its output, its saved tensors and the
    gradient its backward starts from), from one forward and backward with each new weight
    gradient taken away once accumulated (as when it is added into an existing gradient, or into
    a replica all-reduce bucket: runtime/buckets.py): the forward's peak temporaries, the
    backward's (the input gradient among them), what is alive, the block's output excluded, at
    each moment from its first weight-gradient accumulation on (each accumulation and each new
    storage; their largest is the after-gradient peak: saved tensors not freed yet beside the
    bucket that gradient makes whole; no moment without weight gradients), and the backward's
    peak had its new gradients stayed (a step's first backward without replicas: temporaries and
    the gradients)."""
    block.zero_grad(set_to_none=True)
    with _Allocations() as mem:
        out, (roots, grads) = _forward(block, _inputs_for(x, first), loss, type(block).__name__)
        kept, forward_extra = mem.current, mem.peak - mem.current
        outputs = sum(mem.sizes.get(t.untyped_storage().data_ptr(), 0) for t in out if isinstance(t, Tensor))
        mem.restart_peaks()
        handles = [p.register_post_accumulate_grad_hook(mem.take) for p in block.parameters() if p.requires_grad]
        if roots:
            torch.autograd.backward(roots, grads)
        for handle in handles:
            handle.remove()
    after_gradient = tuple(max(n - outputs, 0) for n in mem.moments)
    return forward_extra, mem.peak - kept, after_gradient, mem.peak_kept - kept


def _split_forward(
    block: nn.Module, x: tuple[Tensor, ...], first: bool, loss: Loss
) -> tuple[list[Tensor], Optional[DeferredGrads], tuple, tuple[list, list]]:
    """A forward on input ``x`` as the runtime runs it for split backward: the inputs that need a
    gradient, the store of deferred weight gradients (``None`` where the block defers none), the
    output, and what the backward starts from."""
    inputs = _inputs_for(x, first)
    needing = [t for t in inputs if t.requires_grad]
    deferred = (
        DeferredGrads([p for p in block.parameters() if p.requires_grad])
        if needing and deferrable_weights_only(block.modules())
        else None
    )
    with DeferWeightGrads(deferred) if deferred is not None else contextlib.nullcontext():
        out, roots = _forward(block, inputs, loss, type(block).__name__)
    return needing, deferred, out, roots


def _split_workspaces(block: nn.Module, x: tuple[Tensor, ...], first: bool, loss: Loss) -> tuple[int, int]:
    """Bytes a block's I and W allocate beyond what they keep, where split backward defers its
    weight gradients (0 elsewhere).

    I: the input gradient, and the output gradients kept for W, which build up while the graph is
    still being freed. On linear blocks a full backward's new weight gradients take more; on
    convolutions, whose weights are small, this does (measured: two 1-D convolution blocks,
    114,688 bytes against a full backward's 32,768).

    W, with every gradient of the block existing (a replica bucket's views, or an earlier
    microbatch's gradients): it adds its products into them in place (``addmm_``), and what it
    allocates beside them is its temporaries (a bias's gradient, summed over the rows, before it
    is added)."""
    if not any(t.requires_grad for t in _inputs_for(x, first)) or not deferrable_weights_only(block.modules()):
        return 0, 0
    with _Allocations() as mem:
        needing, deferred, _, (roots, grads) = _split_forward(block, x, first, loss)
        kept = mem.current
        mem.restart_peaks()
        _, work = split.input_grads(roots, grads, needing, deferred)
    for p in block.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    with _Allocations() as weight_mem:
        split.weight_grads(work)
    block.zero_grad(set_to_none=True)
    return max(mem.peak - kept, 0), weight_mem.peak


def _loss_of(module: nn.Module, microbatch: Any, out: tuple[Tensor, ...]) -> Tensor:
    return module.pipeline_loss(out[0] if len(out) == 1 else out, microbatch)


def profile_blocks(
    module: nn.Module,
    batch: Any,
    microbatch_sizes: Sequence[int],
    repeats: int = 3,
    optimizer: Optional[Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = None,
    device: Optional[torch.device] = None,
    with_loss: bool = True,
    sync: Optional[Callable[[], None]] = None,
) -> Profile:
    """Profile every block of ``module``'s chain in this process at each microbatch size.

    Each block runs on the previous block's real output (from ``pipeline_inputs(batch)`` cut to
    the microbatch size), ``repeats`` times after one warm-up; the median is kept. Every block's
    forward runs in chain order, then every backward in reverse, as a stage runs them: a
    backward right after its own forward would find its activations still in the cache, and
    run faster than in a stage. Optimizer bytes
    come from the real optimizer after one step (Adam's state exists only then).

    Args:
        module: a PipelineMixin module, its blocks on ``device``.
        batch: a batch at least as large as the largest microbatch size.
        microbatch_sizes: two or more sizes, so times and bytes can be fitted as functions of b.
        repeats: measured runs per block and size.
        optimizer: builds the optimizer over a list of parameters (default: the module's
            ``configure_optimizers`` class and defaults, else Adam).
        device: where the blocks run.
        with_loss: ``batch`` holds what ``pipeline_loss`` needs: the last block is measured with
            the loss on its output (as the last stage runs it), and the executor's overhead per
            action is measured. Without it the loss and the overhead are left out.
        sync: called before each timed pass over the chain, the optimizer timing and the
            overhead run (``dist.barrier`` when several processes profile at once, so that they
            time the same work together and each sees the others computing).
    """
    device = device or torch.device("cpu")
    blocks = pipeline_blocks_of(module)
    by_size: list[list[BlockSample]] = [[] for _ in blocks]
    for size in microbatch_sizes:
        mb = split_batch(batch, max(batch_size(batch) // size, 1))[0][0]
        loss = functools.partial(_loss_of, module, mb) if with_loss else None
        for i, sample in enumerate(_profile_microbatch(module, blocks, mb, loss, repeats, device, sync)):
            by_size[i].append(sample)
    mixed = _mixed_outputs(blocks, as_tuple(module.pipeline_inputs(batch), "pipeline_inputs"))
    profiles = [
        _block_profile(f"{i}:{type(b).__name__}", b, by_size[i], optimizer, mixed_output=mixed[i])
        for i, b in enumerate(blocks)
    ]
    step, step_bytes = _optimizer_step_seconds(module, optimizer, device, sync=sync)
    copy = _version_copy_seconds(module, device)
    leaves = [t for t in tree_leaves(batch) if isinstance(t, Tensor)]
    batch_storages = {t.untyped_storage().data_ptr() for t in leaves}
    data = as_tuple(module.pipeline_inputs(batch), "pipeline_inputs")
    per_sample = _tensor_bytes([t for t in data if t.untyped_storage().data_ptr() not in batch_storages]) / batch_size(
        batch
    )
    batch_per_sample = _tensor_bytes(leaves) / batch_size(batch)
    if with_loss and sync is not None:
        sync()
    per_action = _action_overhead(module, blocks, batch, min(microbatch_sizes), repeats, device) if with_loss else 0.0
    # One tensor at a time (torch's default on CPU) a step's temporaries are about its largest block's; with
    # whole-list (foreach) kernels they add up: the step over every block tells which it is nearer.
    sizes = [b.optimizer_step_bytes for b in profiles]
    adds_up = len(sizes) > 1 and step_bytes >= (sum(sizes) + max(sizes)) / 2
    return Profile(
        profiles,
        optimizer_step=step,
        version_copy=copy,
        action_overhead=per_action,
        input_bytes_per_sample=per_sample,
        batch_bytes_per_sample=batch_per_sample,
        device=str(device),
        shared_blocks=shared_blocks(module, blocks),
        step_bytes_add_up=adds_up,
    )


def _profile_microbatch(
    module: nn.Module,
    blocks: list[nn.Module],
    mb: Any,
    loss: Loss,
    repeats: int,
    device: torch.device,
    sync: Optional[Callable[[], None]] = None,
) -> list[BlockSample]:
    """Every block run in chain order on microbatch ``mb``, ``repeats`` times after a warm-up
    run that also measures each block's workspace; the median sample of each block."""
    start = lambda: as_tuple(module.pipeline_inputs(mb), "pipeline_inputs")  # noqa: E731
    batch = frozenset(t.untyped_storage().data_ptr() for t in tree_leaves(mb) if isinstance(t, Tensor))
    return _profile_chain(blocks, start, True, loss, repeats, device, sync, batch)


def _profile_chain(
    blocks: list[nn.Module],
    start: Callable[[], tuple[Tensor, ...]],
    first: bool,
    loss: Loss,
    repeats: int,
    device: torch.device,
    sync: Optional[Callable[[], None]] = None,
    external: frozenset[int] = frozenset(),
    stage_order: bool = True,
) -> list[BlockSample]:
    """:func:`_profile_microbatch` from the inputs ``start()`` gives the first block (``first``: the
    chain's first block, whose inputs need no gradient); ``loss`` follows the last block if given;
    ``sync`` is called before every pass; ``external``: storages saved tensors may share that
    training holds anyway (the batch's), not counted as saved. ``stage_order``: every forward,
    then every backward in reverse, as a stage runs them (every block's graph alive at once);
    else each block's backward right after its forward, one block's graph at a time."""
    runs: list[list[BlockSample]] = [[] for _ in blocks]
    workspace: list[tuple[int, int, tuple[int, ...], int]] = [(0, 0, (), 0)] * len(blocks)
    split_workspace = [(0, 0)] * len(blocks)
    alone, losses = (0, 0, (), 0), (0, 0)  # the last block's workspace without the loss; the loss's bytes
    for run in range(repeats + 1):
        if sync is not None:
            sync()
        x, pending = start(), []
        for i, block in enumerate(blocks):
            last = loss if i == len(blocks) - 1 else None
            if run == 0:
                workspace[i] = _workspace(block, x, first and i == 0, last)
                split_workspace[i] = _split_workspaces(block, x, first and i == 0, last)
                if last is not None:
                    alone = _workspace(block, x, first and i == 0, None)
            forwarded, out = _timed_forward(block, x, first and i == 0, device, last, external)
            if run == 0 and last is not None:
                losses = _loss_bytes(out, last, external)
            if stage_order:
                pending.append((x, forwarded, last))
                x = out
            else:
                t_b = _timed_backward(block, forwarded, device)
                del out  # not alive during I and W's forward: profiling stays within a step's memory
                sample, x = _block_sample(block, x, first and i == 0, device, last, forwarded, t_b)
                runs[i].append(sample)
        backward = [_timed_backward(blocks[i], pending[i][1], device) for i in reversed(range(len(pending)))][::-1]
        for i, ((x, forwarded, last), t_b) in enumerate(zip(pending, backward)):
            runs[i].append(_block_sample(blocks[i], x, first and i == 0, device, last, forwarded, t_b)[0])
    samples = [
        dataclasses.replace(
            median_sample(measured[1:]),
            forward_workspace_bytes=fw,
            backward_workspace_bytes=bw,
            after_gradient_bytes=max(ag, default=0),
            gradient_moment_bytes=ag,
            cold_backward_bytes=cold,
            input_grad_workspace_bytes=iw,
            weight_grad_workspace_bytes=ww,
        )
        for measured, (fw, bw, ag, cold), (iw, ww) in zip(runs, workspace, split_workspace)
    ]
    if loss is not None:
        samples[-1] = dataclasses.replace(
            samples[-1],
            block_backward_workspace_bytes=alone[1],
            block_after_gradient_bytes=max(alone[2], default=0),
            block_cold_backward_bytes=alone[3],
            loss_saved_bytes=losses[0],
            loss_bytes=losses[1],
        )
    return samples


def profile_stage(
    blocks: Sequence[nn.Module],
    first_block: int,
    inputs: Sequence[tuple[Tensor, ...]],
    loss: Optional[Callable[[int, tuple[Tensor, ...]], Tensor]],
    repeats: int = 2,
    optimizer: Optional[Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = None,
    device: Optional[torch.device] = None,
    state_bytes: Optional[Sequence[tuple[int, int, int, int]]] = None,
) -> list[BlockProfile]:
    """Profile one stage's blocks on inputs captured from real training steps (the autoplanner:
    every rank profiles its own blocks, inside the running job).

    Inside a job whose plan may not fit its budget, each block's backward runs right after its
    forward, so that profiling holds one block's graph at a time, not the stage's (that order
    finds the block's activations still in the cache, so its backwards read a little fast).

    Args:
        blocks: the stage's blocks, in order.
        first_block: index of ``blocks[0]`` in the whole chain (0: inputs need no gradient).
        inputs: the stage's inputs at two or more microbatch sizes (e.g. the first half of a
            microbatch and all of it), as the stage received them.
        loss: on the last stage, ``loss(size, output)`` gives the loss of a microbatch of that size.
        repeats, optimizer, device: as for :func:`profile_blocks`.
        state_bytes: each block's parameter, gradient, optimizer-state and optimizer-step bytes
            where an earlier profile measured them: no trial optimizer steps, which hold a
            second optimizer state for the block beside the job's, above the step's own peak.
    """
    device = device or torch.device("cpu")
    by_size: list[list[BlockSample]] = [[] for _ in blocks]
    for x in inputs:
        size = batch_size(x)
        last = functools.partial(loss, size) if loss is not None else None
        samples = _profile_chain(
            list(blocks),
            lambda: tuple(t.detach() for t in x),
            first_block == 0,
            last,
            repeats,
            device,
            stage_order=False,
        )
        for i, sample in enumerate(samples):
            by_size[i].append(sample)
    mixed = _mixed_outputs(list(blocks), tuple(t.detach() for t in inputs[0]))
    return [
        _block_profile(
            f"{first_block + i}:{type(b).__name__}",
            b,
            by_size[i],
            optimizer,
            state_bytes[i] if state_bytes else None,
            mixed[i],
        )
        for i, b in enumerate(blocks)
    ]


def _block_profile(
    name: str,
    block: nn.Module,
    samples: list[BlockSample],
    optimizer: Any,
    state: Optional[tuple[int, int, int, int]] = None,
    mixed_output: bool = False,
) -> BlockProfile:
    """A block's profile: its samples, the bytes of its state (``state`` if known), the kinds of its
    weights, whether its output holds a tensor that is not floating point, and the bytes of the
    weight gradients a deferring I computes itself."""
    deferred, other = weight_kinds(block.modules())
    return BlockProfile(
        name,
        samples,
        *(state or _state_bytes(block, optimizer)),
        deferred_weights=deferred,
        other_matrices=other,
        mixed_output=mixed_output,
        undeferred_gradient_bytes=undeferred_gradient_bytes(block),
    )


def _mixed_outputs(blocks: Sequence[nn.Module], x: tuple[Tensor, ...]) -> list[bool]:
    """Whether each block's output, run on the previous one's from ``x``, holds a tensor that is
    not floating point (the gradient message for it then has a layout of its own)."""
    mixed = []
    with torch.no_grad():
        for block in blocks:
            x = as_tuple(block(*x), type(block).__name__)
            mixed.append(any(isinstance(t, Tensor) and not t.is_floating_point() for t in x))
    return mixed


def _profile_worker(
    rank: int,
    world: int,
    factory: Callable[[], nn.Module],
    batch: Any,
    sizes: Sequence[int],
    threads: int,
    options: dict[str, Any],
) -> Profile:
    import torch.distributed as dist

    torch.set_num_threads(threads)
    module = factory()
    # Every process times the same pass at once, so each times its blocks while the others compute.
    profile = profile_blocks(module, batch, sizes, sync=dist.barrier, **options)
    microbatch = split_batch(batch, max(batch_size(batch) // max(sizes), 1))[0][0]
    blocks = pipeline_blocks_of(module)
    work = functools.partial(_plain_run, module, blocks, [microbatch], [1.0])
    profile.meta["slowdown"] = host_slowdown(work, dist.barrier, rank, world)
    module.zero_grad(set_to_none=True)
    return profile


def host_slowdown(work: Callable[[], Any], sync: Callable[[], None], rank: int, world: int, repeats: int = 3) -> float:
    """How many times slower this process runs ``work`` while all ``world`` processes of the host run
    it at once than while it runs alone, the others waiting: the contention of ranks sharing the
    host's cores and memory bandwidth (and any other load on it), measured. Each time is the
    median of ``repeats`` runs after a warm-up; ``sync`` is a barrier of the processes."""
    cpu = torch.device("cpu")
    work()
    sync()
    together = statistics.median(_timed(work, cpu)[0] for _ in range(repeats))
    by_itself = together
    for turn in range(world):
        sync()
        if turn == rank:
            by_itself = statistics.median(_timed(work, cpu)[0] for _ in range(repeats))
    sync()
    return together / by_itself if by_itself > 0 else 1.0


def profile_concurrently(
    factory: Callable[[], nn.Module],
    batch: Any,
    microbatch_sizes: Sequence[int],
    processes: int,
    threads: int = 1,
    timeout: float = 600.0,
    **options: Any,
) -> Profile:
    """:func:`profile_blocks` run at once in ``processes`` processes, as many as the job will run on
    this machine, with the contention of ranks sharing its cores measured. The processes time
    each pass together, behind a barrier, and their times are averaged (:func:`mean_profile`):
    which process runs slower changes from one profile to the next, so one process's times alone
    are a sample, not the job's. Each then measures how much slower it computes while all do than
    alone (:func:`host_slowdown`); the profile holds the times of a rank alone and the host's
    effective cores (:func:`~lightning_pipe.planning.profile.alone`), from which the simulator
    slows each rank by how many compute with it (a deep pipeline has few busy at once).

    Args:
        factory: builds the model in each process (importable: a class or module-level function).
        batch, microbatch_sizes, options: as for :func:`profile_blocks`.
        processes: processes sharing the machine (1 profiles here, in this process).
        threads: torch threads per process (as each rank will use).
        timeout: seconds before the processes are abandoned.

    Returns:
        The processes' mean profile, as a rank's times alone, with the effective cores.
    """
    if processes <= 1:
        return profile_blocks(factory(), batch, microbatch_sizes, **options)
    from lightning_pipe.runtime.spawn import run_gloo

    ran = run_gloo(
        _profile_worker, processes, factory, batch, list(microbatch_sizes), threads, options, timeout=timeout
    )
    failed = [f"rank {r}: {value}" for r, (status, value) in enumerate(ran) if status != "ok"]
    if failed:  # every rank's: one rank's error leaves the others timing out at a barrier
        raise RuntimeError("concurrent profiling failed:\n" + "\n".join(failed))
    profiles = [value for _, value in ran]
    slowdown = statistics.fmean(p.meta.pop("slowdown") for p in profiles)
    return alone(mean_profile(profiles), slowdown, processes)


#: Microbatches in each run of :func:`_action_overhead`'s pairs, and pairs per profiling repeat: runs
#: short enough to time many pairs (the median's spread falls as their square root) in the time
#: the blocks' own profile takes.
_OVERHEAD_MICROBATCHES, _OVERHEAD_PAIRS_PER_REPEAT = 4, 4


def _action_overhead(
    module: nn.Module,
    blocks: list[nn.Module],
    batch: Any,
    size: int,
    repeats: int,
    device: torch.device,
) -> float:
    """Seconds per F or B action that a one-stage executor run takes beyond the same work run plainly.

    Pairs of short runs: a few microbatches of ``size`` samples through the executor (1F1B on one
    stage: F and B alternating), and the same microbatches block by block in a plain loop, the
    pair's order alternating. The estimate is the median over the pairs of their difference per
    action: the overhead is a few percent of a run, so a difference of two separate minima (or
    means) is mostly noise, while a pair's two runs see the same state of the host.

    On a CPU the runs are timed in this process's CPU time (:func:`_cpu_timed`): another
    process taking a core's time slices in one run of a pair and not in the other would add
    whole milliseconds to a wall-clock difference, and ranks profiling at once or a busy host
    would read as executor overhead. The estimate is then each rank's alone, as the profile's
    :func:`~lightning_pipe.planning.profile.alone` keeps it.
    """
    from lightning_pipe.runtime.executor import Executor, Hooks, Position, StepState
    from lightning_pipe.runtime.stage import Stage
    from lightning_pipe.schedules import Kind, build_schedule

    microbatches, shares = split_batch(batch, max(batch_size(batch) // size, 1))
    count = min(len(microbatches), _OVERHEAD_MICROBATCHES)
    microbatches, shares = microbatches[:count], shares[:count]
    actions = [a for a in build_schedule("1f1b", 1, count)[0] if a.kind in (Kind.FORWARD, Kind.BACKWARD)]
    executor = Executor(
        Stage(blocks, 0), Position(0, 1, None, None), device, Hooks(module.pipeline_inputs, module.pipeline_loss)
    )

    def through_executor() -> None:
        state = StepState({}, {})
        state.add_batch(0, microbatches, shares)
        executor.run(actions, state)

    def plainly() -> None:
        _plain_run(module, blocks, microbatches, shares)

    differences = []
    for pair in range(_OVERHEAD_PAIRS_PER_REPEAT * max(repeats, 5) + 1):  # the first pair warms up
        order = (through_executor, plainly) if pair % 2 else (plainly, through_executor)
        seconds = {run: _cpu_timed(run, device) for run in order}
        differences += [seconds[through_executor] - seconds[plainly]] if pair else []
    module.zero_grad(set_to_none=True)
    return max(statistics.median(differences), 0.0) / len(actions)


def _cpu_timed(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds ``fn`` took: this process's CPU time on a CPU (every thread's, torch's intra-op
    threads included), which other processes sharing the cores do not add to; wall time on an
    accelerator, whose kernels run beside the host."""
    if device.type != "cpu":
        return _timed(fn, device)[0]
    start = time.process_time()
    fn()
    return time.process_time() - start


def _plain_run(module: nn.Module, blocks: list[nn.Module], microbatches: list[Any], shares: list[float]) -> None:
    """The work of a one-stage executor run without the executor: each microbatch's blocks, its loss, its backward."""
    for microbatch, share in zip(microbatches, shares):
        x = as_tuple(module.pipeline_inputs(microbatch), "pipeline_inputs")
        for block in blocks:
            x = as_tuple(block(*x), type(block).__name__)
        loss = module.pipeline_loss(x[0] if len(x) == 1 else x, microbatch) * share
        loss.backward()


def _make_optimizer(params: list[nn.Parameter], optimizer: Optional[Callable]) -> torch.optim.Optimizer:
    return optimizer(params) if optimizer is not None else torch.optim.Adam(params)


@contextlib.contextmanager
def _trial_steps(
    params: list[nn.Parameter], optimizer: Optional[Callable]
) -> Iterator[tuple[torch.optim.Optimizer, int]]:
    """An optimizer over ``params`` after one step on zero gradients (Adam's state exists only
    then), and the most bytes a second step allocates for the time it runs; on exit the
    parameters get their values back and lose the gradients."""
    saved = [p.detach().to("cpu", copy=True) for p in params]  # on the host: the trial is not the device's peak
    opt = _make_optimizer(params, optimizer)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    with _Allocations() as mem:
        opt.step()
    try:
        yield opt, mem.peak
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)
                p.grad = None


def _state_bytes(block: nn.Module, optimizer: Optional[Callable]) -> tuple[int, int, int, int]:
    """Parameter, gradient and optimizer-state bytes of ``block`` (the optimizer after one step),
    and the most bytes a later step allocates for the time it runs (e.g. the ``foreach``
    implementations' whole-list temporaries: with large weights and small microbatches the step
    can be a stage's peak)."""
    params = [p for p in block.parameters() if p.requires_grad]
    if not params:
        return 0, 0, 0, 0
    with _trial_steps(params, optimizer) as (opt, step_bytes):
        state = [t for s in opt.state.values() for t in s.values()]
        return _tensor_bytes(params), _tensor_bytes(params), _tensor_bytes(state), step_bytes


def _version_copy_seconds(module: nn.Module, device: torch.device, repeats: int = 5) -> float:
    """Median seconds of copying every trainable weight of the chain into a second copy, as
    PipeDream-2BW's deferred step does before stepping (``WeightVersions.begin_step``)."""
    params = [p for b in pipeline_blocks_of(module) for p in b.parameters() if p.requires_grad]
    if not params:
        return 0.0
    slots = [torch.empty_like(p) for p in params]

    def copy() -> None:
        with torch.no_grad():
            for t, p in zip(slots, params):
                t.copy_(p)

    return statistics.median(_timed(copy, device)[0] for _ in range(repeats))


def _optimizer_step_seconds(
    module: nn.Module,
    optimizer: Optional[Callable],
    device: torch.device,
    repeats: int = 5,
    sync: Optional[Callable[[], None]] = None,
) -> tuple[float, int]:
    """Median seconds of ``repeats`` optimizer steps over the module's parameters (a single timing,
    taken while other processes profile on the same cores, read 12.8 ms for the GPT example's
    AdamW step against 7.0-7.5 ms alone and in the measured steps), and the most bytes one step
    allocates for the time it runs."""
    params = [p for b in pipeline_blocks_of(module) for p in b.parameters() if p.requires_grad]
    if not params:
        return 0.0, 0
    with _trial_steps(params, optimizer) as (opt, step_bytes):
        if sync is not None:
            sync()
        return statistics.median(_timed(opt.step, device)[0] for _ in range(repeats)), step_bytes
