"""Run a training script in fresh processes (torchrun or Lightning's own launcher) with a timeout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.distributed import free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "scripts"


def launch(args: list[str], timeout: float, torchrun: int = 0, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``python script args`` (or torchrun with ``torchrun`` processes) and fail on error or hang."""
    prefix = [sys.executable]
    if torchrun:
        prefix += ["-m", "torch.distributed.run", f"--nproc_per_node={torchrun}", f"--master_port={free_port()}"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    proc = subprocess.run(prefix + args, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}"
        )
    return proc
