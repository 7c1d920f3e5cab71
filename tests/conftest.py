"""Session fixtures: one shared launch per world size for every multi-process scenario (tests/shared.py),
run beside the tests from the start of the session."""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

from tests.launch import SCRIPTS, launch
from tests.shared import ENDED, launch_folder

LAUNCH_TIMEOUT = 900  # seconds for all scenarios of one world size; a hang fails every test that needs it


class Launch:
    """Results of one shared launch: ``launch[name]`` is each rank's ``(status, value)``."""

    def __init__(self, world: int, root: Path, proc: Any, seconds: float) -> None:
        self.world, self.folder, self.proc, self.seconds = world, launch_folder(root, world), proc, seconds

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


class SharedLaunches:
    """The shared launches of a session, each run once in a thread of its own beside the tests.

    All world sizes run at once (a scenario that resumes another launch's checkpoint waits for
    it: ``tests.shared.saved``). They start before the first test, so the one-process tests and
    the separate launches run while they do: a launch's waits, and a one-process test's single
    busy core, leave cores idle that the others fill."""

    WORLDS = (2, 4)

    def __init__(self, root: Path) -> None:
        self.root, self.done = root, {w: threading.Event() for w in self.WORLDS}
        self.results: dict[int, Launch] = {}
        self.running: list[subprocess.Popen] = []
        self._threads = [
            threading.Thread(target=self._run, args=(w,), name=f"shared-launch-{w}", daemon=True) for w in self.WORLDS
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def _run(self, world: int) -> None:
        self.results[world] = run_shared(world, self.root, self.running.append)
        self.done[world].set()

    def get(self, world: int) -> Launch:
        """The launch of ``world``, once it ended; a world the thread does not run, run now."""
        if world not in self.done:
            self.results[world] = run_shared(world, self.root)
        else:
            self.done[world].wait()
        return self.results[world]

    def stop(self) -> None:
        """End a launch still running when the session ends (its tests were not selected)."""
        for proc in self.running:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)


def run_shared(world: int, root: Path, started: Optional[Callable[[subprocess.Popen], None]] = None) -> Launch:
    """Every scenario of ``world`` in one torchrun; its outcome (a hang: killed after LAUNCH_TIMEOUT)."""
    start = time.monotonic()
    args = [str(SCRIPTS / "scenarios.py"), str(root)]
    try:
        proc = launch(args, timeout=LAUNCH_TIMEOUT, torchrun=world, check=False, started=started)
    except subprocess.TimeoutExpired as err:  # kept as the launch's outcome: each test then fails at once
        proc = subprocess.CompletedProcess(err.cmd, None, err.stdout or "", err.stderr or "")  # type: ignore[arg-type]
    ended = launch_folder(root, world) / ENDED
    ended.parent.mkdir(parents=True, exist_ok=True)
    ended.touch()  # a scenario of another launch waiting for one of this launch's stops waiting
    return Launch(world, root, proc, time.monotonic() - start)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Keep the objects of every imported module out of the garbage collector's full passes
    (``gc.freeze``): the tests' own objects are still collected, and a full pass no longer walks
    torch's and Lightning's."""
    gc.freeze()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the tests that read the shared launches last (in their own order): every other test runs
    while the launches do, instead of waiting behind the first test that reads one."""
    items.sort(key=lambda item: "launched" in getattr(item, "fixturenames", ()))


@pytest.fixture(scope="session", autouse=True)
def shared_launches(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Start the shared launches before the first test when a selected test uses them."""
    if not any("launched" in getattr(item, "fixturenames", ()) for item in request.session.items):
        yield None
        return
    launches = SharedLaunches(tmp_path_factory.mktemp("launches"))
    launches.start()
    yield launches
    launches.stop()


@pytest.fixture(scope="session")
def launched(shared_launches: SharedLaunches) -> Callable[[int], Launch]:
    """``launched(world)`` is every scenario of that world size, run once per session in one torchrun."""
    return shared_launches.get
