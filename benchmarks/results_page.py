"""The results page every benchmark script writes under docs/results/: its command, the machine, its tables."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: Where the pages go: one ``<name>.md`` per script, charts beside it.
RESULTS = ROOT / "docs" / "results"


def _cell(value: object) -> str:
    """A table cell's text, its pipes escaped."""
    return str(value).replace("|", "\\|")


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A Markdown table.

    Args:
        header: The column titles.
        rows: One sequence of cells per row, as many as ``header``; each cell is written with
            ``str`` (format numbers before passing them), ``|`` escaped.

    Returns:
        The table's lines joined by newlines, without a trailing newline.
    """
    lines = ["| " + " | ".join(_cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def cpu_model() -> str:
    """The CPU's model name (from ``/proc/cpuinfo`` on Linux, else :func:`platform.processor`)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def machine() -> dict[str, str]:
    """What the numbers were measured on: CPU model, cores, OS, Python and torch versions."""
    import torch

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = f"{usable} usable of {os.cpu_count()}" if usable != os.cpu_count() else str(usable)
    return {
        "CPU": cpu_model(),
        "cores": cores,
        "OS": platform.platform(),
        "Python": platform.python_version(),
        "torch": torch.__version__,
    }


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command that ran this script, as typed from the repository root: ``python benchmarks/<script> <args>``.

    Args:
        argv: The script path and its arguments; ``sys.argv`` by default (under ``torchrun``
            too, where ``sys.argv[0]`` is the script).
    """
    script, *args = sys.argv if argv is None else argv
    path = Path(script).resolve()
    shown = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else script
    return shlex.join(["python", shown, *args])


def add_page_flag(parser: argparse.ArgumentParser) -> None:
    """Adds ``--no-page``: print the tables only, leave ``docs/results/`` alone (quick checks)."""
    parser.add_argument(
        "--no-page",
        action="store_true",
        help="print the tables only; do not write this script's page under docs/results/",
    )


def write_page(
    name: str, title: str, command: str, sections: Sequence[tuple[str, str]], intro: str = "", directory: Path = RESULTS
) -> Path:
    """Writes (replaces) ``<directory>/<name>.md``: title, date and command once, the machine, then the sections.

    Args:
        name: The page's file name without ``.md``, by convention the script's (``bench_pipelines``).
        title: The page's title.
        command: The command that produced the numbers (see :func:`command_line`).
        sections: ``(heading, body)`` pairs, each a ``##`` section; a body is Markdown (tables
            from :func:`markdown_table`, an image saved in ``directory`` as ``![alt](file.png)``).
        intro: Markdown after the machine: what is measured and how, in a few sentences.
        directory: Where the page goes; ``docs/results/`` by default.

    Returns:
        The page's path.
    """
    today = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    script = command.split()[1] if len(command.split()) > 1 else command
    parts = [
        f"# {title}",
        f"Written by `{script}` on {today} (UTC), replacing the page of its previous run. Command:",
        f"```text\n{command}\n```",
        "Machine: " + "; ".join(f"{k} {v}" for k, v in machine().items()) + ".",
    ]
    if intro:
        parts.append(intro.strip())
    parts += [f"## {heading}\n\n{body.strip()}" for heading, body in sections]
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.md"
    path.write_text("\n\n".join(parts) + "\n")
    return path
