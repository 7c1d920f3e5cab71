"""Linear and convolution layers whose weight gradient waits for W: I keeps (input, output gradient) for it.

Zero Bubble's ``WeightGradStore`` (Zero Bubble Pipeline Parallelism, Qi et al., 2023), for any ``F.linear``
or ``F.conv1d/2d/3d`` a stage calls on a trainable leaf weight while split backward records
its graph. Its backward in I computes only the input gradient and keeps the layer's input and
output gradient; W computes the rest into ``.grad``: for a linear layer the products
``dW = g^T x`` and ``db = sum(g)``, for a convolution the weight and bias parts of the same
``convolution_backward`` a full backward runs. Nothing else of the graph is needed by W, so I
can free the graph as it goes (no ``retain_graph``), as a full backward does, and W calls no
autograd.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.overrides import TorchFunctionMode


@dataclass(frozen=True)
class _Conv:
    """A convolution's geometry, one entry per spatial dimension (what ``convolution_backward`` takes)."""

    stride: list[int]
    padding: list[int]
    dilation: list[int]
    groups: int

    def backward(self, grad: Tensor, x: Tensor, weight: Tensor, mask: list[bool]) -> tuple:
        """The parts of a convolution's backward that ``mask`` asks for: (input, weight, bias) gradients."""
        zeros = [0] * len(self.stride)
        return torch.ops.aten.convolution_backward(
            grad,
            x,
            weight,
            [weight.shape[0]] if mask[2] else None,
            self.stride,
            self.padding,
            self.dilation,
            False,
            zeros,
            self.groups,
            mask,
        )


@dataclass
class _Call:
    """One deferred call's backward in I: its input, its output gradient, the leaves it adds to,
    and, for a convolution, its geometry (``None``: a linear call)."""

    x: Tensor
    grad: Tensor
    weight: Tensor
    bias: Optional[Tensor]
    conv: Optional[_Conv] = None


class DeferredGrads:
    """One microbatch's deferred linear and convolution weight gradients.

    Args:
        weights: the stage's trainable tensors this microbatch's forward runs on (its weight
            version): I asks autograd for those that a deferred call does not cover. A callable
            gives them as they are at each call: with FSDP replicas a block runs on its gathered
            parameters, which exist only from the block's first all-gather on.
    """

    def __init__(self, weights: Union[Sequence[Tensor], Callable[[], Sequence[Tensor]]]) -> None:
        self._resolve = weights if callable(weights) else None
        self._weights = [w for w in (weights() if callable(weights) else weights) if w.requires_grad]
        self._ids = {id(w) for w in self._weights}
        self.forwarded = 0  # calls the forward deferred
        self.calls: list[_Call] = []
        self.immediate = False  # add each call's weight gradients as it is recorded (a backward with nothing to defer)
        self._done: dict[int, Tensor] = {}

    @property
    def weights(self) -> list[Tensor]:
        """The stage's trainable tensors, as they are now."""
        if self._resolve is not None:
            self._weights = [w for w in self._resolve() if w.requires_grad]
            self._ids = {id(w) for w in self._weights}
        return self._weights

    def covers(self, weight: Tensor, bias: Optional[Tensor]) -> bool:
        """Whether a call on ``weight`` and ``bias`` can defer: a weight of the stage (not, say, a
        received activation), a bias of the stage or constant, neither with gradient hooks
        (autograd would call them with no gradient)."""
        if id(weight) not in self._ids and self._resolve is not None:
            self.weights  # noqa: B018 - a block gathered since: its parameters resolved again
        if id(weight) not in self._ids or weight._backward_hooks:
            return False
        return bias is None or not bias.requires_grad or (id(bias) in self._ids and not bias._backward_hooks)

    def record(self, call: _Call) -> None:
        """Keep a call's input and output gradient for W (or, if :attr:`immediate`, add its weight gradients now)."""
        self.calls.append(call)
        if self.immediate:
            self._flush()

    def kept(self) -> list[Tensor]:
        """The tensors held from I until W: each call's input and output gradient."""
        return [t for c in self.calls for t in (c.x, c.grad)]

    def accumulate(
        self,
        report: Optional[Callable[[list[Tensor]], None]] = None,
        prepare: Optional[Callable[[list[Tensor]], None]] = None,
    ) -> list[Tensor]:
        """W: add each call's weight and bias gradients into ``.grad``, then forget the calls.

        Args:
            report: called with each leaf as soon as its last call of the microbatch has added
                into it (a replica all-reduce bucket adopts the gradient then, runtime/buckets.py:
                one new product alive beside the bucket at a time, not every weight's at once).
            prepare: called with each call's leaves before its products are added (a bucket makes
                a leaf without a gradient a view of itself: the products then go into it in place).

        Returns:
            The leaves whose gradient received a contribution, each once (none where ``report`` took them).
        """
        self._flush(report, prepare)
        done, self._done = list(self._done.values()), {}
        return [] if report is not None else done

    def _flush(
        self,
        report: Optional[Callable[[list[Tensor]], None]] = None,
        prepare: Optional[Callable[[list[Tensor]], None]] = None,
    ) -> None:
        last = {}  # each leaf's last call: its gradient is complete after it
        for i, c in enumerate(self.calls):
            last[id(c.weight)] = i
            if c.bias is not None and c.bias.requires_grad:
                last[id(c.bias)] = i
        with torch.no_grad():  # the inputs are activations that require grad; their products must not
            for i, c in enumerate(self.calls):
                weight_grad: Optional[Tensor] = None
                biased = c.bias is not None and c.bias.requires_grad
                if prepare is not None:
                    prepare([t for t in (c.weight, c.bias if biased else None) if t is not None and t.grad is None])
                if c.conv is None:
                    x, g = c.x.reshape(-1, c.x.shape[-1]), c.grad.reshape(-1, c.grad.shape[-1])
                    _add_product(c.weight, g, x)
                    bias_grad = g.sum(0) if biased else None
                else:
                    _, weight_grad, bias_grad = c.conv.backward(c.grad, c.x, c.weight, [False, True, biased])
                    _add(c.weight, weight_grad)
                self._done[id(c.weight)] = c.weight
                if biased:
                    _add(c.bias, bias_grad)  # type: ignore[arg-type]
                    self._done[id(c.bias)] = c.bias  # type: ignore[arg-type]
                if report is not None:
                    complete = [t for t in (c.weight, c.bias) if t is not None and last.get(id(t)) == i]
                    if complete:
                        weight_grad = bias_grad = None  # the products, adopted or added: freed before the next
                        report(complete)
        self.calls.clear()


def _add_product(w: Tensor, g: Tensor, x: Tensor) -> None:
    """``w.grad += g^T x``, in place where a gradient exists (a view of an all-reduce bucket stays one)."""
    if w.grad is None:
        w.grad = torch.mm(g.t(), x)
    else:
        w.grad.addmm_(g.t(), x)


def _add(b: Tensor, g: Tensor) -> None:
    if b.grad is None:
        b.grad = g
    else:
        b.grad.add_(g)


class _DeferredLinear(torch.autograd.Function):
    """``F.linear`` whose backward computes the input gradient and leaves the weight's to W."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Optional[Tensor], store: DeferredGrads) -> Tensor:  # noqa: D102
        ctx.save_for_backward(x, weight)  # values, checked for changes in place; saved-tensor hooks may return copies
        ctx.weight, ctx.bias, ctx.store = weight, bias, store  # the leaves W adds into
        store.forwarded += 1
        return F.linear(x, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], None, None, None]:  # noqa: D102
        x, weight = ctx.saved_tensors
        ctx.store.record(_Call(x, grad, ctx.weight, ctx.bias))
        return (torch.matmul(grad, weight) if ctx.needs_input_grad[0] else None), None, None, None


class _DeferredConv(torch.autograd.Function):
    """``F.conv1d/2d/3d`` whose backward computes the input gradient and leaves the weight's and bias's to W."""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, weight: Tensor, bias: Optional[Tensor], conv: _Conv, store: DeferredGrads
    ) -> Tensor:  # noqa: D102
        ctx.save_for_backward(x, weight)  # as _DeferredLinear
        ctx.weight, ctx.bias, ctx.conv, ctx.store = weight, bias, conv, store
        store.forwarded += 1
        return _CONVS[weight.dim() - 2](x, weight, bias, conv.stride, conv.padding, conv.dilation, conv.groups)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], None, None, None, None]:  # noqa: D102
        x, weight = ctx.saved_tensors
        ctx.store.record(_Call(x, grad, ctx.weight, ctx.bias, ctx.conv))
        input_grad = ctx.conv.backward(grad, x, weight, [True, False, False])[0] if ctx.needs_input_grad[0] else None
        return input_grad, None, None, None, None


_CONVS = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}  # by spatial dimensions
_CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")


def _conv_geometry(weight: Tensor, stride: Any, padding: Any, dilation: Any, groups: Any) -> Optional[_Conv]:
    """A convolution call's geometry as lists, one entry per spatial dimension, or ``None`` where it
    has no such form (an asymmetric ``"same"``, a value torch would reject): then autograd keeps the call."""
    n = weight.dim() - 2

    def as_list(v: Any) -> list[int]:
        values = [operator.index(v)] if not isinstance(v, Sequence) else [operator.index(e) for e in v]
        return values * n if len(values) == 1 else values  # one value: every dimension, as torch reads it

    try:
        stride, dilation = as_list(stride), as_list(dilation)
        if padding == "valid":
            padding = 0
        elif padding == "same":
            totals = [d * (k - 1) for d, k in zip(dilation, weight.shape[2:])]
            if any(t % 2 for t in totals) or any(s != 1 for s in stride):
                return None
            padding = [t // 2 for t in totals]
        conv = _Conv(stride, as_list(padding), dilation, operator.index(groups))
    except (TypeError, ValueError):
        return None
    return conv if len(conv.stride) == len(conv.padding) == len(conv.dilation) == n else None


class DeferWeightGrads(TorchFunctionMode):
    """While active, ``F.linear`` on a 2-D weight and ``F.conv1d/2d/3d`` on a weight of ``store``
    (see :meth:`DeferredGrads.covers`) record into ``store`` instead of autograd, where a graph
    is recorded, autocast is off and no saved-tensor hooks but transparent ones
    (:func:`keeps_saved_tensors`) are active: a block's own checkpoint recomputes its forward
    outside this mode in the backward, and would save other tensors.

    Args:
        store: where the microbatch's linear and convolution calls keep what W needs.
    """

    def __init__(self, store: DeferredGrads) -> None:
        super().__init__()
        self.store = store

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Optional[dict] = None) -> Any:  # noqa: D105
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight, bias = list(args) + [kwargs.get(name) for name in ("input", "weight", "bias")[len(args) :]]
            if weight.dim() == 2 and _deferrable(x, weight, bias, self.store):
                return _DeferredLinear.apply(x, weight, bias, self.store)
        elif func in _CONVS.values():
            call = dict(zip(_CONV_ARGS, args), **kwargs)
            x, weight, bias = call["input"], call["weight"], call.get("bias")
            # Batched input only: convolution_backward takes no other (unbatched, autograd keeps the call).
            if (
                _CONVS.get(weight.dim() - 2) is func
                and x.dim() == weight.dim()
                and _deferrable(x, weight, bias, self.store)
            ):
                conv = _conv_geometry(
                    weight,
                    call.get("stride", 1),
                    call.get("padding", 0),
                    call.get("dilation", 1),
                    call.get("groups", 1),
                )
                if conv is not None:
                    return _DeferredConv.apply(x, weight, bias, conv, self.store)
        return func(*args, **kwargs)


def _deferrable(x: Tensor, weight: Tensor, bias: Optional[Tensor], store: DeferredGrads) -> bool:
    if not torch.is_grad_enabled() or torch.is_autocast_enabled(x.device.type) or not store.covers(weight, bias):
        return False
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return hooks is None or getattr(hooks[0], "keeps_saved_tensors", False)


def keeps_saved_tensors(pack: Callable[[Tensor], Any]) -> Callable[[Tensor], Any]:
    """Mark a saved-tensor pack hook that returns each tensor itself (e.g. one that only counts
    bytes): linear and convolution calls under it may still defer."""
    pack.keeps_saved_tensors = True  # type: ignore[attr-defined]
    return pack


_DEFERRED = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)  # modules whose weight gradients W computes


def deferrable_weights_only(modules: Iterable[nn.Module]) -> bool:
    """Whether ``modules`` hold a trainable ``nn.Linear`` or ``nn.Conv1d/2d/3d`` and every trainable
    parameter of two or more dimensions among them is such a layer's or an ``nn.Embedding``'s
    weight: then deferring those calls leaves I only cheap weight gradients (norms, biases,
    embeddings' index additions), and I need not keep the graph. Elsewhere (no such layer;
    transposed convolutions, raw matrices, and ``nn.MultiheadAttention``'s packed projection,
    which it applies inside a function that a ``TorchFunctionMode`` sees whole) the autograd split
    of :mod:`~lightning_pipe.runtime.autograd.backward_split` keeps those weights' work for W."""
    deferred, other = weight_kinds(modules)
    return deferred and not other


def weight_kinds(modules: Iterable[nn.Module]) -> tuple[bool, bool]:
    """Whether ``modules`` hold a trainable weight whose gradient split backward defers (linear,
    convolution), and a trainable parameter of two or more dimensions that is no such layer's or
    ``nn.Embedding``'s weight (see :func:`deferrable_weights_only`)."""
    modules = list(modules)
    deferred = any(isinstance(m, _DEFERRED) and m.weight.requires_grad for m in modules)
    covered = {id(m.weight) for m in modules if isinstance(m, (*_DEFERRED, nn.Embedding))}
    heavy = [p for m in modules for p in m.parameters(recurse=False) if p.requires_grad and p.dim() >= 2]
    return deferred, any(id(p) not in covered for p in heavy)


def undeferred_gradient_bytes(module: nn.Module) -> int:
    """Bytes of the gradients of ``module``'s trainable parameters that no deferred call takes
    (norms, biases outside linear and convolution layers, embeddings): where split backward
    defers, I computes them itself, and its one autograd call returns them all together at its end
    (backward_split.py, ``_eager_input_grads``), each held from when its node runs until then."""
    deferred = {
        id(p) for m in module.modules() if isinstance(m, _DEFERRED) for p in (m.weight, m.bias) if p is not None
    }
    others = {id(p): p for p in module.parameters() if p.requires_grad and id(p) not in deferred}
    return sum(p.numel() * p.element_size() for p in others.values())
