"""Split one microbatch's backward into input gradients (I) and weight gradients (W) with autograd.

No hand-written backward: the autograd graph is cut where the path to the weights leaves
the path to the stage inputs. A node on the input path that also feeds a weight-only
subgraph (e.g. ``addmm(x, W.t())``) is a *frontier* node. I computes the stage-input
gradients and captures the gradient arriving at each frontier node, which autograd already
computes on the way; the node's weight part is skipped since no requested input needs it.
W later runs only the weight parts from those captured gradients. Each part of each node
runs once, and no forward is re-run.

Built-in operators compute only the gradients a pass asks for. A custom
``torch.autograd.Function`` that takes both an activation and a weight cannot: its
``ctx.needs_input_grad`` is fixed at forward time, so its backward runs in full in I and
again in W (results stay correct; that node's work is done twice, and a warning says so).

On a stage whose only weights of two or more dimensions are linear, convolution and embedding
weights, the executor records the forward's linear and convolution calls instead
(:mod:`~lightning_pipe.runtime.autograd.deferred_weights`): I is then one autograd call that frees the
graph as it goes, computing every other weight's gradient with the input gradients, and W is
those layers' weight gradients, no autograd.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node

from lightning_pipe.runtime.autograd.deferred_weights import DeferredGrads


@dataclass
class WeightWork:
    """What W needs: each frontier node's output edges, the gradients I captured there, and
    the weights below it; the weights whose gradients I computed itself (see :func:`input_grads`);
    the deferred linear and convolution calls; and, where I left the whole backward to W, its roots."""

    edges: list[list[GradientEdge]]
    grads: list[list[Optional[Tensor]]]
    weights: list[list[Tensor]]
    early: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    deferred: Optional[DeferredGrads] = None
    added: list[Tensor] = field(default_factory=list)  # weights whose gradient I already added (W reports them)
    roots: list[Tensor] = field(default_factory=list)
    root_grads: list[Optional[Tensor]] = field(default_factory=list)

    def captured(self) -> list[Tensor]:
        """The gradients I captured at the frontier nodes."""
        return [g for group in self.grads for g in group if g is not None]

    def kept(self) -> list[Tensor]:
        """The tensors held from I until W beyond the graph: captured gradients, early weight
        gradients, and the deferred calls' inputs and output gradients."""
        return self.captured() + [g for _, g in self.early] + (self.deferred.kept() if self.deferred else [])


def _children(node: Node) -> list[Node]:
    return [child for child, _ in node.next_functions if child is not None]


def _leaf(node: Node) -> Optional[Tensor]:
    return getattr(node, "variable", None)


def _weight_only(roots: Sequence[Node], inputs: set[int]) -> dict[Node, bool]:
    """For every node reachable from ``roots``: does it lead to weights (non-input leaves) only?"""
    result: dict[Node, bool] = {}
    stack: list[tuple[Node, bool]] = [(r, False) for r in roots]
    while stack:
        node, expanded = stack.pop()
        if node in result:
            continue
        leaf = _leaf(node)
        if leaf is not None:
            result[node] = id(leaf) not in inputs
            continue
        children = _children(node)
        if not expanded:
            stack.append((node, True))
            stack.extend((c, False) for c in children if c not in result)
            continue
        result[node] = bool(children) and all(result[c] for c in children)
    return result


@dataclass
class _Front:
    """A frontier node, the weights under its weight-only children, and every node on the way (leaves included)."""

    node: Node
    weights: list[Tensor]
    below: set[Node]


def _below(node: Node, weight_only: dict[Node, bool]) -> _Front:
    found, stack, seen = [], [c for c in _children(node) if weight_only[c]], set()
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        leaf = _leaf(current)
        if leaf is not None:
            found.append(leaf)
        stack.extend(_children(current))
    return _Front(node, found, seen)


def _frontier(roots: Sequence[Node], inputs: set[int]) -> list[_Front]:
    """Nodes on the input path with a weight-only child, with what lies under those children.

    A root that is itself weight-only is a frontier of its own (its gradient is given)."""
    weight_only = _weight_only(roots, inputs)
    front = []
    for node, only_weights in weight_only.items():
        if _leaf(node) is not None:
            continue
        if (not only_weights and any(weight_only[c] for c in _children(node))) or (only_weights and node in roots):
            front.append(_below(node, weight_only))
    return front


def _sharing(front: list[_Front]) -> tuple[list[_Front], list[_Front]]:
    """Split the frontier into nodes whose weight subgraph is their own, and nodes sharing one.

    W cannot run a shared part from each frontier node separately: a node that several share
    would run twice (autograd has freed what it saved), and a call from the later frontier
    node would also re-run the input path down to the earlier one, which leads to the same
    weights, adding its gradient twice (one ``nn.Linear`` applied twice in a stage)."""
    users: dict[Node, int] = {}
    for f in front:
        for n in f.below:
            users[n] = users.get(n, 0) + 1
    shared = [any(users[n] > 1 for n in f.below) for f in front]
    return [f for f, s in zip(front, shared) if not s], [f for f, s in zip(front, shared) if s]


_WARNED: set[str] = set()


def _warn_custom_functions(front: list[_Front]) -> None:
    """Warn, once per class, of a custom ``autograd.Function`` on the frontier: its backward runs in I and in W."""
    for f in front:
        name = type(f.node).__name__
        if isinstance(f.node, torch.autograd.function.BackwardCFunction) and name not in _WARNED:
            _WARNED.add(name)
            warnings.warn(
                f"split backward: the custom autograd.Function {name.removesuffix('Backward')} takes both an "
                "activation "
                "and a weight, so its backward runs twice (in I for the input gradient, in W for the weight "
                "gradient; ctx.needs_input_grad is fixed at forward time). Gradients stay correct; to run it once, "
                "split it into an activation part and a weight part, or train without split_backward.",
                stacklevel=3,
            )


def _outputs(node: Node) -> int:
    return max(len(getattr(node, "_input_metadata", ())), 1)


def _warn_shared(shared: list[_Front]) -> None:
    """Warn, once per set of weight shapes, that weights shared by several operations of a stage get gradients in I."""
    shapes = sorted({tuple(w.shape) for f in shared for w in f.weights})
    if shapes and f"shared {shapes}" not in _WARNED:
        _WARNED.add(f"shared {shapes}")
        warnings.warn(
            f"split backward: weights of shapes {shapes} feed several operations of one stage (a module applied "
            "twice, or a weight transformed once and used twice), so their gradients are computed in I with the "
            "input gradients instead of in W. Gradients stay correct; only W's share of the work is smaller.",
            stacklevel=3,
        )


def input_grads(
    roots: Sequence[Tensor],
    grads: Sequence[Optional[Tensor]],
    inputs: Sequence[Tensor],
    deferred: Optional[DeferredGrads] = None,
) -> tuple[list[Optional[Tensor]], WeightWork]:
    """I: gradients of ``roots`` w.r.t. ``inputs``, and what W needs to finish the weights.

    Weights whose subgraph several frontier nodes share get their gradients here, in the same
    autograd call (see :func:`_sharing`); W only adds them. With no input to differentiate (the
    first stage) I does nothing and W is a plain backward.

    Args:
        roots: the stage outputs (or the loss) to backpropagate from.
        grads: the gradient of each root (``None`` for a scalar loss).
        inputs: stage inputs that require grad (empty on stage 0).
        deferred: where the forward's linear and convolution calls keep what W needs (see
            :mod:`~lightning_pipe.runtime.autograd.deferred_weights`), on a stage whose only weights of two
            or more dimensions are linear, convolution or embedding weights: then I frees the
            graph as it goes, and computes every other weight's gradient itself (norms, biases,
            embeddings).
    """
    if deferred is not None and deferred.forwarded:  # else (autocast, say) nothing was deferred: the autograd split
        return _eager_input_grads(list(roots), list(grads), list(inputs), deferred)
    if not inputs:  # nothing to send: W is the whole backward (see weight_grads)
        return [], WeightWork([], [], [], roots=list(roots), root_grads=list(grads))
    nodes = [r.grad_fn for r in roots if r.grad_fn is not None]
    front = _frontier(nodes, {id(t) for t in inputs})
    _warn_custom_functions(front)
    own, shared = _sharing(front)
    _warn_shared(shared)
    early = list({id(w): w for f in shared for w in f.weights}.values())
    edges = [[GradientEdge(f.node, i) for i in range(_outputs(f.node))] for f in own]
    flat = [e for group in edges for e in group]
    wanted = [*inputs, *flat, *early]
    result = (
        list(torch.autograd.grad(list(roots), wanted, list(grads), retain_graph=True, allow_unused=True))
        if wanted
        else []
    )
    captured, start, grouped = result[len(inputs) : len(inputs) + len(flat)], 0, []
    for group in edges:
        grouped.append(captured[start : start + len(group)])
        start += len(group)
    others = _storages(t for t in result[: len(inputs) + len(flat)] if t is not None)
    done = [(w, _unshared(g, others)) for w, g in zip(early, result[len(inputs) + len(flat) :]) if g is not None]
    return result[: len(inputs)], WeightWork(edges, grouped, [f.weights for f in own], done)


def _eager_input_grads(
    roots: list[Tensor], grads: list[Optional[Tensor]], inputs: list[Tensor], deferred: DeferredGrads
) -> tuple[list[Optional[Tensor]], WeightWork]:
    """I where the linear and convolution calls defer their weight gradients: one autograd call
    for the inputs and every other weight, the graph freed as it goes. With no input to differentiate (stage 0) the
    whole backward is left to W, which has nothing to wait for."""
    if not inputs:
        return [], WeightWork([], [], [], deferred=deferred, roots=roots, root_grads=grads)
    weights = [w for w in deferred.weights if w.requires_grad]  # one frozen since the forward has none
    result = torch.autograd.grad(roots, [*inputs, *weights], grads, allow_unused=True)
    # A gradient passed through to a weight may be one of these: the input gradients sent on, the
    # deferred calls' output gradients kept for W, the gradients received (see _unshared).
    taken = _storages(
        [*(g for g in result[: len(inputs)] if g is not None), *deferred.kept(), *(g for g in grads if g is not None)]
    )
    added = []
    for w, g in zip(weights, result[len(inputs) :]):
        if g is not None:  # added now, not held until W (an embedding's dense gradient is large); W reports it
            g = _unshared(g, taken)
            taken.add(g.untyped_storage().data_ptr())
            _accumulate(w, g, set())
            added.append(w)
    return list(result[: len(inputs)]), WeightWork([], [], [], deferred=deferred, added=added)


def _storages(tensors: Iterable[Tensor]) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


def _unshared(g: Tensor, taken: set[int]) -> Tensor:
    """``g``, or a copy of it where it shares memory with one of the ``taken`` storages.

    An operation that passes its gradient through (``x + b`` with ``b`` of ``x``'s shape) gives
    the weight the very tensor I captured and sent on as the input gradient: adopted as
    ``.grad``, the next microbatch's W would add into it while its send may still read it."""
    return g.clone() if g.untyped_storage().data_ptr() in taken else g


def _accumulate(w: Tensor, g: Tensor, taken: set[int]) -> None:
    """Add ``g`` to ``w.grad`` as autograd does: in place if a gradient exists (a view of a replica
    all-reduce bucket stays one), else it becomes the gradient (a copy if it shares ``taken`` memory)."""
    if w.grad is None:
        w.grad = _unshared(g, taken)
    else:
        w.grad.add_(g)


def weight_grads(
    work: WeightWork,
    report: Optional[Callable[[list[Tensor]], None]] = None,
    prepare: Optional[Callable[[list[Tensor]], None]] = None,
) -> list[Tensor]:
    """W: run the weight parts from the gradients captured by I, one autograd call per frontier
    node (one call for all would re-run the input path between them: autograd runs every node
    on a path from its roots to its inputs); accumulate into ``.grad``.

    Frontier nodes handed to W share no weights (see :func:`_sharing`), so each weight is
    written once here. A weight's first gradient that is one of I's own gradients (passed
    through) is copied, never adopted (see :func:`_unshared`).

    Where I left the whole backward to W (no input gradient), W is a plain backward: each gradient
    is added as it goes, as in any full backward (so its new gradients never all exist beside the
    ones held), and the parameters' accumulation hooks report them, so none is returned.

    ``report``: called with the deferred calls' weights as each one's gradient is complete (see
    :meth:`DeferredGrads.accumulate`), so that an all-reduce bucket adopts it before the next
    product exists; those are then not returned. ``prepare``: called with a deferred call's leaves
    before its products are added (a bucket makes their gradients views of itself first, so the
    products go into it in place).

    Returns:
        The weights whose gradient received this microbatch's contribution, each once.
    """
    if work.roots and work.deferred is None:  # no input gradient: a full backward, each gradient added as it goes
        torch.autograd.backward(work.roots, work.root_grads)
        return []  # reported by the parameters' accumulation hooks, as for any full backward
    updated, taken = [], _storages(work.captured())
    for edges, grads, weights in zip(work.edges, work.grads, work.weights):
        pairs = [(e, g) for e, g in zip(edges, grads) if g is not None]
        if not pairs or not weights:
            continue
        results = torch.autograd.grad([e for e, _ in pairs], weights, [g for _, g in pairs], allow_unused=True)
        for w, g in zip(weights, results):
            if g is not None:
                _accumulate(w, g, taken)
                updated.append(w)
    if (
        work.roots and work.deferred is not None and work.deferred.weights
    ):  # I left the whole backward to W (no input gradient)
        work.deferred.immediate = True  # as a full backward: each call's weight gradients at once, its tensors freed
        results = torch.autograd.grad(work.roots, work.deferred.weights, work.root_grads, allow_unused=True)
        work.early += [(w, g) for w, g in zip(work.deferred.weights, results) if g is not None]
    for w, g in work.early:
        _accumulate(w, g, set())  # already unshared in I
        updated.append(w)
    if work.deferred is not None:  # each weight once, also where I's gradient and a product both went into it
        reported = {id(w) for c in work.deferred.calls for w in (c.weight, c.bias) if w is not None}
        done = work.deferred.accumulate(report, prepare)
        # Reported already: a weight several calls share only once its last call added into it.
        rest = [w for w in [*updated, *work.added] if report is None or id(w) not in reported]
        updated = list({id(w): w for w in [*rest, *done]}.values())
    return updated
