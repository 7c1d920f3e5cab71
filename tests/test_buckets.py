"""Replica all-reduce in buckets posted during the backward: exact against a single-process reference."""

from __future__ import annotations

import pytest
import torch

from lightning_pipe import PipelineGroups, PipelinePlan, Topology, place
from lightning_pipe.runtime import buckets as buckets_module
from tests.models import ToyChain, assert_close_dicts, make_data, reference_train
from tests.shared import scenario

BATCH, M, STEPS = 16, 4, 4
#: (schedule, split backward, recompute): every path a gradient takes into ``.grad``.
COMBOS = [
    ("gpipe", False, False),
    ("1f1b", False, True),
    ("1f1b", True, False),
    ("gpipe", True, False),
    ("2bw", False, False),
    ("2bw", True, False),
]


class PostCounter:
    """Counts bucket all-reduces posted while a training program runs, and those left to the AR action."""

    def __init__(self) -> None:
        self.during_backward = self.at_finish = 0
        self._post, self._finish = buckets_module.GradientBuckets._post, buckets_module.GradientBuckets.finish
        counter, post = self, self._post

        def counting_post(buckets: buckets_module.GradientBuckets, i: int) -> None:
            if getattr(buckets, "_finishing", False):
                counter.at_finish += 1
            else:
                counter.during_backward += 1
            post(buckets, i)

        def counting_finish(buckets: buckets_module.GradientBuckets) -> None:
            buckets._finishing = True
            try:
                counter._finish(buckets)
            finally:
                buckets._finishing = False

        buckets_module.GradientBuckets._post, buckets_module.GradientBuckets.finish = counting_post, counting_finish

    def restore(self) -> None:
        buckets_module.GradientBuckets._post, buckets_module.GradientBuckets.finish = self._post, self._finish


def _worker(rank: int, world: int) -> dict:
    topo = Topology(world, 2)
    groups = PipelineGroups.build(topo, rank)
    replica = topo.replica_of(rank)
    results = {}
    for schedule, split, recompute in COMBOS:
        torch.manual_seed(0)
        model = ToyChain()
        plan = PipelinePlan(topo.width, 2, M, schedule, split, partition="uniform", recompute=recompute)
        engine = place(model, plan, rank, groups=groups, bucket_bytes=1)  # one bucket per parameter
        opt = torch.optim.Adam(model.parameters(), lr=model.lr)
        counter = PostCounter()
        try:
            for step in range(STEPS):
                batch = tuple(t.chunk(topo.width)[replica] for t in make_data(BATCH, seed=step))
                engine.train_step(batch, opt)
            engine.drain()
        finally:
            counter.restore()
        results[(schedule, split, recompute)] = {
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "posted": (counter.during_backward, counter.at_finish),
            "buckets": len(next(iter(engine.update._buckets.values())).buckets),  # per weight slot (2BW has two)
        }
    return results


scenario(4, "buckets_2x2", _worker)


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: "-".join(str(x) for x in c))
def test_bucketed_overlapped_all_reduce_matches_single_process(launched, combo: tuple) -> None:
    ranks = launched(4).ok("buckets_2x2")
    batches = [make_data(BATCH, seed=s) for s in range(STEPS)]
    torch.manual_seed(0)
    want = reference_train(
        ToyChain(), batches, delay=1 if combo[0] == "2bw" else 0
    )  # 2BW: PipeDream-2BW's 1-stale rule
    merged: dict = {}
    for rank in ranks[:2]:  # replica 0 holds both stages
        merged.update(rank[combo]["params"])
    assert_close_dicts(merged, want, rtol=1e-5)
    for rank in ranks[2:]:  # replica 1 holds the same weights, bit for bit
        assert_close_dicts(rank[combo]["params"], {k: merged[k] for k in rank[combo]["params"]}, rtol=0, atol=0)
    for rank in ranks:
        during, at_finish = rank[combo]["posted"]
        # Every bucket of every step was posted as soon as its gradients were final, none left
        # for the AR action (the toy chain uses every parameter in every microbatch).
        assert at_finish == 0 and during == STEPS * rank[combo]["buckets"] > 0, rank[combo]["posted"]


def test_a_finished_buckets_buffer_lives_only_as_long_as_the_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    # gloo's thread can hold its finished all-reduce, and the tensor it reduced, after wait()
    # returns (on a loaded host past the next step's first gradient). The works here are held
    # throughout, as by that thread: the buffer must still go when the gradients do.
    import weakref

    held = []

    class HeldWork:
        def __init__(self, tensor: torch.Tensor) -> None:
            self.tensor = tensor

        def wait(self) -> None:
            pass

    def all_reduce(tensor: torch.Tensor, group: object = None, async_op: bool = False) -> HeldWork:
        held.append(HeldWork(tensor))
        return held[-1]

    monkeypatch.setattr(buckets_module.dist, "all_reduce", all_reduce)
    layer = torch.nn.Linear(4, 3)
    buckets = buckets_module.GradientBuckets(list(layer.parameters()), None, 2, 1 << 20)
    buckets.expected = 1
    layer(torch.randn(2, 4)).sum().backward()
    buckets.finish()
    assert len(held) == 1  # one bucket, reduced once
    buffer = weakref.ref(layer.weight.grad.untyped_storage())
    layer.zero_grad(set_to_none=True)
    alive = buffer() is not None
    assert not alive, "the finished work still holds the bucket's buffer"
    buckets.close()
