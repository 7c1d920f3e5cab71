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


# -- layouts and losses --------------------------------------------------------------------------------
def test_interleaved_layout_errors_name_depth_and_virtual_stages_as_given() -> None:
    from lightning_pipe import PipelinePlan, PipelineStrategy, place
    from tests.models import ToyChain

    as_given = r"6 stages \(pipeline_depth=2 x virtual_stages=3\)"
    with pytest.raises(ValueError, match=f"cannot split 4 pipeline blocks over {as_given}") as err:
        place(ToyChain(depth=2), PipelinePlan(depth=2, microbatches=2, virtual_stages=3), rank=0)
    assert "pipeline_depth=6" not in str(err.value)
    with pytest.raises(ValueError, match=r"must list 6 positive block counts, one per stage \(pipeline_depth=2 x"):
        PipelinePlan(depth=2, microbatches=2, virtual_stages=3, partition=[2, 2])
    with pytest.raises(ValueError, match=r"one flag per stage \(6: pipeline_depth=2 x virtual_stages=3\), got 2"):
        PipelinePlan(depth=2, microbatches=2, virtual_stages=3, recompute=[True, False])
    with pytest.raises(ValueError, match="partition lists 4 stages, not a multiple of virtual_stages=3"):
        PipelineStrategy(pipeline_depth=2, microbatches=2, virtual_stages=3, partition=[1, 1, 1, 1])


class _PerSampleLoss:
    """``pipeline_loss`` without the mean: one loss per sample."""

    @staticmethod
    def pipeline_loss(output: Any, batch: Any) -> Any:
        import torch.nn.functional as F

        return F.cross_entropy(output.float(), batch[1], reduction="none")


def test_a_loss_that_is_not_a_scalar_names_its_shape() -> None:
    from lightning_pipe import PipelinePlan, place
    from tests.models import ToyChain, frozen, make_data

    model = ToyChain()
    model.pipeline_loss = _PerSampleLoss.pipeline_loss  # type: ignore[method-assign]
    engine = place(model, PipelinePlan(microbatches=2), rank=0)
    with pytest.raises(TypeError, match=r"mean-reduced scalar Tensor .*got a Tensor of shape \(3,\)"):
        engine.train_step(make_data(6), frozen(engine))
    model.pipeline_loss = lambda output, batch: 0.5  # type: ignore[method-assign]
    with pytest.raises(TypeError, match="mean-reduced scalar Tensor .*got float"):
        engine.train_step(make_data(6), frozen(engine))


# -- Trainer options the pipeline does its own way ----------------------------------------------------
@pytest.mark.parametrize(
    ("option", "says"),
    [
        (
            {"accumulate_grad_batches": 4},
            r"Trainer\(accumulate_grad_batches=4\) does not apply to PipelineStrategy: the pipeline already "
            r"accumulates .* PipelineStrategy\(microbatches=...\)",
        ),
        (
            {"gradient_clip_val": 1.0},
            r"Trainer\(gradient_clip_val=1.0\) does not apply .* pass PipelineStrategy\(gradient_clip_val=1.0\) "
            r"instead, which clips to the global norm over all stages",
        ),
    ],
)
def test_trainer_accumulation_and_clipping_are_refused_with_the_pipeline_way(option: dict, says: str) -> None:
    import lightning as L
    import torch

    from lightning_pipe import PipelineStrategy
    from tests.models import ToyChain, make_data

    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        strategy=PipelineStrategy(),
        **option,
    )
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*make_data(8)), batch_size=4)
    with pytest.raises(ValueError, match=says):
        trainer.fit(ToyChain(), loader)


# -- checkpoints cut short -------------------------------------------------------------------------------
def _placed_with_state() -> tuple[Any, Any, dict[str, Any]]:
    """A one-stage placement of ToyChain after one Adam step, and its shards as the strategy saves them."""
    import torch

    from lightning_pipe import PipelinePlan
    from lightning_pipe.runtime.placement import Placement
    from tests.models import ToyChain, make_data

    model = ToyChain()
    placement = Placement(model)
    placement.apply(PipelinePlan(), 0, None)
    optimizer = torch.optim.Adam(model.parameters())
    x, y = make_data(4)
    model.pipeline_loss(model(x), (x, y)).backward()
    optimizer.step()
    shards = {"model": placement.export_state()["model"], "optimizer_0": placement.export_state(optimizer)["optimizer"]}
    return placement, optimizer, shards


def _cut(path: Path, keep: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


@pytest.mark.parametrize("keep", [0.0, 0.5, 0.99])
def test_a_sharded_checkpoint_cut_short_names_the_checkpoint_and_the_shard(tmp_path, keep: float) -> None:
    from lightning_pipe.lightning import checkpoint

    placement, optimizer, shards = _placed_with_state()
    path = tmp_path / "epoch=0-step=1.ckpt"
    checkpoint.save_sharded(path, shards, {"epoch": 0}, 0, lambda: None)
    checkpoint.load_sharded(path, placement, [optimizer])  # complete: loads
    (shard,) = path.glob("*.distcp")
    _cut(shard, keep)
    with pytest.raises(checkpoint.IncompleteCheckpointError) as err:
        checkpoint.load_sharded(path, placement, [optimizer])
    message = str(err.value)
    assert f"checkpoint {path} is incomplete or corrupt: shard {shard} holds" in message, message
    assert "resume from another checkpoint" in message


def test_a_sharded_checkpoint_damaged_in_place_names_the_checkpoint_and_its_file(tmp_path) -> None:
    import re

    from lightning_pipe.lightning import checkpoint

    placement, optimizer, shards = _placed_with_state()
    damaged, short_meta = tmp_path / "damaged.ckpt", tmp_path / "short_meta.ckpt"
    for path in (damaged, short_meta):
        checkpoint.save_sharded(path, shards, {"epoch": 0}, 0, lambda: None)
    (shard,) = damaged.glob("*.distcp")
    shard.write_bytes(bytes(shard.stat().st_size))  # the right size, every byte zero
    with pytest.raises(checkpoint.IncompleteCheckpointError, match=re.escape(f"checkpoint {damaged} is incomplete")):
        checkpoint.load_sharded(damaged, placement, [optimizer])
    shard.unlink()
    with pytest.raises(checkpoint.IncompleteCheckpointError, match=r"is incomplete or corrupt: shard __0_0.distcp is"):
        checkpoint.load_sharded(damaged, placement, [optimizer])
    _cut(short_meta / "meta.pt", 0.5)
    with pytest.raises(
        checkpoint.IncompleteCheckpointError, match=re.escape(f"{short_meta / 'meta.pt'} cannot be read")
    ):
        checkpoint.load_sharded(short_meta, placement, [optimizer])


@pytest.mark.parametrize("keep", [0.0, 0.01, 0.5, 0.99])
def test_a_single_file_checkpoint_cut_short_names_the_file(tmp_path, keep: float) -> None:
    from lightning_pipe.lightning import checkpoint

    placement, optimizer, shards = _placed_with_state()
    path = tmp_path / "epoch=0-step=1.ckpt"
    saved = {"state_dict": shards["model"], "optimizer_states": [shards["optimizer_0"]], "epoch": 0}
    checkpoint.save_file(saved, path)
    checkpoint.load_file(path, placement, [optimizer])  # complete: loads
    _cut(path, keep)
    with pytest.raises(checkpoint.IncompleteCheckpointError) as err:
        checkpoint.load_file(path, placement, [optimizer])
    message = str(err.value)
    assert message.startswith(f"checkpoint {path} is incomplete or corrupt: torch.load cannot read the file"), message
    assert "resume from another checkpoint" in message
