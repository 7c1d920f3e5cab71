"""The shared launches' wait for another launch's scenario (tests/shared.py ``saved``), without processes."""

from __future__ import annotations

import pickle
import threading
from pathlib import Path

import pytest

from tests import shared


def _finish(folder: Path, ranks: range, status: str = "ok") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for rank in ranks:
        (folder / f"rank{rank}.pkl").write_bytes(pickle.dumps((status, None)))


def test_saved_waits_for_every_rank_of_the_other_launch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SCENARIO_ROOT", str(tmp_path))
    folder = tmp_path / "world2" / "save"
    _finish(folder, range(1))  # rank 1 has not ended yet
    later = threading.Timer(0.5, _finish, (folder, range(1, 2)))
    later.start()
    assert shared.saved(2, "save", timeout=30) == folder
    later.join()


def test_saved_fails_when_the_scenario_failed_or_its_launch_ended_without_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SCENARIO_ROOT", str(tmp_path))
    _finish(tmp_path / "world2" / "failed", range(2), status="error")
    with pytest.raises(RuntimeError, match="failed on ranks"):
        shared.saved(2, "failed", timeout=30)
    _finish(tmp_path / "world2" / "cut", range(1))
    (tmp_path / "world2" / shared.ENDED).touch()
    with pytest.raises(RuntimeError, match="ended without scenario 'cut'"):
        shared.saved(2, "cut", timeout=30)


def test_readers_of_another_launch_run_last(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shared, "SCENARIOS", {})
    monkeypatch.setattr(shared, "READERS", {})
    shared.scenario(4, "resume", print, reads=(2, "save"))
    shared.scenario(4, "own_resume", print, reads=(4, "resume"))
    shared.scenario(4, "plain", print)
    assert shared.in_order(4) == ["own_resume", "plain", "resume"]
