"""``partition="profile"``: blocks per stage balancing each block's profiled F + B time, measured on rank 0."""

from __future__ import annotations

from typing import Any, Callable

import torch

from lightning_pipe.core.pipeline_plan import PipelinePlan
from lightning_pipe.planning import costs
from lightning_pipe.planning.profiler import profile_blocks
from lightning_pipe.runtime.microbatch import batch_size


def profiled_partition(module: Any, plan: PipelinePlan, rank: int, broadcast: Callable[[Any], Any]) -> tuple[int, ...]:
    """Blocks per stage of ``plan`` balancing the profiled F + B time, measured on rank 0 and sent to all ranks.

    Profiles the whole chain once (every rank still holds it before placement) on the
    module's ``example_input_array``, which Lightning users set for the model summary.

    Args:
        module: the LightningModule, before placement.
        plan: the layout whose stages the partition is for.
        rank: this process's global rank (rank 0 profiles).
        broadcast: sends rank 0's object to every rank (the strategy's ``broadcast``).

    Raises:
        ValueError: without ``example_input_array``.
        RuntimeError: on every rank, if profiling failed on rank 0.
    """

    example = getattr(module, "example_input_array", None)
    if example is None:
        raise ValueError(
            "partition='profile' needs an example batch: set self.example_input_array in "
            f"{type(module).__name__}.__init__ (one batch of pipeline inputs)"
        )
    sizes: Any = None
    if rank == 0:
        try:
            microbatch = max(batch_size(example) // plan.microbatches, 1)
            with torch.random.fork_rng():  # every rank's random stream stays the same
                profile = profile_blocks(module, example, [microbatch], repeats=2, with_loss=False)
            sizes = costs.time_balanced(profile, plan.stages, microbatch)
        except Exception as err:  # noqa: BLE001 - every rank must hear of it, not wait for sizes
            sizes = f"{type(err).__name__}: {err}"
    sizes = broadcast(sizes)
    if isinstance(sizes, str):
        raise RuntimeError(f"profiling the blocks for partition='profile' failed on rank 0: {sizes}")
    return tuple(sizes)
