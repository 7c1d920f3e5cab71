"""How each rank of a 2-process fit through Lightning's launcher ends: 1 with the error on every
failure path (a stage's error at setup or mid-step, a neighbour stuck past the timeout); 0 after clean fits (the
suite's shared launches); never SIGABRT (134, "terminate called without an active exception"),
never a hang.

A scheduler reads 134 as a crash (and may write a core file). A process aborts so when a thread
is still inside a gloo wait as the interpreter finalizes: the wait returns once the peer exits,
and the thread is ended inside C++. Lightning's launcher ends with rank 0's exit code only, so
tests/scripts/misuse.py runs the other rank under a parent that prints its code.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed import free_port
from tests.launch import ROOT, SCRIPTS

HANG_GUARD = 240  # seconds: a launch still running then is a hang, and fails


def _start(case: str, folder: Path) -> subprocess.Popen:
    """Start fitting misuse.py's ``case`` on 2 processes through Lightning's launcher."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", MISUSE_REPORT_EXIT="1", MISUSE_READY=str(folder))
    env["MASTER_PORT"] = str(free_port())  # launches running at the same time must not pick the same port
    cmd = [sys.executable, str(SCRIPTS / "misuse.py"), case, "2"]
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT, start_new_session=True
    )


def _finish(case: str, proc: subprocess.Popen) -> tuple[dict[int, int], str]:
    """Each rank's exit code (signals as 128 + number) and the output of ``case``'s launch, once every rank ended."""
    try:
        output, _ = proc.communicate(timeout=HANG_GUARD)  # until every rank closed the pipe
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # every rank: they share the launcher's new session
        output, _ = proc.communicate()
        pytest.fail(f"case {case!r} still ran after {HANG_GUARD} s (a rank hangs):\n{output[-6000:]}")
    codes = {0: 128 - proc.returncode if proc.returncode < 0 else proc.returncode}
    codes.update({int(r): int(c) for r, c in re.findall(r"rank (\d+) exit code (\d+)\n", output)})
    return codes, output


@pytest.fixture(scope="module")
def failed_fits(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict[int, int], str]]:
    """The three launches whose stage raises, run at the same time: each waits mostly for the others'
    process start-up, and their waits are bounded by the 30 s timeout, far above a loaded host's delays."""
    running = {case: _start(case, tmp_path_factory.mktemp(case)) for case in ("none_first", "dict_last", "mid_step")}
    return {case: _finish(case, proc) for case, proc in running.items()}


def _check(result: tuple[dict[int, int], str], code: int, messages: list[str]) -> None:
    codes, output = result
    tail = output[-6000:]
    assert codes == {0: code, 1: code}, f"exit codes {codes}, expected {code} on every rank:\n{tail}"
    assert "terminate called" not in output, tail
    for message in messages:
        assert message in output, f"{message!r} not in the output:\n{tail}"


def test_an_error_on_stage_0_ends_every_rank_with_1(failed_fits) -> None:
    # The failing rank's notice reaches rank 1, which raises it; the user's report: 134 every time.
    message = "pipeline block 2 (Returns) returned NoneType"
    _check(
        failed_fits["none_first"],
        1,
        [f"TypeError: {message}", f"PipelineAbortedError: stage 0 (rank 0) failed: TypeError: {message}"],
    )


def test_an_error_on_the_last_stage_ends_every_rank_with_1(failed_fits) -> None:
    message = "pipeline block 5 (Returns) returned dict"
    _check(
        failed_fits["dict_last"],
        1,
        [f"TypeError: {message}", f"PipelineAbortedError: stage 1 (rank 1) failed: TypeError: {message}"],
    )


def test_a_rank_failing_mid_step_ends_every_rank_with_its_error(failed_fits) -> None:
    # One stage each (3 + 3 blocks): the Boom block, the chain's fourth, is on rank 1. Rank 0
    # must end with rank 1's error carried by the abort notice, not by its process-group timeout
    # (30 s) or by being left waiting.
    codes, output = failed_fits["mid_step"]
    tail = output[-6000:]
    assert codes == {0: 1, 1: 1}, f"exit codes {codes}, expected 1 on every rank:\n{tail}"
    # Each rank's uncaught error, as torch prints it: "[rankN]: <type>: <message>".
    ended = {
        int(r): line for r, line in re.findall(r"^\[rank(\d)\]: ([\w.]+(?:Error|Exception): .*)$", output, re.MULTILINE)
    }
    assert ended.get(1) == "RuntimeError: boom in block", tail
    assert ended.get(0, "").endswith("PipelineAbortedError: stage 1 (rank 1) failed: RuntimeError: boom in block"), tail


def test_a_stuck_neighbour_ends_every_rank_with_1_and_says_who_waited_for_what(tmp_path: Path) -> None:
    # Rank 1 is stuck in a block of its first forward until rank 0 ends; rank 0 waits for that
    # microbatch's gradients, times out, says so, and ends; rank 1 then finds its link closed.
    waited = re.compile(
        r"TimeoutError: stage 0 \(rank 0\) waited \d+ s for the gradients of microbatch 0 from rank 1 \(stage 1\)"
    )
    codes, output = _finish("hang", _start("hang", tmp_path))
    tail = output[-6000:]
    assert codes == {0: 1, 1: 1}, f"exit codes {codes}, expected 1 on every rank:\n{tail}"
    assert "terminate called" not in output, tail
    assert waited.search(output), tail


@pytest.mark.parametrize("world", [2, 4])
def test_the_shared_launches_end_every_rank_with_0(launched, world: int) -> None:
    # Every clean fit of the suite's shared launches (and their scenarios that abort on purpose)
    # ran in these processes; torchrun returns 0 only if every rank exited with 0.
    run = launched(world)
    tail = (run.proc.stderr or "")[-6000:]
    assert run.proc.returncode == 0, f"exit {run.proc.returncode}:\n{tail}"
    assert "terminate called" not in (run.proc.stderr or ""), tail
