"""Errors a new user meets say what went wrong and what to do, naming the file, stage, rank or shape involved."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from lightning_pipe.core.sizes import parse_size

GIB = 2**30


# -- sizes: one parser for every memory argument ---------------------------------------------------
@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (512, 512),
        (1.5e9, 1_500_000_000),
        ("512", 512),
        ("64MiB", 64 * 2**20),
        ("3 mib", 3 * 2**20),
        ("2GB", 2 * 10**9),
        ("1.5GiB", 3 * GIB // 2),
        ("1KB", 1000),
        ("1KiB", 1024),
        ("1TB", 10**12),
        ("2TiB", 2 * 2**40),
        ("1e6B", 10**6),
    ],
)
def test_sizes_are_bytes_or_a_number_with_an_si_or_binary_unit(value: Any, expected: int) -> None:
    assert parse_size(value, "memory") == expected


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("3 MiBs", "memory must be bytes as a number, or a number and a unit"),
        ("lots", "got 'lots'"),
        ("-2GiB", "memory must be a positive size"),
        (-5, "memory must be a positive size"),
        (0, "memory must be a positive size"),
        (float("nan"), "memory must be a positive size"),
        (True, "of type bool"),
        ([1], "of type list"),
    ],
)
def test_a_size_that_is_not_one_names_the_argument_and_the_formats(value: Any, says: str) -> None:
    with pytest.raises(ValueError, match="KB/KiB, MB/MiB") as err:
        parse_size(value, "memory")
    assert says in str(err.value)


def test_autoplanner_takes_a_memory_size_from_python_and_from_yaml() -> None:
    from jsonargparse import ArgumentParser

    from lightning_pipe import AutoPlanner

    assert AutoPlanner(memory="3MiB").memory == 3 * 2**20
    assert AutoPlanner(memory=1.5e9).memory == 1_500_000_000
    with pytest.raises(
        ValueError, match=r"AutoPlanner\(memory=...\) must be bytes as a number, or a number and a unit"
    ):
        AutoPlanner(memory="3 megs")
    # LightningCLI reads callbacks through jsonargparse: a YAML string must pass its type check.
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(AutoPlanner, "auto")
    config = parser.parse_string(yaml.safe_dump({"auto": {"memory": "3MiB"}}))
    assert parser.instantiate(config).auto.memory == 3 * 2**20


# -- the plan CLI ------------------------------------------------------------------------------------
def _gpt_config(tmp_path: Path, model: dict[str, Any], data: dict[str, Any]) -> Path:
    config = tmp_path / "my_run.yaml"
    config.write_text(yaml.safe_dump({"trainer": {"devices": 2}, "model": model, "data": data}))
    return config


TINY_GPT = {"n_layer": 2, "n_embd": 16, "n_head": 2, "block_size": 8}
TINY_TEXT = {"block_size": 8, "batch_size": 4, "max_bytes": 4000}


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--devices", "0", "argument --devices: must be an integer >= 1, got '0'"),
        ("--devices", "-2", "argument --devices: must be an integer >= 1, got '-2'"),
        ("--devices", "two", "argument --devices: must be an integer >= 1, got 'two'"),
        ("--memory", "-1GiB", "argument --memory: --memory must be a positive size"),
        ("--memory", "64 megs", "argument --memory: --memory must be bytes as a number, or a number and a unit"),
        ("--global-batch", "0", "argument --global-batch: must be an integer >= 1"),
        ("--ranks-per-node", "0", "argument --ranks-per-node: must be an integer >= 1"),
        ("--virtual-stages", "0", "argument --virtual-stages: must be an integer >= 1"),
        ("--top", "-1", "argument --top: must be an integer >= 1"),
    ],
)
def test_plan_cli_refuses_a_bad_number_before_profiling(tmp_path, capsys, flag: str, value: str, says: str) -> None:
    from lightning_pipe.planning.cli import main

    config = _gpt_config(tmp_path, TINY_GPT, TINY_TEXT)
    args = ["--config", str(config), "--devices", "2", "--memory", "64MiB"]
    args += [f"{flag}={value}"]  # '=': a value starting with '-' is the flag's, not another flag
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2
    assert says in capsys.readouterr().err


def test_plan_cli_without_script_names_what_the_config_lacks(tmp_path) -> None:
    from lightning_pipe.planning.cli import main

    config = _gpt_config(tmp_path, TINY_GPT, TINY_TEXT)
    with pytest.raises(SystemExit, match="the config names no model class_path, pass --script path/to/your_model.py"):
        main(["--config", str(config), "--devices", "2"])
    config = _gpt_config(tmp_path, {"class_path": "examples.gpt.GPT"}, TINY_TEXT)
    with pytest.raises(SystemExit, match="the config names no data class_path, pass --script path/to/your_model.py"):
        main(["--config", str(config), "--devices", "2"])
    data = {"class_path": "examples.gpt.StdlibText"}
    config = _gpt_config(tmp_path, {"class_path": "examples.gpt.NoSuchModel"}, data)
    with pytest.raises(SystemExit, match=r"model.class_path 'examples.gpt.NoSuchModel' cannot be imported"):
        main(["--config", str(config), "--devices", "2"])


def test_plan_cli_imports_the_model_and_data_class_paths_of_the_config(tmp_path, capsys) -> None:
    from lightning_pipe.planning.cli import main

    model = {"class_path": "examples.gpt.GPT", "init_args": TINY_GPT}
    data = {"class_path": "examples.gpt.StdlibText", "init_args": TINY_TEXT}
    config, out = _gpt_config(tmp_path, model, data), tmp_path / "plan.yaml"
    args = ["--config", str(config), "--devices", "2", "--memory", "1GiB", "--no-links", "--virtual-stages", "1"]
    assert main(args + ["--output", str(out), "--top", "2"]) == 0
    assert "profiling GPT at microbatch sizes" in capsys.readouterr().out
    assert yaml.safe_load(out.read_text())["trainer"]["devices"] == 2
