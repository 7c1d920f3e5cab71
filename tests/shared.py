"""Shared launches: the multi-process scenarios of one world size all run in one torchrun per test session.

A test module registers its scenarios with :func:`scenario` at import time; the
``tests/scripts/scenarios.py`` runner imports :data:`MODULES`, runs every scenario of its world
size in order on the already connected processes, and stores each rank's result; the
``launched`` fixture (tests/conftest.py) starts one launch per world size on first use. A test
adds a scenario, not a launch. The launches run at the same time: a scenario that reads what a
scenario of another world size wrote registers with ``reads`` (it then runs after its launch's
other scenarios) and waits for it with :func:`saved`.
"""

from __future__ import annotations

import os
import pickle
import time
from pathlib import Path
from typing import Any, Callable, Optional

#: Modules whose import registers scenarios (the runner imports them all).
MODULES = (
    "tests.test_executor_parity",
    "tests.test_two_bw",
    "tests.test_split_runtime",
    "tests.test_trainer",
    "tests.test_checkpoint",
    "tests.test_reconfigure",
    "tests.test_buckets",
    "tests.test_buffers",
    "tests.test_ties",
    "tests.test_planner",
    "tests.test_example",
    "tests.test_monitor",
    "tests.test_user_errors",
    "tests.test_memory_exact",
    "tests.test_fsdp",
    "tests.test_errors",
    "tests.test_tensor_parallel",
)

SCENARIOS: dict[int, dict[str, tuple[Callable[..., Any], tuple]]] = {}

#: The scenarios that read another world size's scenario, by world size: they run last in their launch.
READERS: dict[int, set[str]] = {}

#: How long :func:`saved` waits for another launch's scenario (a launch that hangs is killed sooner).
SAVED_TIMEOUT = 600.0

#: The file a launch's folder gets once the launch has ended (tests/conftest.py's ``run_shared``).
ENDED = ".launch-ended"


def scenario(
    world: int, name: str, fn: Callable[..., Any], *args: Any, reads: Optional[tuple[int, str]] = None
) -> None:
    """Register ``fn(rank, world, *args)`` to run on ``world`` processes under ``name``; ``reads``:
    the (world size, name) of another launch's scenario whose files it reads (:func:`saved`)."""
    table = SCENARIOS.setdefault(world, {})
    if name in table:
        raise ValueError(f"scenario {name!r} is registered twice for world size {world}")
    table[name] = (fn, args)
    if reads is not None and reads[0] != world:
        READERS.setdefault(world, set()).add(name)


def in_order(world: int) -> list[str]:
    """The scenarios of ``world`` in the order they run: registration order, readers of another
    launch last (by then that launch has most likely written what they read)."""
    names = list(SCENARIOS.get(world, {}))
    return sorted(names, key=lambda name: name in READERS.get(world, set()))


def launch_folder(root: Path, world: int) -> Path:
    """Where the launch of ``world`` under ``root`` keeps its scenarios' folders."""
    return root / f"world{world}"


def saved(world: int, name: str, timeout: float = SAVED_TIMEOUT) -> Path:
    """The folder of scenario ``name`` of the ``world`` launch, once every rank of it has ended.

    Raises:
        RuntimeError: that scenario failed on some rank, its launch ended without it, or it did
            not end within ``timeout`` seconds.
    """
    folder = launch_folder(launch_root(), world) / name
    results = [folder / f"rank{rank}.pkl" for rank in range(world)]
    ended, deadline = folder.parent / ENDED, time.monotonic() + timeout
    while not all(path.exists() for path in results):
        if ended.exists() and not all(path.exists() for path in results):
            raise RuntimeError(f"the launch of world {world} ended without scenario {name!r}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"scenario {name!r} of world {world} did not end within {timeout:.0f} s")
        time.sleep(0.2)
    failed = [r for r, path in enumerate(results) if pickle.loads(path.read_bytes())[0] != "ok"]
    if failed:
        raise RuntimeError(f"scenario {name!r} of world {world}, which this one reads, failed on ranks {failed}")
    return folder


def scenario_per_layout(prefix: str, fn: Callable[..., Any], layouts: list[tuple[int, int]]) -> None:
    """Register ``fn(rank, world, depth)`` as ``<prefix>_<w>x<d>`` for each ``(w, d)`` layout."""
    for width, depth in layouts:
        scenario(width * depth, f"{prefix}_{width}x{depth}", fn, depth)


def scenario_dir() -> Path:
    """The running scenario's own folder (the same path on every rank)."""
    return Path(os.environ["SCENARIO_DIR"])


def live_groups() -> set[Any]:
    """The process groups this rank holds besides the default one."""
    from torch.distributed import distributed_c10d

    return set(distributed_c10d._world.pg_map) - {distributed_c10d.GroupMember.WORLD}


def launch_root() -> Path:
    """The folder holding every launch of the session (``world2/``, ``world4/``, ...)."""
    return Path(os.environ["SCENARIO_ROOT"])


def profile_on_rank_0(*args: Any, **kwargs: Any) -> Any:
    """``profile_blocks(*args, **kwargs)`` run on rank 0 alone, its profile sent to every rank.

    For the memory checks of a scenario: a profile's bytes are the same on every rank, and the
    other ranks would time the same blocks again only to compete for the host's cores. Rank 0
    profiles under ``fork_rng``, so every rank leaves with the random state it came with."""
    import torch
    import torch.distributed as dist

    from lightning_pipe.planning.profiler import profile_blocks

    sent: list[Any] = [None]
    if dist.get_rank() == 0:
        with torch.random.fork_rng():
            sent[0] = profile_blocks(*args, **kwargs)
    dist.broadcast_object_list(sent, src=0)
    return sent[0]
