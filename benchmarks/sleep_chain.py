"""A cost-model chain: blocks that sleep set times in forward, input-gradient and weight-gradient.

Sleeping blocks let many pipeline stages share few cores while the schedule, not the cores,
sets the step time, so measured runs can be compared with :func:`lightning_pipe.schedules.simulate`.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
from torch import Tensor, nn

from lightning_pipe.schedules.actions import Action, Kind

Costs = tuple[float, float, float]


class _SleepInBackward(torch.autograd.Function):
    """Identity whose backward sleeps: put on the input path it costs I, on the weight path W.
    Plain ops around it (the multiply) let autograd run each path only when it is needed."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, seconds: float) -> Tensor:
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        time.sleep(ctx.seconds)
        return grad, None


class SleepBlock(nn.Module):
    """``x * w`` whose forward, input-gradient and weight-gradient take set times.

    Args:
        dim: width of ``x`` and ``w``.
        costs: seconds of forward, input-gradient and weight-gradient work.
    """

    def __init__(self, dim: int, costs: Costs) -> None:
        super().__init__()
        self.w, self.costs = nn.Parameter(torch.ones(dim)), costs

    def forward(self, x: Tensor) -> Tensor:
        """Sleep the forward cost, then multiply through the two sleeping backward paths."""
        forward, input_grad, weight_grad = self.costs
        time.sleep(forward)
        return _SleepInBackward.apply(x, input_grad) * _SleepInBackward.apply(self.w, weight_grad)


class SleepChain(nn.Module):
    """``depth * blocks_per_stage`` sleeping blocks with a mean-square loss.

    It defines the pipeline hooks of :class:`lightning_pipe.PipelineMixin`, so a
    :class:`lightning_pipe.PipelineEngine` runs it directly; partition it "uniform".

    Args:
        depth: pipeline stages the chain is meant for.
        blocks_per_stage: blocks on each stage.
        costs: seconds of forward, input-gradient and weight-gradient work per block.
        dim: width of the activations.
    """

    def __init__(self, depth: int, blocks_per_stage: int, costs: Costs, dim: int = 16) -> None:
        super().__init__()
        self.depth, self.blocks_per_stage, self.costs = depth, blocks_per_stage, costs
        self.blocks = nn.ModuleList(SleepBlock(dim, costs) for _ in range(depth * blocks_per_stage))

    def forward(self, x: Tensor) -> Tensor:
        """Run every block in order (one process, no pipeline)."""
        for block in self.blocks:
            x = block(x)
        return x

    def pipeline_blocks(self) -> list[nn.Module]:
        """The chain of blocks."""
        return list(self.blocks)

    def pipeline_inputs(self, batch: Tensor) -> Tensor:
        """The batch is the input."""
        return batch

    def pipeline_loss(self, output: Tensor, batch: Tensor) -> Tensor:
        """Mean square of the output."""
        return output.pow(2).mean()

    def predicted_cost(self, virtual: int = 1) -> Callable[[Action], float]:
        """Simulator cost of each action for this chain, partitioned uniformly over
        ``depth * virtual`` stages (``virtual`` must divide ``blocks_per_stage``).

        Stage 0's input needs no gradient, so its whole backward (including the input-path
        part of its later blocks) is weight work.
        """
        f, i, w = self.costs
        if self.blocks_per_stage % virtual:
            raise ValueError(f"{self.blocks_per_stage} blocks per stage cannot be cut into {virtual} virtual stages")
        k = self.blocks_per_stage // virtual

        def cost(a: Action) -> float:
            first = a.stage == 0
            table = {
                Kind.FORWARD: k * f,
                Kind.BACKWARD: (k - first) * i + k * w,
                Kind.INPUT_GRAD: 0.0 if first else k * i,
                Kind.WEIGHT_GRAD: ((k - 1) * i + k * w) if first else k * w,
            }
            return table.get(a.kind, 0.0)

        return cost
