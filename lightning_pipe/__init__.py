"""lightning_pipe: pipeline-parallel training (GPipe, 1F1B, PipeDream-2BW, split backward) as a Lightning strategy."""

from lightning_pipe import _deprecated
from lightning_pipe.core.pipeline_plan import PipelinePlan
from lightning_pipe.core.topology import Topology
from lightning_pipe.lightning.autoplan import AutoPlanner
from lightning_pipe.lightning.module import PipelineMixin
from lightning_pipe.lightning.monitor import PipelineMonitor
from lightning_pipe.lightning.strategy import PipelineStrategy
from lightning_pipe.runtime.comm.groups import PipelineGroups
from lightning_pipe.runtime.comm.p2p import PipelineAbortedError
from lightning_pipe.runtime.engine import PipelineEngine
from lightning_pipe.runtime.placement import Placement, place
from lightning_pipe.runtime.ties import TiedCopiesDivergedError
from lightning_pipe.schedules.simulate import SimResult, simulate, unit_costs

_deprecated.install()

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
    "TiedCopiesDivergedError",
    "Topology",
    "place",
    "simulate",
    "unit_costs",
]
