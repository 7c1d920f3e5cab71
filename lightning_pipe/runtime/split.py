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
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node


@dataclass
class WeightWork:
    """What W needs: each frontier node's output edges, the gradients I captured there, and
    the weights below it."""

    edges: list[list[GradientEdge]]
    grads: list[list[Optional[Tensor]]]
    weights: list[list[Tensor]]


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


def _weights_below(node: Node, weight_only: dict[Node, bool]) -> list[Tensor]:
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
    return found


def _frontier(roots: Sequence[Node], inputs: set[int]) -> list[tuple[Node, list[Tensor]]]:
    """Nodes on the input path with a weight-only child, and the weights under those children.

    A root that is itself weight-only is a frontier of its own (its gradient is given)."""
    weight_only = _weight_only(roots, inputs)
    front = []
    for node, only_weights in weight_only.items():
        if _leaf(node) is not None:
            continue
        if (not only_weights and any(weight_only[c] for c in _children(node))) or (only_weights and node in roots):
            front.append((node, _weights_below(node, weight_only)))
    return front


_WARNED: set[str] = set()


def _warn_custom_functions(front: list[tuple[Node, list[Tensor]]]) -> None:
    """Warn, once per class, of a custom ``autograd.Function`` on the frontier: its backward runs in I and again in W."""
    for node, _ in front:
        name = type(node).__name__
        if isinstance(node, torch.autograd.function.BackwardCFunction) and name not in _WARNED:
            _WARNED.add(name)
            warnings.warn(
                f"split backward: the custom autograd.Function {name.removesuffix('Backward')} takes both an activation "
                "and a weight, so its backward runs twice (in I for the input gradient, in W for the weight "
                "gradient; ctx.needs_input_grad is fixed at forward time). Gradients stay correct; to run it once, "
                "split it into an activation part and a weight part, or train without split_backward.",
                stacklevel=3,
            )


def _outputs(node: Node) -> int:
    return max(len(getattr(node, "_input_metadata", ())), 1)


def input_grads(roots: Sequence[Tensor], grads: Sequence[Optional[Tensor]], inputs: Sequence[Tensor]) -> tuple[list[Optional[Tensor]], WeightWork]:
    """I: gradients of ``roots`` w.r.t. ``inputs``, and what W needs to finish the weights.

    Args:
        roots: the stage outputs (or the loss) to backpropagate from.
        grads: the gradient of each root (``None`` for a scalar loss).
        inputs: stage inputs that require grad (empty on stage 0).
    """
    nodes = [r.grad_fn for r in roots if r.grad_fn is not None]
    front = _frontier(nodes, {id(t) for t in inputs})
    _warn_custom_functions(front)
    edges = [[GradientEdge(node, i) for i in range(_outputs(node))] for node, _ in front]
    flat = [e for group in edges for e in group]
    result = torch.autograd.grad(
        list(roots), [*inputs, *flat], list(grads), retain_graph=True, allow_unused=True
    ) if (inputs or flat) else ()  # fmt: skip
    captured = list(result[len(inputs) :])
    grouped, start = [], 0
    for group in edges:
        grouped.append(captured[start : start + len(group)])
        start += len(group)
    return list(result[: len(inputs)]), WeightWork(edges, grouped, [w for _, w in front])


def weight_grads(work: WeightWork) -> list[Tensor]:
    """W: run the weight parts from the gradients captured by I; accumulate into ``.grad``.

    A gradient that existed before is added to in place, as autograd does (one that is a view
    of a replica all-reduce bucket stays one); one set by this call may be a tensor autograd
    still uses for another frontier node, so it is never written in place here.

    Returns:
        The weights whose gradient received this microbatch's contribution, each once.
    """
    updated: dict[int, tuple[Tensor, bool]] = {}  # weight, and whether this call set its gradient
    for edges, grads, weights in zip(work.edges, work.grads, work.weights):
        pairs = [(e, g) for e, g in zip(edges, grads) if g is not None]
        if not pairs or not weights:
            continue
        results = torch.autograd.grad([e for e, _ in pairs], weights, [g for _, g in pairs], allow_unused=True)
        for w, g in zip(weights, results):
            if g is None:
                continue
            if w.grad is None:
                w.grad = g
            elif id(w) in updated and updated[id(w)][1]:
                w.grad = w.grad + g
            else:
                w.grad.add_(g)
            updated.setdefault(id(w), (w, w.grad is g))
    return [w for w, _ in updated.values()]
