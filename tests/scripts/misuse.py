"""Start a pipeline run that is set up wrongly (or fails mid-step, or hangs) and let it raise.

``python misuse.py CASE [DEVICES]`` fits tests/scripts/misuse_cases.py's ``CASE``;
tests/test_errors.py checks the error and that no rank hangs, tests/test_exit_codes.py how each
rank exits. With ``MISUSE_REPORT_EXIT=1`` every rank that Lightning's launcher starts runs under a
parent that prints ``rank R exit code C`` once it ends: the launcher itself ends with rank 0's code
and reports no other. That parent imports neither torch nor Lightning, so it adds no start-up time.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_reporting_exit(rank: str) -> int:
    """Run this rank's script in a child process and print how it ended; return its exit code
    (a signal as a shell reports it: 128 + its number)."""
    env = dict(os.environ, MISUSE_REPORT_EXIT="0", MISUSE_LAUNCHER_PID=str(os.getppid()))
    code = subprocess.call([sys.executable, *sys.argv], env=env)
    code = 128 - code if code < 0 else code
    print(f"rank {rank} exit code {code}", flush=True)
    return code


def main() -> None:
    rank = os.environ.get("LOCAL_RANK", "0")
    if os.environ.get("MISUSE_REPORT_EXIT") == "1" and rank != "0":
        sys.exit(run_reporting_exit(rank))
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.scripts.misuse_cases import fit_case

    fit_case(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1)


if __name__ == "__main__":
    main()
