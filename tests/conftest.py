"""Session fixtures: one shared launch per world size for every multi-process scenario (tests/shared.py)."""

from __future__ import annotations

import pickle
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from tests.launch import SCRIPTS, launch

LAUNCH_TIMEOUT = 900  # seconds for all scenarios of one world size; a hang fails every test that needs it


class Launch:
    """Results of one shared launch: ``launch[name]`` is each rank's ``(status, value)``."""

    def __init__(self, world: int, root: Path, proc: Any, seconds: float) -> None:
        self.world, self.folder, self.proc, self.seconds = world, root / f"world{world}", proc, seconds

    def __getitem__(self, name: str) -> list[tuple[str, Any]]:
        files = [self.folder / name / f"rank{r}.pkl" for r in range(self.world)]
        if not all(f.exists() for f in files):
            tail = (self.proc.stdout or "")[-3000:] + "\n" + (self.proc.stderr or "")[-6000:]
            ended = (
                f"exit {self.proc.returncode}"
                if self.proc.returncode is not None
                else f"killed after {LAUNCH_TIMEOUT} s: a hang"
            )
            raise AssertionError(f"scenario {name!r} has no result from every rank (launch {ended}):\n{tail}")
        return [pickle.loads(f.read_bytes()) for f in files]

    def ok(self, name: str) -> list[Any]:
        """Each rank's value, after checking no rank failed."""
        out = self[name]
        assert all(status == "ok" for status, _ in out), [v for s, v in out if s != "ok"]
        return [value for _, value in out]

    def dir(self, name: str) -> Path:
        """The scenario's folder (what its ranks wrote)."""
        return self.folder / name


@pytest.fixture(scope="session")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], Launch]:
    """``launched(world)`` runs every scenario of that world size once per session, in one torchrun."""
    root = tmp_path_factory.mktemp("launches")
    cache: dict[int, Launch] = {}

    def get(world: int) -> Launch:
        if world == 4:
            get(2)  # world 4 resumes checkpoints that world 2 saved
        if world not in cache:
            start = time.monotonic()
            args = [str(SCRIPTS / "scenarios.py"), str(root)]
            try:
                proc = launch(args, timeout=LAUNCH_TIMEOUT, torchrun=world, check=False)
            except (
                subprocess.TimeoutExpired
            ) as err:  # kept as the launch's outcome: each test then fails at once, none launches again
                proc = subprocess.CompletedProcess(err.cmd, None, err.stdout or "", err.stderr or "")  # type: ignore[arg-type]
            cache[world] = Launch(world, root, proc, time.monotonic() - start)
        return cache[world]

    return get
