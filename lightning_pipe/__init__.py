"""lightning_pipe: pipeline-parallel training (GPipe, 1F1B, PipeDream-2BW, split backward) as a Lightning strategy."""

from lightning_pipe.autoplan import AutoPlanner
from lightning_pipe.module import PipelineMixin
from lightning_pipe.monitor import PipelineMonitor
from lightning_pipe.layout import PipelinePlan
from lightning_pipe.runtime.engine import PipelineEngine
from lightning_pipe.runtime.groups import PipelineGroups
from lightning_pipe.runtime.p2p import PipelineAbortedError
from lightning_pipe.runtime.placement import Placement, place
from lightning_pipe.simulate import SimResult, simulate, unit_costs
from lightning_pipe.strategy import PipelineStrategy
from lightning_pipe.topology import Topology

__all__ = [
    "AutoPlanner",
    "PipelineAbortedError",
    "PipelineEngine",
    "PipelineGroups",
    "PipelineMixin",
    "PipelineMonitor",
    "PipelinePlan",
    "PipelineStrategy",
    "Placement",
    "SimResult",
    "Topology",
    "place",
    "simulate",
    "unit_costs",
]
