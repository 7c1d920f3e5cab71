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
from tests.shared import scenario, scenario_per_layout

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
    host the parameters can drift by a few 1e-6 from a one-thread run in 3 steps, against the
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


# -- replicas: replica 0's buffers before each step (DistributedDataParallel(broadcast_buffers=True)) ----------

#: (schedule, split backward, recompute, deferred batch norm, broadcast_buffers)
REPLICATED = [
    ("1f1b", False, False, False, True),
    ("2bw", True, True, False, True),
    ("1f1b", False, True, True, True),
    ("1f1b", False, False, False, False),
]
REPLICA_LAYOUTS = [(2, 1), (2, 2)]
RUNNING = ("running_mean", "running_var", "num_batches_tracked")


def _running(buffers: dict[str, Tensor]) -> dict[str, Tensor]:
    """The running statistics (deferred batch norm's per-batch sums are buffers too, zero between steps)."""
    return {k: v for k, v in buffers.items() if k.endswith(RUNNING)}


def _shards(step: int, width: int) -> list[tuple[Tensor, Tensor]]:
    """Each replica's rows of global batch ``step``."""
    x, y = make_data(BATCH, seed=step)
    return list(zip(x.chunk(width), y.chunk(width)))


def _replica_worker(rank: int, world: int, depth: int) -> dict:
    from lightning_pipe.runtime.autograd.deferred_norm import convert_deferred_batch_norm

    topo = Topology(world, depth)
    groups = PipelineGroups.build(topo, rank)
    results = {}
    for variant in REPLICATED:
        schedule, split, recompute, deferred, broadcast = variant
        torch.manual_seed(0)
        model = NormChain()
        if deferred:
            convert_deferred_batch_norm(model, M)
        plan = PipelinePlan(topo.width, depth, M, schedule, split, partition="uniform", recompute=recompute)
        engine = place(model, plan, rank, groups=groups, broadcast_buffers=broadcast)
        starts: list[dict[str, Tensor]] = []  # the buffers each step's first forward on this rank starts from
        hook = engine.stage.register_input_hook(lambda _: len(starts) < step + 1 and starts.append(_buffers(model)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(STEPS):
            engine.train_step(_shards(step, topo.width)[topo.replica_of(rank)], opt)
        hook.remove()
        engine.drain()
        results[variant] = {
            "starts": starts,
            "end": _buffers(model),
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "stage": engine.stage_index,
        }
        engine.close()
    return results


scenario_per_layout("buffers_replicas", _replica_worker, REPLICA_LAYOUTS)


def _replicated_reference(
    shards: list[list[tuple[Tensor, Tensor]]], delay: int, deferred: bool
) -> tuple[list[dict[str, Tensor]], dict[str, Tensor]]:
    """One process, written from DDP's rule: each step's gradient is the mean of the replicas'
    (each replica accumulating its shard's microbatches), and the running statistics are replica
    0's alone, updated from replica 0's shard only. ``shards[t][r]``: replica ``r``'s rows of batch ``t``.

    Returns:
        The running statistics after each step, and the final parameters.
    """
    with _one_thread():
        torch.manual_seed(0)
        model = NormChain()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        versions, after = [copy.deepcopy(model.state_dict())], []
        for t, replicas in enumerate(shards):
            grads = [torch.zeros_like(p) for p in model.parameters()]
            for r, (x, y) in enumerate(replicas):
                probe = copy.deepcopy(model)
                probe.load_state_dict({**versions[max(t - delay, 0)], **_buffers(model)})
                stats = _replica_step(probe, x, y, len(replicas), deferred)
                grads = [g + p.grad for g, p in zip(grads, probe.parameters())]
                if r == 0:
                    fresh = stats
            model.load_state_dict(fresh, strict=False)
            for p, g in zip(model.parameters(), grads):
                p.grad = g
            opt.step()
            versions.append(copy.deepcopy(model.state_dict()))
            after.append(_running(_buffers(model)))
        return after, {n: p.detach().clone() for n, p in model.named_parameters()}


def _replica_step(probe: NormChain, x: Tensor, y: Tensor, width: int, deferred: bool) -> dict[str, Tensor]:
    """Accumulate one replica's gradient share into ``probe`` (its microbatches in order); return
    the running statistics it leaves: BatchNorm's per-microbatch updates, or (``deferred``) one
    update from the whole shard (torchgpipe's deferred batch norm: unbiased variance)."""
    norms = {name: m for name, m in probe.named_modules() if isinstance(m, nn.BatchNorm1d)}
    before = _running(_buffers(probe))
    seen: dict[str, list[Tensor]] = {name: [] for name in norms}
    hooks = [
        m.register_forward_pre_hook(lambda mod, args, name=name: seen[name].append(args[0].detach()))
        for name, m in norms.items()
    ]
    probe.zero_grad()
    for mx, my in zip(x.tensor_split(M), y.tensor_split(M)):
        (probe.pipeline_loss(probe(mx), (mx, my)) * len(mx) / len(x) / width).backward()
    for hook in hooks:
        hook.remove()
    if not deferred:
        return _running(_buffers(probe))
    for name, m in norms.items():
        whole = torch.cat(seen[name])
        for key, value in (("running_mean", whole.mean(0)), ("running_var", whole.var(0, unbiased=True))):
            before[f"{name}.{key}"] = (1 - m.momentum) * before[f"{name}.{key}"] + m.momentum * value
        before[f"{name}.num_batches_tracked"] = before[f"{name}.num_batches_tracked"] + 1
    return before


def _assert_close(got: dict[str, Tensor], want: dict[str, Tensor], what: str) -> None:
    assert sorted(got) == sorted(want), (what, sorted(set(got) ^ set(want)))
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}, {name}: {m}")


@pytest.mark.parametrize("width,depth", REPLICA_LAYOUTS)
@pytest.mark.parametrize("variant", REPLICATED[:3], ids=lambda v: "-".join(str(x) for x in v[:4]))
def test_replicas_start_every_step_from_replica_zeros_buffers(launched, width: int, depth: int, variant: tuple) -> None:
    # DDP's broadcast_buffers: every step's forward, on every replica, starts from replica 0's
    # running statistics; a drain leaves every replica with them; the parameters train on the
    # replicas' averaged gradients, unaffected.
    ranks = [rank[variant] for rank in launched(width * depth).ok(f"buffers_replicas_{width}x{depth}")]
    delay = 1 if variant[0] == "2bw" else 0
    after, params = _replicated_reference([_shards(s, width) for s in range(STEPS)], delay, deferred=variant[3])
    torch.manual_seed(0)
    initial = _running(_buffers(NormChain()))
    merged: dict[str, Tensor] = {}
    for r, rank in enumerate(ranks):
        twin = ranks[rank["stage"]]  # replica 0's rank of this stage
        assert len(rank["starts"]) == STEPS
        for step, start in enumerate(rank["starts"]):
            assert all(torch.equal(v, twin["starts"][step][k]) for k, v in start.items()), (r, step)  # bit for bit
            want = after[step - 1] if step else initial
            _assert_close(_running(start), {k: want[k] for k in _running(start)}, f"rank {r}, step {step}")
        assert all(torch.equal(v, twin["end"][k]) for k, v in rank["end"].items()), r
        merged.update(_running(rank["end"]))
    _assert_close(merged, after[-1], "after the drain")
    got = {k: v for rank in ranks[:depth] for k, v in rank["params"].items()}
    _assert_close(got, params, "parameters")


@pytest.mark.parametrize("width,depth", REPLICA_LAYOUTS)
def test_without_broadcast_replicas_keep_their_own_statistics(launched, width: int, depth: int) -> None:
    # broadcast_buffers=False: replica 0 still follows its own shard (the reference above), the
    # others drift from it.
    variant = REPLICATED[3]
    ranks = [rank[variant] for rank in launched(width * depth).ok(f"buffers_replicas_{width}x{depth}")]
    after, _ = _replicated_reference([_shards(s, width) for s in range(STEPS)], 0, deferred=False)
    _assert_close({k: v for rank in ranks[:depth] for k, v in _running(rank["end"]).items()}, after[-1], "replica 0")
    for rank in ranks[depth:]:
        twin = ranks[rank["stage"]]["end"]
        assert max(float((v.float() - twin[k].float()).abs().max()) for k, v in rank["end"].items()) > 1e-3


# -- through Trainer.fit: validation and the checkpoint see replica 0's statistics ------------------------------


class NormModule(NormChain):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


ROWS = BATCH // 2  # per replica and step


def _fit_worker(rank: int, world: int, depth: int) -> dict:
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_pipe import PipelineStrategy
    from tests.scripts.train_toy import Indexed, Recorder
    from tests.shared import scenario_dir

    width = world // depth
    torch.manual_seed(0)
    model, recorder = NormModule(), Recorder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        max_steps=STEPS,
        max_epochs=-1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=2,
        val_check_interval=STEPS,
        callbacks=[recorder, L.pytorch.callbacks.ModelCheckpoint(dirpath=scenario_dir() / "ckpt", save_last=True)],
        strategy=PipelineStrategy(pipeline_depth=depth, microbatches=M, partition="uniform"),
    )
    train = DataLoader(Indexed(ROWS * width * STEPS, 0), batch_size=ROWS)
    trainer.fit(model, train, DataLoader(Indexed(ROWS * width * 2, 99), batch_size=ROWS))
    return {
        "indices": recorder.indices,
        "buffers": _buffers(model),
        "val_loss": float(trainer.callback_metrics["val_loss"]),
        "stage": trainer.strategy.engine.stage_index,
    }


scenario_per_layout("buffers_fit", _fit_worker, REPLICA_LAYOUTS)


@pytest.mark.parametrize("width,depth", REPLICA_LAYOUTS)
def test_checkpoint_evaluated_in_one_process_matches_the_pipelines_validation(launched, width: int, depth: int) -> None:
    import torch.nn.functional as F

    from tests.models import load_plain

    ranks = launched(width * depth).ok(f"buffers_fit_{width}x{depth}")
    x, y = make_data(ROWS * width * STEPS, 0)
    shards = [
        [(x[torch.tensor(i)], y[torch.tensor(i)]) for i in (ranks[r * depth]["indices"][t] for r in range(width))]
        for t in range(STEPS)
    ]
    after, _ = _replicated_reference(shards, 0, deferred=False)
    for r, rank in enumerate(ranks):  # every replica ends with replica 0's statistics, bit for bit
        twin = ranks[rank["stage"]]["buffers"]
        assert all(torch.equal(v, twin[k]) for k, v in rank["buffers"].items()), r
    _assert_close({k: v for rank in ranks[:depth] for k, v in rank["buffers"].items()}, after[-1], "after fit")
    plain = load_plain(NormModule, launched(width * depth).dir(f"buffers_fit_{width}x{depth}") / "ckpt" / "last.ckpt")
    _assert_close(_running(_buffers(plain)), after[-1], "the checkpoint")
    xv, yv = make_data(ROWS * width * 2, 99)
    with torch.no_grad():
        val = float(F.cross_entropy(plain.eval()(xv), yv))
    for rank in ranks:  # each replica validated its half of the set; the logged loss is their mean
        assert rank["val_loss"] == pytest.approx(val, rel=1e-6)


class _Mixed(nn.Module):
    """Buffers of several dtypes, one of them registered in two modules."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(3)
        self.inner = nn.Module()
        self.register_buffer("mask", torch.tensor([True, False, True]))
        self.register_buffer("wide", torch.arange(5, dtype=torch.float64) * scale)
        self.inner.register_buffer("wide_again", self.wide)
        with torch.no_grad():
            self.norm.running_mean.fill_(scale)
            self.norm.num_batches_tracked.fill_(int(scale))


def test_a_receiving_replica_takes_fresh_tensors_with_the_sources_values(monkeypatch: pytest.MonkeyPatch) -> None:
    # One process: the collective replaced by a copy of the source replica's message.
    from lightning_pipe.runtime import replica_buffers
    from lightning_pipe.runtime.replica_buffers import BufferBroadcast

    source, receiver = _Mixed(2.0), _Mixed(5.0)
    sent, _ = replica_buffers._pack(list({id(b): b for b in source.buffers()}.values()))
    calls = []
    monkeypatch.setattr(replica_buffers.dist, "broadcast", lambda flat, src, group: calls.append(flat.copy_(sent)))
    old = dict(receiver.named_buffers(remove_duplicate=False))
    versions = {k: v._version for k, v in old.items()}
    BufferBroadcast(list(receiver.modules()), None, source=0, rank=1).broadcast()
    got = dict(receiver.named_buffers(remove_duplicate=False))
    for name, value in source.named_buffers(remove_duplicate=False):
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), name
        assert got[name] is not old[name] and old[name]._version == versions[name], name  # saved graphs keep theirs
    assert receiver.inner.wide_again is receiver.wide  # still one buffer
    assert len(calls) == 1  # four dtypes, one message


def _interleaved_replica_worker(rank: int, world: int) -> dict:
    """(2, 2), two stages per rank (interleaved 1F1B): both stages' buffers travel in the rank's one message."""
    topo = Topology(world, 2)
    groups = PipelineGroups.build(topo, rank)
    torch.manual_seed(0)
    model = NormChain()
    plan = PipelinePlan(topo.width, 2, M, "1f1b", partition=[2, 1, 1, 2], virtual_stages=2)
    engine = place(model, plan, rank, groups=groups)
    starts: list[dict[str, Tensor]] = []
    hooks = [st.register_input_hook(lambda _: starts.append(_buffers(model))) for st in engine.stages]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        engine.train_step(_shards(step, topo.width)[topo.replica_of(rank)], opt)
        starts[:] = starts[: step + 1]  # the buffers the step's first forward on this rank started from
    for hook in hooks:
        hook.remove()
    engine.drain()
    out = {"starts": starts, "end": _buffers(model), "stage": engine.stage_index}
    engine.close()
    return out


scenario(4, "buffers_replicas_interleaved", _interleaved_replica_worker)


def test_interleaved_replicas_start_every_step_from_replica_zeros_buffers(launched) -> None:
    ranks = launched(4).ok("buffers_replicas_interleaved")
    after, _ = _replicated_reference([_shards(s, 2) for s in range(STEPS)], 0, deferred=False)
    merged: dict[str, Tensor] = {}
    for r, rank in enumerate(ranks):
        twin = ranks[rank["stage"]]
        assert len(rank["starts"]) == STEPS
        for step, start in enumerate(rank["starts"][1:], 1):
            assert all(torch.equal(v, twin["starts"][step][k]) for k, v in start.items()), (r, step)
            _assert_close(_running(start), {k: after[step - 1][k] for k in _running(start)}, f"rank {r}, step {step}")
        assert all(torch.equal(v, twin["end"][k]) for k, v in rank["end"].items()), r
        merged.update(_running(rank["end"]))
    _assert_close(merged, after[-1], "after the drain")
