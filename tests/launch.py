"""Run a training script in fresh processes (torchrun or Lightning's own launcher) with a timeout."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable, Optional

from tests.distributed import free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "scripts"


def launch(
    args: list[str],
    timeout: float,
    torchrun: int = 0,
    check: bool = True,
    started: Optional[Callable[[subprocess.Popen], None]] = None,
) -> subprocess.CompletedProcess:
    """Run ``python script args`` (or torchrun with ``torchrun`` processes) and fail on error or hang;
    ``started`` is handed the running process (to stop it from another thread)."""
    prefix = [sys.executable]
    if torchrun:
        prefix += ["-m", "torch.distributed.run", f"--nproc_per_node={torchrun}", f"--master_port={free_port()}"]
    prefix += ["-m", "tests.start"]  # each process imports torch and Lightning with the collector off
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    with subprocess.Popen(
        prefix + args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
        start_new_session=True,
    ) as running:
        if started is not None:
            started(running)
        try:
            out, err = running.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            out, err = _stop(running)
            raise subprocess.TimeoutExpired(running.args, timeout, out, err) from None
    proc = subprocess.CompletedProcess(running.args, running.returncode, out, err)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}"
        )
    return proc


def _stop(running: subprocess.Popen) -> tuple[str, str]:
    """End a launch that ran past its timeout, and every process it started; return its output so far.

    SIGTERM goes to the launch's process group: torchrun (which then stops its workers, each in a
    session of its own, within 30 s) and Lightning's launcher with the ranks it started. Whatever
    of the group is left a minute later is killed."""
    out: tuple[str, str] = ("", "")
    for sig, grace in ((signal.SIGTERM, 60), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError):  # the whole group is gone already
            os.killpg(running.pid, sig)
        try:
            return running.communicate(timeout=grace)
        except subprocess.TimeoutExpired as partial:  # a process outside the group still holds the pipes
            out = tuple(
                o.decode(errors="replace") if isinstance(o, bytes) else (o or "")
                for o in (partial.stdout, partial.stderr)
            )  # type: ignore[assignment]
    return out
