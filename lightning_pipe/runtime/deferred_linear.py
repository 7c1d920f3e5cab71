"""Linear layers whose weight gradient waits for W: I computes the input gradient and keeps (input, output gradient).

Zero Bubble's ``WeightGradStore`` (Qi et al., 2023, cited in seed 001), for any ``F.linear``
a stage calls on a trainable leaf weight while split backward records its graph. Its
backward in I runs one product (the input gradient) and keeps the layer's input and output
gradient; W runs the other two, ``dW = g^T x`` and ``db = sum(g)``, into ``.grad``. Nothing
else of the graph is needed by W, so I can free the graph as it goes (no ``retain_graph``),
as a full backward does, and W is plain products, no autograd call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.overrides import TorchFunctionMode


@dataclass
class _Call:
    """One linear call's backward in I: its input, its output gradient, and the leaves it adds to."""

    x: Tensor
    grad: Tensor
    weight: Tensor
    bias: Optional[Tensor]


class LinearGrads:
    """One microbatch's deferred linear weight gradients.

    Args:
        weights: the stage's trainable tensors this microbatch's forward runs on (its weight
            version): I asks autograd for those that a deferred linear call does not cover.
    """

    def __init__(self, weights: Sequence[Tensor]) -> None:
        self.weights = [w for w in weights if w.requires_grad]
        self._ids = {id(w) for w in self.weights}
        self.forwarded = 0  # linear calls the forward deferred
        self.calls: list[_Call] = []
        self.immediate = False  # add each call's products as it is recorded (a backward with nothing to defer)
        self._done: dict[int, Tensor] = {}

    def covers(self, weight: Tensor, bias: Optional[Tensor]) -> bool:
        """Whether a linear call on ``weight`` and ``bias`` can defer: a 2-D weight of the stage (not,
        say, a received activation), a bias of the stage or constant, neither with gradient hooks
        (autograd would call them with no gradient)."""
        if weight.dim() != 2 or id(weight) not in self._ids or weight._backward_hooks:
            return False
        return bias is None or not bias.requires_grad or (id(bias) in self._ids and not bias._backward_hooks)

    def record(self, call: _Call) -> None:
        """Keep a linear call's input and output gradient for W (or, if :attr:`immediate`, add its products now)."""
        self.calls.append(call)
        if self.immediate:
            self._flush()

    def kept(self) -> list[Tensor]:
        """The tensors held from I until W: each call's input and output gradient."""
        return [t for c in self.calls for t in (c.x, c.grad)]

    def accumulate(self) -> list[Tensor]:
        """W: add each call's weight and bias gradients into ``.grad``, then forget the calls.

        Returns:
            The leaves whose gradient received a contribution, each once.
        """
        self._flush()
        done, self._done = list(self._done.values()), {}
        return done

    def _flush(self) -> None:
        with torch.no_grad():  # the inputs are activations that require grad; their products must not
            for c in self.calls:
                x, g = c.x.reshape(-1, c.x.shape[-1]), c.grad.reshape(-1, c.grad.shape[-1])
                _add_product(c.weight, g, x)
                self._done[id(c.weight)] = c.weight
                if c.bias is not None and c.bias.requires_grad:
                    _add(c.bias, g.sum(0))
                    self._done[id(c.bias)] = c.bias
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
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Optional[Tensor], store: LinearGrads) -> Tensor:  # noqa: D102
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


class DeferLinearWeights(TorchFunctionMode):
    """While active, ``F.linear`` on a weight of ``store`` (see :meth:`LinearGrads.covers`) records
    into ``store`` instead of autograd, where a graph is recorded, autocast is off and no
    saved-tensor hooks but transparent ones (:func:`keeps_saved_tensors`) are active: a block's own
    checkpoint recomputes its forward outside this mode in the backward, and would save other tensors.

    Args:
        store: where the microbatch's linear calls keep what W needs.
    """

    def __init__(self, store: LinearGrads) -> None:
        super().__init__()
        self.store = store

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Optional[dict] = None) -> Any:  # noqa: D105
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight, bias = list(args) + [kwargs.get(name) for name in ("input", "weight", "bias")[len(args) :]]
            if _deferrable(x, weight, bias, self.store):
                return _DeferredLinear.apply(x, weight, bias, self.store)
        return func(*args, **kwargs)


def _deferrable(x: Tensor, weight: Tensor, bias: Optional[Tensor], store: LinearGrads) -> bool:
    if not torch.is_grad_enabled() or torch.is_autocast_enabled(x.device.type) or not store.covers(weight, bias):
        return False
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return hooks is None or getattr(hooks[0], "keeps_saved_tensors", False)


def keeps_saved_tensors(pack: Callable[[Tensor], Any]) -> Callable[[Tensor], Any]:
    """Mark a saved-tensor pack hook that returns each tensor itself (e.g. one that only counts
    bytes): linear calls under it may still defer."""
    pack.keeps_saved_tensors = True  # type: ignore[attr-defined]
    return pack


def linear_weights_only(modules: Iterable[nn.Module]) -> bool:
    """Whether ``modules`` hold a trainable ``nn.Linear`` and every trainable parameter of two or
    more dimensions among them is an ``nn.Linear`` or ``nn.Embedding`` weight: then deferring the
    linear calls leaves I only cheap weight gradients (norms, biases, embeddings' index additions),
    and I need not keep the graph. Elsewhere (no linear layer; convolutions, raw matrices, and
    ``nn.MultiheadAttention``'s packed projection, which it applies inside a function that a
    ``TorchFunctionMode`` sees whole) the autograd split of :mod:`~lightning_pipe.runtime.split` keeps
    those weights' work for W."""
    linear, other = weight_kinds(modules)
    return linear and not other


def weight_kinds(modules: Iterable[nn.Module]) -> tuple[bool, bool]:
    """Whether ``modules`` hold a trainable ``nn.Linear`` weight, and a trainable parameter of two
    or more dimensions that is no ``nn.Linear`` or ``nn.Embedding`` weight (see :func:`linear_weights_only`)."""
    modules = list(modules)
    linear = any(isinstance(m, nn.Linear) and m.weight.requires_grad for m in modules)
    covered = {id(m.weight) for m in modules if isinstance(m, (nn.Linear, nn.Embedding))}
    heavy = [p for m in modules for p in m.parameters(recurse=False) if p.requires_grad and p.dim() >= 2]
    return linear, any(id(p) not in covered for p in heavy)
