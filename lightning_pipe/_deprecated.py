"""Module paths of the flat layout, importable for one more release with a ``DeprecationWarning``."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from typing import Any, Optional, Sequence

#: Old module path -> the modules that now hold its names (searched in order).
MOVED: dict[str, tuple[str, ...]] = {
    "lightning_pipe.layout": ("lightning_pipe.core.pipeline_plan",),
    "lightning_pipe.topology": ("lightning_pipe.core.topology",),
    "lightning_pipe.partition": ("lightning_pipe.core.partition",),
    "lightning_pipe.simulate": ("lightning_pipe.schedules.simulate",),
    "lightning_pipe.timeline": ("lightning_pipe.schedules.timeline",),
    "lightning_pipe.schedules.split": ("lightning_pipe.schedules.w_placement",),
    "lightning_pipe.runtime.p2p": ("lightning_pipe.runtime.comm.p2p",),
    "lightning_pipe.runtime.groups": ("lightning_pipe.runtime.comm.groups",),
    "lightning_pipe.runtime.split": ("lightning_pipe.runtime.autograd.backward_split",),
    "lightning_pipe.runtime.deferred_weights": ("lightning_pipe.runtime.autograd.deferred_weights",),
    "lightning_pipe.runtime.deferred_norm": ("lightning_pipe.runtime.autograd.deferred_norm",),
    "lightning_pipe.spawn": ("lightning_pipe.runtime.spawn",),
    "lightning_pipe.profiler": (
        "lightning_pipe.planning.profile",
        "lightning_pipe.planning.profiler",
        "lightning_pipe.planning.links",
    ),
    "lightning_pipe.stage_memory": ("lightning_pipe.planning.memory", "lightning_pipe.planning.held"),
    "lightning_pipe.madpipe": ("lightning_pipe.planning.madpipe",),
    "lightning_pipe.planner": (
        "lightning_pipe.planning.costs",
        "lightning_pipe.planning.programs",
        "lightning_pipe.planning.memory",
        "lightning_pipe.planning.held",
        "lightning_pipe.planning.predict",
        "lightning_pipe.planning.search",
    ),
    "lightning_pipe.strategy": ("lightning_pipe.lightning.strategy",),
    "lightning_pipe.module": ("lightning_pipe.lightning.module",),
    "lightning_pipe.data": ("lightning_pipe.lightning.data",),
    "lightning_pipe.checkpoint": ("lightning_pipe.lightning.checkpoint",),
    "lightning_pipe.autoplan": ("lightning_pipe.lightning.autoplan",),
    "lightning_pipe.monitor": ("lightning_pipe.lightning.monitor",),
    "lightning_pipe.planning.cli": ("lightning_pipe.lightning.plan_cli",),
}


class _MovedModule(types.ModuleType):
    """Stands at an old path and hands out the names of the modules that now hold them."""

    def __init__(self, name: str, targets: Sequence[str]) -> None:
        super().__init__(name, f"Deprecated: moved to {', '.join(targets)}.")
        self._targets = tuple(importlib.import_module(t) for t in targets)

    def __getattr__(self, attr: str) -> Any:
        for module in self._targets:
            if hasattr(module, attr):
                return getattr(module, attr)
        raise AttributeError(
            f"module {self.__name__!r} (moved to {[m.__name__ for m in self._targets]}) has no {attr!r}"
        )


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old paths of :data:`MOVED` and warns on import."""

    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        targets = MOVED[spec.name]
        warnings.warn(
            f"{spec.name} is deprecated and will be removed in the next release; import from {' or '.join(targets)}",
            DeprecationWarning,
            stacklevel=3,
        )
        return _MovedModule(spec.name, targets)

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the module reads its targets' names on access."""


def install() -> None:
    """Append the finder of old paths to ``sys.meta_path`` (once); real modules are always found first."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
