"""Split backward at runtime: I and W through autograd give the same gradients as one backward."""

from __future__ import annotations

import pytest
import torch

from lightning_pipe import PipelineGroups, PipelinePlan, Topology, place
from lightning_pipe.runtime.autograd.backward_split import input_grads, weight_grads
from tests.models import ConvChain, ToyChain, make_data
from tests.shared import scenario, scenario_per_layout

BATCH, M, STEPS = 16, 4, 3
SCHEDULES = ("gpipe", "1f1b", "2bw")
VARIANTS = [
    (False, False, None),
    (True, False, None),
    (True, True, None),
    (True, False, "drain"),
    (True, True, "drain"),
]
# (split backward, recompute, W placement): "drain" splits only the backwards after a stage's last
# forward, so one program runs both whole backwards and I + W (not 2BW, whose stream never drains)


def test_transformer_block_split_matches_backward_and_runs_no_forward() -> None:
    torch.manual_seed(0)
    block = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    calls = []
    block.register_forward_hook(lambda *_: calls.append(1))
    x = torch.randn(4, 6, 32, requires_grad=True)
    out = block(x)
    grad = torch.randn_like(out)
    (gx,), work = input_grads([out], [grad], [x])
    weight_grads(work)
    _assert_matches_full_backward(block, x, grad, gx, rtol=1e-6, atol=1e-7)
    assert len(calls) == 2  # one forward each; I and W re-ran none


def _assert_matches_full_backward(
    block: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor, gx: torch.Tensor, **tolerance: float
) -> None:
    """The input gradient ``gx`` and the weight gradients I and W left in ``block`` equal one full backward's."""
    split = {n: p.grad.clone() for n, p in block.named_parameters()}
    block.zero_grad()
    x2 = x.detach().requires_grad_()
    block(x2).backward(grad)
    torch.testing.assert_close(gx, x2.grad, **tolerance)
    for n, p in block.named_parameters():
        torch.testing.assert_close(split[n], p.grad, msg=n, **tolerance)


class _TwiceLinear(torch.nn.Module):
    """One ``nn.Linear`` applied twice: both applications feed the same weights."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(5, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(self.lin(x)))


class _TransposedOnce(torch.nn.Module):
    """A weight transformed once (its transpose scaled) and used by two matmuls, beside an unshared Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.w, self.other = torch.nn.Parameter(torch.randn(5, 5)), torch.nn.Linear(5, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wt = self.w.t() * 0.5
        return self.other(torch.tanh(x @ wt) @ wt)


@pytest.mark.parametrize("make", [_TwiceLinear, _TransposedOnce])
def test_weights_shared_within_a_stage_get_full_backward_gradients(make) -> None:
    torch.manual_seed(0)
    block = make()
    x = torch.randn(3, 5, requires_grad=True)
    out = block(x)
    grad = torch.randn_like(out)
    with pytest.warns(UserWarning, match="feed several operations of one stage"):
        (gx,), work = input_grads([out], [grad], [x])
    weight_grads(work)
    _assert_matches_full_backward(block, x, grad, gx)


def test_weight_gradient_passed_through_is_not_the_sent_input_gradient() -> None:
    # ``x + b`` passes its gradient through to both: adopted as b.grad, that tensor (the input
    # gradient sent to the previous stage) would take the next microbatch's W in place.
    b = torch.nn.Parameter(torch.zeros(3, 4))
    grads, sent = [], []
    for seed in range(2):
        torch.manual_seed(seed)
        x = torch.randn(3, 4, requires_grad=True)
        grad = torch.randn(3, 4)
        (gx,), work = input_grads([torch.tanh(x + b)], [grad], [x])
        weight_grads(work)
        grads.append(gx)
        sent.append(gx.clone())
        reference = x.detach().requires_grad_()
        torch.tanh(reference + b.detach()).backward(grad)
        torch.testing.assert_close(gx, reference.grad)
    for gx, copy in zip(grads, sent):
        assert torch.equal(gx, copy)
    torch.testing.assert_close(b.grad, sent[0] + sent[1])


class _Scale(torch.autograd.Function):
    """``x * w`` as one custom Function: an activation and a weight meet in one backward."""

    calls = 0

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[no-untyped-def]
        _Scale.calls += 1
        x, w = ctx.saved_tensors
        return grad * w, (grad * x).sum(0)


def test_input_hooks_see_first_forwards_only_never_recomputations() -> None:
    from lightning_pipe.runtime.stage import Stage

    torch.manual_seed(0)
    blocks = [torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4)]
    runs: list[int] = []
    blocks[0].register_forward_pre_hook(lambda *_: runs.append(1))  # counts every forward, recomputed or not
    stage = Stage(blocks, 0, recompute=True)
    seen: list[torch.Tensor] = []
    handle = stage.register_input_hook(lambda inputs: seen.append(inputs[0]))
    xs = [torch.randn(3, 4, requires_grad=True) for _ in range(2)]
    for x in xs:
        stage((x,))[0].sum().backward()  # checkpoint recomputes in backward
    stage.recompute_forward((xs[0],))  # split backward's recomputation
    assert len(runs) == 5 and [id(t) for t in seen] == [id(x) for x in xs]
    handle.remove()
    stage((xs[0],))
    assert len(seen) == 2


def test_custom_function_taking_activation_and_weight_warns_and_stays_correct() -> None:
    torch.manual_seed(0)
    w, x = torch.randn(5, requires_grad=True), torch.randn(3, 5, requires_grad=True)
    grad = torch.randn(3, 5)
    _Scale.calls = 0
    with pytest.warns(UserWarning, match="custom autograd.Function _Scale takes both an activation and a weight"):
        (gx,), work = input_grads([_Scale.apply(x, w)], [grad], [x])
    weight_grads(work)
    assert _Scale.calls == 2  # I and W each ran the whole backward: what the warning says
    x2 = x.detach().requires_grad_()
    w2 = w.detach().requires_grad_()
    (x2 * w2).backward(grad)
    torch.testing.assert_close(gx, x2.grad)
    torch.testing.assert_close(w.grad, w2.grad)


#: The convolution chain runs 1F1B plain, split and split with recompute (its weight gradients deferred).
CONV_VARIANTS = VARIANTS[:3]


def _split_runs() -> list[tuple[str, type, str, tuple]]:
    """(model name, model class, schedule, variant) of each run of :func:`_split_worker`."""
    runs = [("toy", ToyChain, s, v) for s in SCHEDULES for v in VARIANTS if v[2] is None or s == "1f1b"]
    return runs + [("conv", ConvChain, "1f1b", v) for v in CONV_VARIANTS]


def _split_worker(rank: int, world: int, depth: int) -> dict:
    topo = Topology(world, depth)
    groups = PipelineGroups.build(topo, rank)
    replica, results = topo.replica_of(rank), {}
    for name, make, schedule, (split, recompute, placement) in _split_runs():
        torch.manual_seed(0)
        model = make()
        plan = PipelinePlan(
            topo.width, depth, M, schedule, split, partition="uniform", recompute=recompute, split_placement=placement
        )
        engine = place(model, plan, rank, groups=groups)
        forwards = [0]
        for block in engine.stage.blocks:
            block.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        weights, grads = [], None
        for step in range(STEPS):
            batch = tuple(t.chunk(topo.width)[replica] for t in make_data(BATCH, seed=step))
            engine.train_step(batch, opt)
            weights.append({k: v.clone() for k, v in engine.current_weights().items()})
            if grads is None and schedule != "2bw":
                grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        engine.drain()
        weights.append({k: v.clone() for k, v in engine.current_weights().items()})
        kinds = {a.kind.name for a in engine.train_program(M)} if schedule != "2bw" else set()
        kinds |= {"DEFERS_WEIGHTS"} if engine.stage.defers_weights else set()
        key = (schedule, split, recompute, placement) if name == "toy" else (name, split, recompute)
        results[key] = (grads, weights, forwards[0] / len(engine.stage.blocks), kinds)
    return results


LAYOUTS = [(1, 2), (1, 4), (2, 2)]
scenario_per_layout("split", _split_worker, LAYOUTS)


@pytest.mark.parametrize("width,depth", LAYOUTS)
def test_split_backward_matches_full_backward(launched, width: int, depth: int) -> None:
    out = launched(width * depth)[f"split_{width}x{depth}"]
    assert all(status == "ok" for status, _ in out), [v for s, v in out if s != "ok"]
    for rank in range(width * depth):
        for schedule in SCHEDULES:
            plain = out[rank][1][(schedule, False, False, None)]
            for variant in VARIANTS[1:]:
                if variant[2] is not None and schedule != "1f1b":
                    continue
                split = out[rank][1][(schedule, *variant)]
                # float32 sums the same terms in another order: 1e-6 relative, plus 1e-8 for values near 0
                if schedule != "2bw":
                    for name, g in plain[0].items():
                        torch.testing.assert_close(split[0][name], g, rtol=1e-6, atol=1e-8)
                for want, got in zip(plain[1], split[1]):
                    for name in want:
                        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-8)
            assert plain[2] == out[rank][1][(schedule, True, False, None)][2] == STEPS * M  # one forward per microbatch
            # With recompute: the forward, then its one recomputation before I; W reuses that graph.
            assert out[rank][1][(schedule, True, True, None)][2] == 2 * STEPS * M
            if schedule == "1f1b":  # drain: whole backwards (checkpointed under recompute) beside I + W
                assert out[rank][1][(schedule, True, False, "drain")][2] == STEPS * M
                # its whole backwards recompute through torch.utils.checkpoint, which stops rerunning a
                # block's forward once it has every tensor the backward needs (no forward hook then)
                assert STEPS * M < out[rank][1][(schedule, True, True, "drain")][2] <= 2 * STEPS * M
                assert {"INPUT_GRAD", "WEIGHT_GRAD"} <= out[rank][1][(schedule, True, False, "drain")][3]
    # 1F1B's last stage runs B0 before F1: its drain program mixes whole backwards with I + W
    assert any("BACKWARD" in out[rank][1][("1f1b", True, False, "drain")][3] for rank in range(width * depth))
    # Convolution stages, their weight gradients deferred to W, against the same chain without split
    for rank in range(width * depth):
        plain = out[rank][1][("conv", False, False)]
        assert (
            "DEFERS_WEIGHTS" in plain[3]
        )  # every stage holds a convolution (or the first's linear) and no other matrix
        for variant in CONV_VARIANTS[1:]:
            split = out[rank][1][("conv", *variant[:2])]
            for name, g in plain[0].items():
                torch.testing.assert_close(split[0][name], g, rtol=1e-6, atol=1e-8)
            for want, got in zip(plain[1], split[1]):
                for name in want:
                    torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-8)


def _memory_worker(rank: int, world: int) -> dict:
    topo = Topology(world, world)
    groups = PipelineGroups.build(topo, rank)
    peaks = {}
    for split, bound in ((False, None), (True, 2 * world), (True, 1), (True, None)):
        torch.manual_seed(0)
        model = ToyChain()
        plan = PipelinePlan(1, world, 2 * world, "1f1b", split, bound, partition="uniform")
        engine = place(model, plan, rank, groups=groups)
        engine.instrument = True  # count the bytes held for backward, as the monitor does
        engine.train_step(make_data(4 * world * 8, seed=0), torch.optim.SGD(model.parameters(), lr=0.0))
        peaks[(split, bound)] = (engine.last_peak_stash, engine.last_peak_stash_bytes)
    engine.record_trace, engine.count_stash = True, False  # the AutoPlanner's trace, without the counting's hooks
    engine.train_step(make_data(4 * world * 8, seed=0), torch.optim.SGD(model.parameters(), lr=0.0))
    peaks["trace only"] = (len(engine.trace.intervals), engine.last_peak_stash_bytes)
    return peaks


scenario(2, "split_stash", _memory_worker)


def test_runtime_reports_stash_and_bounded_split_lowers_it(launched) -> None:
    # 1F1B-2 (m = 2d): 2BP's unbounded split holds every microbatch until its W; a bound of one
    # pending W (2BP, Figure 5) brings the peak back towards plain 1F1B's; the default,
    # ZB-H1, holds d on every stage (1F1B's first-stage peak).
    out = launched(2)["split_stash"]
    assert all(status == "ok" for status, _ in out), out
    for stage, (_, peaks) in enumerate(out):
        plain, split, bounded, zb = peaks[(False, None)], peaks[(True, 4)], peaks[(True, 1)], peaks[(True, None)]
        assert plain[0] == 2 - stage and split[0] == 4 and zb[0] == 2  # microbatches awaiting B / W
        assert bounded[0] < split[0]
        assert plain[1] > 0 and split[1] > plain[1] > 0
        assert bounded[1] < split[1]
        traced, counted = peaks["trace only"]
        assert traced > 0 and counted == 0  # the trace recorded, no bytes counted
