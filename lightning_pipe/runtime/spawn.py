"""Run a function on N local gloo processes with a hard timeout (tests and benchmarks)."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import socket
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_method(fn: Callable) -> str:
    """Fork workers from one server process that has imported this package and ``fn``'s module
    (each spawned worker would import torch and Lightning again: seconds per process); spawn
    where there is no fork server. The server starts on first use and serves every later call."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.get_context("forkserver").set_forkserver_preload([__name__, fn.__module__])
    return "forkserver"


def _worker(rank: int, world: int, port: int, out: str, timeout: float, fn: Callable, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout))
    try:
        result: Any = ("ok", fn(rank, world, *args))
    except BaseException as err:  # noqa: BLE001 - reported to the caller
        result = ("error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}")
    Path(out, f"{rank}.pkl").write_bytes(pickle.dumps(result))
    if result[0] == "ok":
        dist.barrier()
        dist.destroy_process_group()


def run_gloo(
    fn: Callable, world: int, *args: Any, timeout: float = 60.0, pg_timeout: float = 30.0
) -> list[tuple[str, Any]]:
    """Run ``fn(rank, world, *args)`` in ``world`` gloo processes; return each rank's (status, value).

    ``fn`` must be importable (a module-level function). Status is "ok", "error" (value: the
    traceback) or "died".

    Raises:
        TimeoutError: if the processes have not all exited after ``timeout`` seconds.
    """
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.start_processes(
            _worker,
            args=(world, free_port(), out, pg_timeout, fn, args),
            nprocs=world,
            join=False,
            start_method=_start_method(fn),
        )
        deadline = time.monotonic() + timeout
        for proc in ctx.processes:
            proc.join(max(0.0, deadline - time.monotonic()))
        alive = [p.pid for p in ctx.processes if p.is_alive()]
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
        if alive:
            raise TimeoutError(f"worker processes {alive} still running after {timeout}s: a hang")
        files = [Path(out, f"{r}.pkl") for r in range(world)]
        return [pickle.loads(f.read_bytes()) if f.exists() else ("died", None) for f in files]
