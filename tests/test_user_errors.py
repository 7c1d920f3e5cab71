"""Errors a new user meets say what went wrong and what to do, naming the file, stage, rank or shape involved."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from lightning_pipe.core.sizes import parse_size
from tests.shared import scenario, scenario_dir

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
    from lightning_pipe.lightning.plan_cli import main

    config = _gpt_config(tmp_path, TINY_GPT, TINY_TEXT)
    args = ["--config", str(config), "--devices", "2", "--memory", "64MiB"]
    args += [f"{flag}={value}"]  # '=': a value starting with '-' is the flag's, not another flag
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2
    assert says in capsys.readouterr().err


def test_plan_cli_names_a_config_that_is_not_there(tmp_path, capsys) -> None:
    from lightning_pipe.lightning.plan_cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["--config", str(tmp_path / "nowhere.yaml"), "--devices", "2"])
    assert exit_.value.code == 2
    assert f"argument --config: no such file: {tmp_path / 'nowhere.yaml'}" in capsys.readouterr().err


def test_plan_cli_without_script_names_what_the_config_lacks(tmp_path) -> None:
    from lightning_pipe.lightning.plan_cli import main

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
    from lightning_pipe.lightning.plan_cli import job_conditions, main

    model = {"class_path": "examples.gpt.GPT", "init_args": TINY_GPT}
    data = {"class_path": "examples.gpt.StdlibText", "init_args": TINY_TEXT}
    config, out = _gpt_config(tmp_path, model, data), tmp_path / "plan.yaml"
    args = ["--config", str(config), "--devices", "2", "--memory", "1GiB", "--no-links", "--virtual-stages", "1"]
    # No trial runs here: test_plan_ranking_json runs one through a config that names its classes.
    assert main(args + ["--output", str(out), "--top", "2", "--trials", "0"]) == 0
    printed = capsys.readouterr().out
    assert "profiling GPT at microbatch sizes" in printed
    assert yaml.safe_load(out.read_text())["trainer"]["devices"] == 2
    # Profiled as the job's ranks run: 2 processes at once, each with the threads Lightning gives a rank.
    processes, threads = job_conditions(2, None, "cpu")
    said = f"measured in {processes} process(es) at once, {threads} torch thread(s) each"
    assert processes == 2 and said in printed and said in out.read_text().splitlines()[0]


def test_the_plan_cli_profiles_with_the_threads_and_processes_of_the_job(monkeypatch) -> None:
    from lightning.fabric.utilities.distributed import _num_cpus_available

    from lightning_pipe.lightning.plan_cli import job_conditions

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = _num_cpus_available()
    assert job_conditions(4, None, "cpu") == (4, max(1, cores // 4))
    assert job_conditions(8, 2, "cpu") == (2, max(1, cores // 2))  # two ranks of the job on this host
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert job_conditions(4, None, "cpu") == (4, 3)
    assert job_conditions(4, None, "cuda")[0] == 1  # a device each: profiled alone


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


# -- the AutoPlanner without global_batch_size ----------------------------------------------------------
#: Replica batch size and steps per epoch of the AutoPlanner runs below (Indexed samples 0, 1, ...).
REPLICA_BATCH, EPOCH_STEPS, FIT_STEPS = 4, 6, 8


def _autoplanner(width: int) -> Any:
    """An AutoPlanner that moves the job to another width at its first decision (after 2 steps)."""
    from lightning_pipe import AutoPlanner

    class OtherWidth(AutoPlanner):
        def _search(self, trainer: Any, profile: Any) -> Any:
            current, ranked = super()._search(trainer, profile)
            return current, [p for p in ranked if p.plan.width != width]

    auto = OtherWidth(profile_steps=2)
    auto.min_gain = -1.0  # switch whatever the prediction
    return auto


def _fit_without_global_batch(rank: int, world: int, layout: dict[str, Any]) -> dict[str, Any]:
    """Fit ToyChain under an AutoPlanner with no global_batch_size; record each step's replica rows."""
    from datetime import timedelta

    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from lightning_pipe import PipelineStrategy
    from tests.models import ToyChain
    from tests.scripts.train_toy import Indexed

    class Rows(L.Callback):
        def __init__(self) -> None:
            self.rows: list[list[int]] = []
            self.widths: list[int] = []
            self.epochs: list[int] = []
            self.first_plan: Any = None
            self.validated_at: list[int] = []

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            self.rows.append(trainer.strategy.replica_batch(batch)[2].tolist())
            self.first_plan = self.first_plan or trainer.strategy.plan
            self.widths.append(trainer.strategy.plan.width)
            self.epochs.append(trainer.current_epoch)

        def on_validation_end(self, trainer: Any, module: Any) -> None:
            self.validated_at.append(trainer.global_step)

    torch.manual_seed(0)
    strategy = PipelineStrategy(timeout=timedelta(seconds=60), **layout)
    start_width = world // (layout.get("pipeline_depth") or world)
    rows, auto = Rows(), _autoplanner(start_width)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        max_steps=FIT_STEPS,
        val_check_interval=3,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[rows, auto],
        strategy=strategy,
    )
    samples = Indexed(REPLICA_BATCH * start_width * EPOCH_STEPS, 0)
    loader = DataLoader(samples, batch_size=REPLICA_BATCH)
    trainer.fit(ToyChain(), loader, DataLoader(Indexed(8, 1), batch_size=REPLICA_BATCH))
    return {
        "start_width": start_width,
        "rows": rows.rows,
        "widths": rows.widths,
        "validated_at": rows.validated_at,
        "epochs": rows.epochs,
        "first_plan": rows.first_plan,
        "batches_per_epoch": trainer.num_training_batches,
        "global_batch": strategy.global_batch_size,
        "origin": [d["global_batch_origin"] for d in auto.decisions],
        "report_origin": strategy.global_batch_origin,
        "seed": int(os.environ.get("PL_GLOBAL_SEED", 0)),  # of Lightning's shuffling sampler
    }


#: Layouts the AutoPlanner starts from on 2 processes: 2 replicas of one stage, and no layout at all
#: (one pipeline of 2 stages, the safe start: recompute, one sample per microbatch).
STARTS = {"2x1": {"pipeline_depth": 1, "microbatches": 2}, "no_layout": {}}
for _name, _layout in STARTS.items():
    scenario(2, f"autoplan_global_batch_{_name}", _fit_without_global_batch, _layout)


def _start_width_batches(start_width: int, steps: int, seed: int) -> list[set[int]]:
    """Each step's samples in a fit at ``start_width`` without reconfiguration: the union over
    replicas of the batches Lightning's (shuffling) distributed sampler gives each replica."""
    from torch.utils.data import DistributedSampler

    from tests.scripts.train_toy import Indexed

    samples = Indexed(REPLICA_BATCH * start_width * EPOCH_STEPS, 0)
    batches = []
    for step in range(steps):
        epoch, i = divmod(step, EPOCH_STEPS)
        orders = [DistributedSampler(samples, start_width, r, shuffle=True, seed=seed) for r in range(start_width)]
        for order in orders:
            order.set_epoch(epoch)
        batches.append(set().union(*(list(o)[i * REPLICA_BATCH : (i + 1) * REPLICA_BATCH] for o in orders)))
    return batches


@pytest.mark.parametrize("start", sorted(STARTS))
def test_autoplanner_takes_the_global_batch_from_the_starting_layout(launched, start: str) -> None:
    ranks = launched(2).ok(f"autoplan_global_batch_{start}")
    width = ranks[0]["start_width"]
    said = f"global batch {REPLICA_BATCH * width} taken from the starting layout: batch size {REPLICA_BATCH} x width "
    said += str(width)
    for rank in ranks:
        assert rank["global_batch"] == REPLICA_BATCH * width
        assert rank["origin"] == [said] and rank["report_origin"] == said
        assert rank["widths"][:2] == [width] * 2 and set(rank["widths"][2:]) == {2 // width}  # switched after 2
        # An epoch keeps its batches and validation its place: every 3 steps of a 6-step epoch.
        assert rank["batches_per_epoch"] == EPOCH_STEPS and rank["epochs"] == [0] * EPOCH_STEPS + [1] * 2
        assert rank["validated_at"] == [3, 6]
        first = rank["first_plan"]
        if start == "no_layout":  # the safe start: recompute everywhere, one sample per microbatch
            assert first.microbatches == REPLICA_BATCH and all(first.recompute), first
        else:
            assert first.microbatches == STARTS[start]["microbatches"] and not any(first.recompute), first
    # Every step trains the samples the fit would have at its starting width, whatever the width now.
    steps = len(ranks[0]["rows"])
    got = [set().union(*(rank["rows"][s] for rank in ranks)) for s in range(steps)]
    assert steps == FIT_STEPS and got == _start_width_batches(width, steps, ranks[0]["seed"])
    for s in range(steps):  # and each replica its own share of them: no sample twice
        replicas = {tuple(rank["rows"][s]) for rank in ranks}
        assert sum(map(len, replicas)) == len(got[s])


def _resume_from_cut_checkpoints(rank: int, world: int) -> dict[str, str]:
    """Save a sharded and a single-file checkpoint, cut a file of each short, and resume from them:
    every rank must raise the same error (none waits for the others)."""
    from datetime import timedelta

    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from lightning_pipe import PipelineStrategy
    from tests.models import ToyChain
    from tests.scripts.train_toy import Indexed

    def fit(sharded: bool, steps: int, ckpt_path: Any = None) -> L.Trainer:
        strategy = PipelineStrategy(
            pipeline_depth=world, save_distributed_checkpoint=sharded, timeout=timedelta(seconds=60)
        )
        trainer = L.Trainer(
            accelerator="cpu",
            devices=world,
            max_steps=steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            strategy=strategy,
        )
        trainer.fit(ToyChain(), DataLoader(Indexed(32, 0), batch_size=8), ckpt_path=ckpt_path)
        return trainer

    messages = {}
    for sharded, name in ((True, "sharded.ckpt"), (False, "single.ckpt")):
        path = scenario_dir() / name
        fit(sharded, 1).save_checkpoint(path)
        if rank == 0:
            _cut(next(path.glob("__1_*.distcp")) if sharded else path, 0.5)
        torch.distributed.barrier()
        try:
            fit(sharded, 2, path)
            messages[name] = "loaded"
        except Exception as err:  # noqa: BLE001 - the test reads the message
            messages[name] = f"{type(err).__name__}: {err}"
    return messages


scenario(2, "resume_from_cut_checkpoints", _resume_from_cut_checkpoints)


def test_resuming_from_a_cut_checkpoint_fails_on_every_rank_naming_it(launched) -> None:
    folder = launched(2).dir("resume_from_cut_checkpoints")
    for messages in launched(2).ok("resume_from_cut_checkpoints"):
        sharded, single = messages["sharded.ckpt"], messages["single.ckpt"]
        assert sharded.startswith(
            f"IncompleteCheckpointError: checkpoint {folder / 'sharded.ckpt'} is incomplete or corrupt: "
            f"shard {folder / 'sharded.ckpt' / '__1_0.distcp'} holds"
        ), sharded
        assert single.startswith(
            f"IncompleteCheckpointError: checkpoint {folder / 'single.ckpt'} is incomplete or corrupt"
        ), single
