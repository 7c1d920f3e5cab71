"""The code passes ruff's lint rules and is formatted as ``ruff format`` writes it (settings in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys

from tests.launch import ROOT


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_ruff_check_passes() -> None:
    run = _ruff("check", ".")
    assert run.returncode == 0, run.stdout + run.stderr


def test_ruff_format_leaves_every_file_as_it_is() -> None:
    run = _ruff("format", "--check", ".")
    assert run.returncode == 0, run.stdout + run.stderr
