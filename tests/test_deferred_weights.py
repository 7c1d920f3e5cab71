"""Split backward with deferred linear and convolution weight gradients: I frees the graph, W computes the weights'."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.sleep_chain import SleepBlock
from lightning_pipe.runtime.autograd.backward_split import input_grads, weight_grads
from lightning_pipe.runtime.autograd.deferred_weights import DeferredGrads, DeferWeightGrads, deferrable_weights_only


class _Block(nn.Module):
    """A pre-norm transformer block with the cases deferral must get right besides plain linears:
    one linear applied twice, one without bias, one frozen, and an embedding tied to a linear head."""

    def __init__(self, width: int = 16, vocab: int = 11) -> None:
        super().__init__()
        self.norm, self.qkv, self.proj = (
            nn.LayerNorm(width),
            nn.Linear(width, 3 * width),
            nn.Linear(width, width, bias=False),
        )
        self.fc, self.twice, self.frozen = (
            nn.Linear(width, 2 * width),
            nn.Linear(2 * width, 2 * width),
            nn.Linear(2 * width, width),
        )
        self.frozen.weight.requires_grad_(False)
        self.embed = nn.Embedding(vocab, width)
        self.head = nn.Linear(width, vocab)
        self.head.weight = self.embed.weight  # tied: a linear and an embedding feed one weight

    def forward(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x + self.embed(tokens))).chunk(3, dim=-1)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        h = F.gelu(F.linear(weight=self.fc.weight, input=x, bias=self.fc.bias))  # by keyword
        x = x + self.frozen(torch.tanh(self.twice(torch.tanh(self.twice(h)))))
        return self.head(x)


def _setup(seed: int = 0) -> tuple[_Block, torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    block = _Block()
    x, tokens = torch.randn(3, 7, 16), torch.randint(0, 11, (3, 7))
    return block, x, tokens, torch.randn(3, 7, 11)


def _full(block: nn.Module, x: torch.Tensor, tokens: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The reference: one ordinary backward."""
    block.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    block(x, tokens).backward(grad)
    grads = {n: p.grad.clone() for n, p in block.named_parameters() if p.grad is not None}
    block.zero_grad(set_to_none=True)
    return x.grad, grads


def _deferred_forward(
    block: nn.Module, x: torch.Tensor, tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, DeferredGrads]:
    store = DeferredGrads([p for p in block.parameters() if p.requires_grad])
    x = x.detach().requires_grad_()
    with DeferWeightGrads(store):
        out = block(x, tokens)
    return x, out, store


def test_deferred_split_matches_one_backward() -> None:
    block, x, tokens, grad = _setup()
    want_x, want = _full(block, x, tokens, grad)
    x, out, store = _deferred_forward(block, x, tokens)
    (gx,), work = input_grads([out], [grad], [x], store)
    # I computed no linear weight's gradient, and kept one (input, output gradient) per linear call
    # on a trainable weight: qkv, proj, fc, twice (two calls), head; not the frozen one.
    deferred = {id(p) for m in (block.qkv, block.proj, block.fc, block.twice) for p in m.parameters()}
    assert all(p.grad is None for p in block.parameters() if id(p) in deferred)  # I added only the others' gradients
    assert sorted(tuple(c.weight.shape) for c in store.calls) == sorted(
        [(48, 16), (16, 16), (32, 16), (32, 32), (32, 32), (11, 16)]
    )
    updated = weight_grads(work)
    torch.testing.assert_close(gx, want_x, rtol=1e-6, atol=1e-7)
    got = {n: p.grad for n, p in block.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys()  # the frozen weight has none, its bias has one
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-7, msg=name)
    assert len(updated) == len({id(p) for p in updated}) == len(want)  # each updated leaf reported once


def test_input_gradients_free_the_graph_and_w_runs_no_autograd(monkeypatch) -> None:
    block, x, tokens, grad = _setup()
    x, out, store = _deferred_forward(block, x, tokens)
    _, work = input_grads([out], [grad], [x], store)
    with pytest.raises(RuntimeError, match="second time"):  # I kept no graph (retain_graph off)
        out.backward(grad)

    def refuse(*args, **kwargs):
        raise AssertionError("W called autograd")

    monkeypatch.setattr(torch.autograd, "grad", refuse)
    monkeypatch.setattr(torch.autograd, "backward", refuse)
    weight_grads(work)
    assert block.qkv.weight.grad is not None


def test_the_autograd_split_keeps_the_graph_for_w() -> None:
    # The check above can fail: without deferral I keeps the graph, and W runs on it.
    block, x, tokens, grad = _setup()
    want_x, want = _full(block, x, tokens, grad)
    x = x.detach().requires_grad_()
    out = block(x, tokens)
    (gx,), work = input_grads([out], [grad], [x])
    torch.testing.assert_close(gx, want_x, rtol=1e-6, atol=1e-7)
    # The graph is still there after I: differentiating through it again gives the same input gradient.
    (again,) = torch.autograd.grad(out, x, grad, retain_graph=True)
    torch.testing.assert_close(again, want_x, rtol=1e-6, atol=1e-7)
    assert work.edges and work.captured(), "I left W no frontier to run from"
    weight_grads(work)  # autograd from the gradients I captured, on the graph I kept
    got = {n: p.grad for n, p in block.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys()  # the frozen weight has none
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-7, msg=name)


class _Products(TorchDispatchMode):
    """Counts the matrix products run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.count: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_, torch.ops.aten.bmm):
            self.count[func.overloadpacket] += 1
        return func(*args, **(kwargs or {}))


def _recorded_split(record: type, block: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> tuple:
    """The deferring split of ``block`` on ``x``, its I and its W each inside a fresh ``record()`` mode: (I's, W's)."""
    store = DeferredGrads(list(block.parameters()))
    with DeferWeightGrads(store):
        out = block(x)
    with record() as i_pass:
        _, work = input_grads([out], [grad], [x], store)
    with record() as w_pass:
        weight_grads(work)
    return i_pass, w_pass


def test_each_linear_product_runs_once_split_between_i_and_w() -> None:
    block = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    x, grad = torch.randn(5, 8, requires_grad=True), torch.randn(5, 4)
    out = block(x)
    with _Products() as full:
        out.backward(grad)
    block.zero_grad(set_to_none=True)
    i_products, w_products = _recorded_split(_Products, block, x, grad)
    assert sum(i_products.count.values()) == 3  # one input gradient per layer
    assert sum(w_products.count.values()) == 3  # one weight gradient per layer
    assert sum(full.count.values()) == 6


def test_without_an_input_gradient_w_runs_the_whole_backward() -> None:
    block, x, tokens, grad = _setup()
    _, want = _full(block, x, tokens, grad)
    store = DeferredGrads([p for p in block.parameters() if p.requires_grad])
    with DeferWeightGrads(store):
        out = block(x, tokens)  # x needs no gradient: the first stage
    found, work = input_grads([out], [grad], [], store)
    assert found == [] and all(p.grad is None for p in block.parameters())
    weight_grads(work)
    for name, p in block.named_parameters():
        if name in want:
            torch.testing.assert_close(p.grad, want[name], rtol=1e-6, atol=1e-7, msg=name)


def test_autocast_and_derived_weights_are_left_to_autograd_and_stay_correct() -> None:
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.utils.parametrizations.weight_norm(nn.Linear(8, 4)))
    x, grad = torch.randn(5, 8), torch.randn(5, 4)
    for cast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cast):
            ref_x = x.clone().requires_grad_()
            block(ref_x).float().backward(grad)
            want = {n: p.grad.clone() for n, p in block.named_parameters()}
            block.zero_grad(set_to_none=True)
            store = DeferredGrads(list(block.parameters()))
            xi = x.clone().requires_grad_()
            with DeferWeightGrads(store):
                out = block(xi).float()
        (gx,), work = input_grads([out], [grad], [xi], store)
        assert len(store.calls) == (0 if cast else 1)  # the weight-normed layer's weight is not a leaf
        weight_grads(work)
        torch.testing.assert_close(gx, ref_x.grad)
        for n, p in block.named_parameters():
            torch.testing.assert_close(p.grad, want[n], msg=n)
        block.zero_grad(set_to_none=True)


def test_only_stages_of_linear_convolution_and_embedding_weights_defer() -> None:
    assert deferrable_weights_only(_Block().modules())
    assert deferrable_weights_only(nn.Sequential(nn.Conv2d(3, 3, 3), nn.BatchNorm2d(3), nn.Linear(3, 3)).modules())
    assert not deferrable_weights_only(
        nn.Sequential(nn.ConvTranspose2d(3, 3, 3), nn.Linear(3, 3)).modules()
    )  # F.conv_transpose2d: not deferred
    assert not deferrable_weights_only(
        nn.MultiheadAttention(8, 2).modules()
    )  # its packed projection: F.linear inside another torch function
    # The cost-model block's weight gradient is a sleep on a 1-D weight's path: no linear, no deferral.
    assert not deferrable_weights_only(SleepBlock(4, (0.0, 0.0, 0.0)).modules())


def test_hugging_face_llama_layers_and_tied_head_defer_and_match_one_backward() -> None:
    import sys

    from tests.launch import ROOT

    sys.path.insert(0, str(ROOT / "examples"))
    from hf_llama import HFLlama

    torch.manual_seed(0)
    model = HFLlama(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    first, *stage = model.pipeline_blocks()  # the last stage: both decoder layers, the norm and the tied head
    ids, targets = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        hidden, cos, sin = first(ids)
    params = list({id(p): p for block in stage for p in block.parameters()}.values())
    modules = [m for block in stage for m in block.modules()]
    assert deferrable_weights_only(modules)

    def run(store: DeferredGrads | None) -> tuple[torch.Tensor, torch.Tensor]:
        x = hidden.clone().requires_grad_()
        out: tuple = (x, cos, sin)
        with DeferWeightGrads(store) if store is not None else torch.enable_grad():
            for block in stage:
                out = block(*out)
        return x, F.cross_entropy(out.flatten(0, 1), targets.flatten())

    x, loss = run(None)
    loss.backward()
    want_x, want = x.grad, [p.grad.clone() for p in params]
    model.zero_grad(set_to_none=True)
    store = DeferredGrads(params)
    x, loss = run(store)
    (gx,), work = input_grads([loss], [None], [x], store)
    assert len(store.calls) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer; the head
    weight_grads(work)
    torch.testing.assert_close(gx, want_x, rtol=1e-6, atol=1e-7)
    for p, w in zip(params, want):
        torch.testing.assert_close(p.grad, w, rtol=1e-6, atol=1e-7)


class _PassThrough(nn.Module):
    """Two additive weights of the output's shape: autograd may hand each the output gradient itself."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.p1, self.p2 = nn.Linear(8, 8), nn.Parameter(torch.zeros(4, 8)), nn.Parameter(torch.zeros(4, 8))

    def forward(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        return (
            2 * (self.lin(x) + self.p1 + self.p2) + other
        )  # the doubled gradient goes to lin's output and both weights


class _InputAsWeight(nn.Module):
    """A received activation used as a linear weight (not a weight of the stage: never deferred), and a 1-D weight."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.v = nn.Linear(8, 8), nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        return F.linear(self.q(x), other) + F.linear(x, self.v).unsqueeze(-1)


class _Checkpointed(nn.Module):
    """A block that checkpoints its own MLP: the recomputation in the backward runs outside the mode."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        return self.out(torch.utils.checkpoint.checkpoint(self.mlp, x + other, use_reentrant=False))


class _Hooked(nn.Module):
    """A linear weight with a gradient hook (autograd must call it with the gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.a.weight.register_hook(lambda g: 2 * g)

    def forward(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))) * other


class _OffloadedToCpu(_Hooked):
    """Saved tensors packed by a hook that returns copies (``save_on_cpu``)."""

    def forward(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        with torch.autograd.graph.save_on_cpu():
            return self.b(torch.tanh(self.a(x))) + other


@pytest.mark.parametrize("make", [_PassThrough, _InputAsWeight, _Checkpointed, _Hooked, _OffloadedToCpu])
def test_two_pending_microbatches_match_two_backwards(make) -> None:
    # I of two microbatches, then both W's (a pending W, as under ZB-H1), against two full backwards.
    torch.manual_seed(0)
    block = make()
    data = [
        (torch.randn(4, 8), torch.randn(8, 8) if make is _InputAsWeight else torch.randn(4, 8), torch.randn(4, 8))
        for _ in range(2)
    ]
    want_inputs = []
    for x, other, g in data:
        x, other = x.clone().requires_grad_(), other.clone().requires_grad_()
        block(x, other).backward(g)
        want_inputs.append((x.grad, other.grad))
    want = {n: p.grad.clone() for n, p in block.named_parameters()}
    block.zero_grad(set_to_none=True)
    works, got_inputs = [], []
    for x, other, g in data:
        x, other = x.clone().requires_grad_(), other.clone().requires_grad_()
        store = DeferredGrads(list(block.parameters()))
        with DeferWeightGrads(store):
            out = block(x, other)
        found, work = input_grads([out], [g], [x, other], store)
        works.append(work)
        got_inputs.append(found)
    for work in works:
        weight_grads(work)
    for (wx, wo), (gx, go) in zip(want_inputs, got_inputs):
        torch.testing.assert_close(gx, wx)
        torch.testing.assert_close(go, wo)
    for n, p in block.named_parameters():
        torch.testing.assert_close(p.grad, want[n], msg=n)


class _Convolutions(nn.Module):
    """Convolutions of every kind the mode defers, and two it leaves to autograd (a transposed one,
    an asymmetric "same" padding), with a norm between them whose weights I computes."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv1d(4, 6, 3, stride=2, padding=1)
        self.c2 = nn.Conv2d(4, 8, 3, padding=2, dilation=2, groups=2, bias=False)
        self.norm = nn.BatchNorm2d(8)
        self.c3 = nn.Conv2d(8, 4, (3, 1), stride=(2, 1), padding="valid")
        self.c4 = nn.Conv2d(4, 4, 3, padding="same", padding_mode="reflect")  # F.pad, then F.conv2d with padding 0
        self.even = nn.Conv2d(4, 4, 2, padding="same")  # asymmetric: left to autograd
        self.up = nn.ConvTranspose2d(4, 4, 2, stride=2)  # left to autograd
        self.c5 = nn.Conv3d(2, 3, (1, 3, 3), padding=(0, 1, 1))

    def forward(self, x: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.norm(self.c2(x)))
        y = self.up(self.even(torch.tanh(self.c4(self.c3(y)))))
        z = self.c5(y.reshape(y.shape[0], 2, 2, *y.shape[2:]))
        return z.flatten(1).sum(1, keepdim=True) * self.c1(seq).flatten(1)


def _conv_data(seed: int = 0) -> tuple[_Convolutions, torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    block = _Convolutions()
    return block, torch.randn(3, 4, 9, 9), torch.randn(3, 4, 10), torch.randn(3, 30)


@pytest.mark.parametrize("needs_seq_grad", [True, False])
def test_deferred_convolutions_match_one_backward(monkeypatch, needs_seq_grad: bool) -> None:
    block, x, seq, grad = _conv_data()
    xs = [x.clone().requires_grad_(), seq.clone().requires_grad_(needs_seq_grad)]
    block(*xs).backward(grad)
    want_inputs = [t.grad for t in xs]
    want = {n: p.grad.clone() for n, p in block.named_parameters()}
    block.zero_grad(set_to_none=True)
    store = DeferredGrads(list(block.parameters()))
    xs = [x.clone().requires_grad_(), seq.clone().requires_grad_(needs_seq_grad)]
    with DeferWeightGrads(store):
        out = block(*xs)
    needing = [t for t in xs if t.requires_grad]
    found, work = input_grads([out], [grad], needing, store)
    deferred = {id(p) for m in (block.c1, block.c2, block.c3, block.c4, block.c5) for p in m.parameters()}
    assert sorted(tuple(c.weight.shape) for c in store.calls) == sorted(
        tuple(m.weight.shape) for m in (block.c1, block.c2, block.c3, block.c4, block.c5)
    )
    assert all(p.grad is None for p in block.parameters() if id(p) in deferred)  # I added only the others' gradients
    assert all(p.grad is not None for p in block.parameters() if id(p) not in deferred)  # the norm's, even's, up's
    with pytest.raises(RuntimeError, match="second time"):  # I kept no graph
        out.backward(grad)

    def refuse(*args, **kwargs):
        raise AssertionError("W called autograd")

    monkeypatch.setattr(torch.autograd, "grad", refuse)
    weight_grads(work)
    for got, wanted in zip(found, [g for g in want_inputs if g is not None]):
        torch.testing.assert_close(got, wanted, rtol=1e-5, atol=1e-6)
    for n, p in block.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-5, atol=1e-6, msg=n)


class _ConvolutionBackwards(TorchDispatchMode):
    """The ``output_mask`` of each ``convolution_backward`` run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.masks: list[tuple[bool, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.overloadpacket is torch.ops.aten.convolution_backward:
            self.masks.append(tuple(args[-1]))
        return func(*args, **(kwargs or {}))


def test_each_convolution_gradient_runs_once_split_between_i_and_w() -> None:
    block = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.Tanh(), nn.Conv2d(4, 4, 3, bias=False), nn.Tanh(), nn.Conv2d(4, 2, 1)
    )
    x, grad = torch.randn(2, 3, 8, 8, requires_grad=True), torch.randn(2, 2, 6, 6)
    with _ConvolutionBackwards() as full:
        block(x).backward(grad)
    i_pass, w_pass = _recorded_split(_ConvolutionBackwards, block, x, grad)
    assert sorted(full.masks) == sorted([(True, True, True), (True, True, False), (True, True, True)])
    assert i_pass.masks == [(True, False, False)] * 3  # input gradients only
    assert sorted(w_pass.masks) == sorted(
        [(False, True, True), (False, True, False), (False, True, True)]
    )  # weights and biases


def _split_against_one_backward(fn, params: list[nn.Parameter], x: torch.Tensor) -> int:
    """Gradients of ``fn`` on ``x`` through the deferring split against one backward; the calls it deferred."""
    for p in params:
        p.grad = None
    ref = x.clone().requires_grad_()
    out = fn(ref)
    grad = torch.randn_like(out)
    out.backward(grad)
    want = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    store, xi = DeferredGrads(params), x.clone().requires_grad_()
    with DeferWeightGrads(store):
        got = fn(xi)
    assert got.shape == out.shape
    (gx,), work = input_grads([got], [grad], [xi], store)
    weight_grads(work)
    torch.testing.assert_close(gx, ref.grad)
    for p, w in zip(params, want):
        torch.testing.assert_close(p.grad, w)
    return store.forwarded


def test_convolution_calls_torch_accepts_in_other_forms_defer_or_stay_correct() -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(4, 5, 3, padding=1)
    assert (
        _split_against_one_backward(conv, list(conv.parameters()), torch.randn(4, 8, 8)) == 0
    )  # unbatched: left to autograd
    w = nn.Parameter(torch.randn(6, 4, 3, 5))
    x = torch.randn(2, 4, 9, 9)
    assert (
        _split_against_one_backward(lambda t: F.conv2d(t, w, padding="same", dilation=[2]), [w], x) == 1
    )  # one value, both dims
    assert _split_against_one_backward(lambda t: F.conv2d(t, w, stride=np.int64(2)), [w], x) == 1
    even = nn.Parameter(torch.randn(6, 4, 3, 2))
    assert (
        _split_against_one_backward(lambda t: F.conv2d(t, even, padding="same", dilation=[1]), [even], x) == 0
    )  # uneven


class _StridedHead(nn.Module):
    """A 1x1 convolution on every 4th pixel, copied: the block saves no input, so the gradient of
    the block before it is alive beside this block's kept tensors during I."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.conv(h[..., ::4, ::4].contiguous())


class _ConvChain(nn.Module):
    """Four convolution blocks with the pipeline hooks the profiler reads."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            [nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1), _StridedHead(), nn.Conv2d(8, 8, 1)]
        )

    def pipeline_blocks(self) -> list[nn.Module]:
        return list(self.blocks)

    def pipeline_inputs(self, batch: torch.Tensor) -> torch.Tensor:
        return batch

    def pipeline_loss(self, output: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        return output.pow(2).mean()


def test_the_modelled_input_grad_peak_bounds_a_deferring_stages() -> None:
    from lightning_pipe.planning.costs import range_costs
    from lightning_pipe.planning.profiler import _Allocations, profile_blocks

    torch.manual_seed(0)
    model = _ConvChain()
    batch = torch.randn(8, 8, 32, 32)
    profile = profile_blocks(model, batch, [4], repeats=1)
    modelled = range_costs(profile, range(1, 3), 4).input_grad_workspace_bytes  # a middle stage of blocks 1 and 2
    params = [p for b in model.blocks[1:3] for p in b.parameters()]
    x = model.blocks[0](batch[:4]).detach().requires_grad_()
    store = DeferredGrads(params)
    with _Allocations() as mem:
        with DeferWeightGrads(store):
            out = model.blocks[2](model.blocks[1](x))
            grad = torch.ones_like(out)  # the stage's incoming gradient: the model counts it apart
        kept = mem.current
        mem.restart_peaks()
        _, work = input_grads([out], [grad], [x], store)
    weight_grads(work)
    assert store.forwarded == 2
    assert modelled >= mem.peak - kept > 0  # before the block's incoming gradient was counted: 163,840 against 262,144
