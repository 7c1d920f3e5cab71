"""Buffers through the pipeline: BatchNorm's running statistics update once per microbatch, in order."""

from __future__ import annotations

import contextlib
import copy
from typing import Iterator

import pytest
import torch
from torch import Tensor, nn

from lightning_pipe import PipelineGroups, PipelinePlan, Topology, place
from tests.models import HIDDEN, ToyChain, make_data
from tests.shared import scenario

BATCH, M, STEPS = 16, 4, 3
#: (schedule, split backward, recompute)
VARIANTS = [
    ("1f1b", False, False),
    ("1f1b", False, True),
    ("gpipe", False, True),
    ("1f1b", True, True),
    ("2bw", True, True),
]


class Normed(nn.Module):
    """A residual block with BatchNorm: its running statistics are buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(HIDDEN, HIDDEN)
        self.norm = nn.BatchNorm1d(HIDDEN, momentum=0.3)

    def forward(self, h: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        return h + torch.tanh(self.norm(self.fc(h))), mask


class NormChain(ToyChain):
    """Embed, four BatchNorm blocks, head."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Normed() for _ in range(4))


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Compute as the launched workers do, on one intra-op thread (torchrun sets OMP_NUM_THREADS=1).
    Two threads split a kernel's sums differently, and BatchNorm amplifies that: on an AVX-512
    host the parameters drifted 4e-6 from a one-thread run in 3 steps (2026-11-25), against the
    pipeline's bit-exact match of the one-thread reference."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _reference(model: NormChain, batches: list[tuple[Tensor, Tensor]], delay: int) -> NormChain:
    """One process, the batch's microbatches one after the other (gradient accumulation), SGD.
    ``delay=1``: 2BW's 1-stale rule (PipeDream-2BW paper, section 3.1), each batch's forward on W(t-1)."""
    with _one_thread():
        return _accumulated(model, batches, delay)


def _accumulated(model: NormChain, batches: list[tuple[Tensor, Tensor]], delay: int) -> NormChain:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    versions = [copy.deepcopy(model.state_dict())]
    for t, (x, y) in enumerate(batches):
        probe = copy.deepcopy(model)
        probe.load_state_dict({**versions[max(t - delay, 0)], **_buffers(model)})  # newest running statistics
        probe.zero_grad()
        for mx, my in zip(x.tensor_split(M), y.tensor_split(M)):
            (probe.pipeline_loss(probe(mx), (mx, my)) * len(mx) / len(x)).backward()
        model.load_state_dict(_buffers(probe), strict=False)
        for p, q in zip(model.parameters(), probe.parameters()):
            p.grad = q.grad
        opt.step()
        versions.append(copy.deepcopy(model.state_dict()))
    return model


def _buffers(model: nn.Module) -> dict[str, Tensor]:
    return {k: v.clone() for k, v in model.named_buffers()}


def _worker(rank: int, world: int) -> dict:
    groups = PipelineGroups.build(Topology(world, world), rank)
    results = {}
    for schedule, split, recompute in VARIANTS:
        torch.manual_seed(0)
        model = NormChain()
        engine = place(
            model,
            PipelinePlan(1, world, M, schedule, split, partition="uniform", recompute=recompute),
            rank,
            groups=groups,
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(STEPS):
            engine.train_step(make_data(BATCH, seed=step), opt)
        engine.drain()
        results[(schedule, split, recompute)] = {
            "buffers": _buffers(model),
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        }
    return results


scenario(2, "buffers_1x2", _worker)


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(str(x) for x in v))
def test_running_statistics_follow_the_microbatches_in_order(launched, variant: tuple) -> None:
    ranks = launched(2).ok("buffers_1x2")
    torch.manual_seed(0)
    want = _reference(
        NormChain(), [make_data(BATCH, seed=s) for s in range(STEPS)], delay=1 if variant[0] == "2bw" else 0
    )
    got = {**ranks[0][variant]["buffers"], **ranks[1][variant]["buffers"]}
    want_buffers = _buffers(want)
    assert sorted(got) == sorted(want_buffers) and len(got) == 12  # mean, var, count of 4 BatchNorms
    for name, value in want_buffers.items():
        # Each microbatch updated them once (a recomputation would move them a second time).
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    params = {**ranks[0][variant]["params"], **ranks[1][variant]["params"]}
    for name, value in want.named_parameters():
        torch.testing.assert_close(params[name], value.detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


# -- deferred batch norm (torchgpipe): running statistics of the whole batch, once per batch -------------

DEFERRED = [False, True]  # recompute


def _deferred_worker(rank: int, world: int) -> dict:
    from lightning_pipe.runtime.autograd.deferred_norm import convert_deferred_batch_norm

    groups = PipelineGroups.build(Topology(world, world), rank)
    results = {}
    for recompute in DEFERRED:
        torch.manual_seed(0)
        model = convert_deferred_batch_norm(NormChain(), M)
        engine = place(
            model, PipelinePlan(1, world, M, "1f1b", partition="uniform", recompute=recompute), rank, groups=groups
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(STEPS):
            engine.train_step(make_data(BATCH, seed=step), opt)
        results[recompute] = {
            "stats": {k: v.clone() for k, v in model.state_dict().items() if "running" in k or "tracked" in k},
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        }
    return results


scenario(2, "buffers_deferred_1x2", _deferred_worker)


def _deferred_reference(model: NormChain, batches: list[tuple[Tensor, Tensor]]) -> tuple[dict, dict]:
    """Each microbatch normalised with its own statistics (plain BatchNorm in training mode,
    gradient accumulation); running statistics from each BatchNorm's input over the whole batch,
    updated once per batch: ``r <- (1 - momentum) r + momentum * stat`` (unbiased variance)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    norms = {name: m for name, m in model.named_modules() if isinstance(m, nn.BatchNorm1d)}
    stats = {
        f"{name}.{k}": getattr(m, k).clone()
        for name, m in norms.items()
        for k in ("running_mean", "running_var", "num_batches_tracked")
    }
    for x, y in batches:
        seen: dict[str, list[Tensor]] = {name: [] for name in norms}
        hooks = [
            m.register_forward_pre_hook(lambda mod, args, name=name: seen[name].append(args[0].detach()))
            for name, m in norms.items()
        ]
        model.zero_grad()
        for mx, my in zip(x.tensor_split(M), y.tensor_split(M)):
            (model.pipeline_loss(model(mx), (mx, my)) * len(mx) / len(x)).backward()
        for hook in hooks:
            hook.remove()
        for name, m in norms.items():
            whole = torch.cat(seen[name])
            for key, value in (("running_mean", whole.mean(0)), ("running_var", whole.var(0, unbiased=True))):
                stats[f"{name}.{key}"] = (1 - m.momentum) * stats[f"{name}.{key}"] + m.momentum * value
            stats[f"{name}.num_batches_tracked"] += 1
        opt.step()
    return stats, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("recompute", DEFERRED)
def test_deferred_batch_norm_keeps_whole_batch_statistics(launched, recompute: bool) -> None:
    ranks = launched(2).ok("buffers_deferred_1x2")
    torch.manual_seed(0)
    with _one_thread():
        want_stats, want_params = _deferred_reference(NormChain(), [make_data(BATCH, seed=s) for s in range(STEPS)])
    got = {**ranks[0][recompute]["stats"], **ranks[1][recompute]["stats"]}
    assert sorted(got) == sorted(want_stats)
    for name, value in want_stats.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    params = {**ranks[0][recompute]["params"], **ranks[1][recompute]["params"]}
    for name, value in want_params.items():
        torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
