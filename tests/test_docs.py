"""The documentation: the site builds strictly, the README stays a user's page, and the commands the docs show run.

Every command in a ```bash block of README.md or docs/ must be listed here, either in RUN
(short: run as written, must exit 0) or in NOT_RUN (long, or needing a network or a placeholder
file, with the reason), so a new command cannot slip into the docs untested.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"

QUICKSTART = [
    "python -m pip install torch==2.13.0 -e . && python examples/gpt.py fit --config configs/gpt_1f1b.yaml",
    'python -m pip install torch==2.13.0 -e ".[test]" && python -m pytest tests',
]

# Short commands: each is run as written (``python`` replaced by this interpreter) and must exit 0.
RUN = {
    "python -m lightning_pipe.plan --help",
}

# Commands the docs show that the tests deliberately do not run, and why.
_CKPT = "logs/gpt_1f1b/version_0/checkpoints/epoch=0-step=300.ckpt"
NOT_RUN = {
    QUICKSTART[0]: "installs packages, then trains 300 steps (about a minute)",
    QUICKSTART[1]: "installs packages, then runs the whole test suite",
    "python -m pip install -e .": "installs packages",
    'python -m pip install -e ".[hf]"': "installs packages",
    'python -m pip install -e ".[test]"': "installs packages",
    'python -m pip install torch==2.13.0 -e ".[hf]"': "installs packages",
    "python examples/gpt.py fit --config configs/gpt_auto.yaml": "trains 60 steps on 4 processes",
    "python examples/hf_llama.py fit --config configs/hf_llama.yaml": "trains 200 steps (test_example runs less)",
    "python train.py": "a placeholder for the user's own script",
    "torchrun --nproc_per_node=2 examples/gpt.py fit --config configs/gpt_1f1b.yaml": "trains 300 steps",
    "python -m lightning_pipe.plan --config configs/gpt_1f1b.yaml --script examples/gpt.py --devices 4 "
    "--memory 256MiB": "profiles (tens of s)",
    "python -m lightning_pipe.plan --config my_config.yaml --script path/to/your_model.py --devices 8": "placeholders",
    "python -m lightning_pipe.plan --config my_config.yaml --script path/to/your_model.py --devices 8 --memory 40GiB "
    "--allow-stale": "a placeholder for the user's own config and script",
    f'python -m lightning.pytorch.utilities.consolidate_checkpoint "{_CKPT}"': "needs the quickstart's checkpoint",
    f'python examples/gpt.py fit --config configs/gpt_1f1b.yaml --trainer.max_steps=600 --ckpt_path "{_CKPT}"': (
        "needs the quickstart's checkpoint, then trains 300 steps"
    ),
    "tensorboard --logdir logs": "a server that runs until stopped",
    "python examples/tensor_parallel.py": "trains 20 steps on 4 processes (test_tensor_parallel fits its model)",
}

_FENCE = re.compile(r"^```(\w*)\s*$")
_ISO_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
_UTC_TIME = re.compile(r"\b\d{1,2}:\d{2}\s*UTC\b")
_HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _pages() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def _blocks(text: str, language: str) -> list[list[str]]:
    """The lines of every fenced code block of ``language`` in ``text``."""
    blocks, current, inside = [], [], None
    for line in text.splitlines():
        fence = _FENCE.match(line.strip())
        if fence and inside is None:
            inside, current = fence.group(1), []
        elif line.strip() == "```" and inside is not None:
            if inside == language:
                blocks.append(current)
            inside = None
        elif inside is not None:
            current.append(line)
    return blocks


def _commands(text: str) -> list[str]:
    """Every command of the bash blocks: one per non-empty line, without a trailing ``# comment``."""
    lines = [line for block in _blocks(text, "bash") for line in block]
    commands = [re.split(r"\s+#\s", line.strip(), maxsplit=1)[0].strip() for line in lines]
    return [c for c in commands if c and not c.startswith("#")]


def _docs_commands() -> dict[str, Path]:
    return {command: page for page in _pages() for command in _commands(page.read_text())}


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "-f",
            str(ROOT / "mkdocs.yml"),
            "-d",
            str(tmp_path / "site"),
        ],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    import lightning_pipe

    for name in lightning_pipe.__all__:
        assert f'id="lightning_pipe.{name}"' in api, f"the API reference lacks lightning_pipe.{name}"


def test_readme_is_short_and_undated() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    for pattern, what in ((_ISO_DATE, "date"), (_UTC_TIME, "UTC time"), (_HASH, "commit hash")):
        found = pattern.findall(text)
        assert not found, f"README.md holds a {what}: {found[:5]}"


def test_readme_quickstart() -> None:
    text = README.read_text()
    section = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    blocks = _blocks(section, "bash")
    assert blocks, "the Quickstart section has no bash block"
    assert [line.strip() for line in blocks[0] if line.strip()] == QUICKSTART


def test_readme_links_resolve() -> None:
    for target in _LINK.findall(README.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0]
        assert (ROOT / path).exists(), f"README.md links to {target}, which does not exist"


def test_every_docs_command_is_listed() -> None:
    commands = _docs_commands()
    unlisted = {c: str(p.relative_to(ROOT)) for c, p in commands.items() if c not in RUN and c not in NOT_RUN}
    assert not unlisted, (
        f"commands in the docs neither run nor listed as not run (add them to RUN or NOT_RUN): {unlisted}"
    )
    stale = sorted((RUN | set(NOT_RUN)) - set(commands))
    assert not stale, f"listed commands no page shows any more: {stale}"
    assert not RUN & set(NOT_RUN)


@pytest.mark.parametrize("command", sorted(RUN))
def test_short_command_runs(command: str) -> None:
    assert command in _docs_commands()
    runnable = re.sub(r"^python(?=\s)", lambda _: shlex.quote(sys.executable), command)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(
        runnable, check=False, shell=True, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, f"{command!r} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
