"""The GPT example runs from each config through LightningCLI, logs to TensorBoard and checkpoints.

Each run is a scenario of the shared 2-process launch (tests/shared.py): the example's own
``main`` parses the config and the overrides as its command line would.
"""

from __future__ import annotations

import sys

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.launch import ROOT
from tests.models import load_plain
from tests.shared import scenario, scenario_dir

sys.path.insert(0, str(ROOT / "examples"))
from gpt import GPT, StdlibText  # noqa: E402

SCHEDULES = ("gpipe", "1f1b", "2bw")


def _gpt_cli(rank: int, world: int, schedule: str) -> None:
    import gpt

    gpt.main(
        [
            "fit",
            f"--config={ROOT / 'configs' / f'gpt_{schedule}.yaml'}",
            "--trainer.max_steps=6",
            "--trainer.val_check_interval=3",
            "--trainer.limit_val_batches=2",
            "--trainer.log_every_n_steps=1",
            f"--trainer.logger.init_args.save_dir={scenario_dir()}",
            "--model.n_layer=2",
            "--model.n_embd=32",
            "--data.batch_size=8",
            "--data.max_bytes=200000",
        ]
    )


def _hf_llama_cli(rank: int, world: int) -> None:
    import hf_llama

    hf_llama.main(
        [
            "fit",
            f"--config={ROOT / 'configs' / 'hf_llama.yaml'}",
            "--trainer.max_steps=12",
            "--trainer.val_check_interval=12",
            "--trainer.limit_val_batches=2",
            "--trainer.log_every_n_steps=1",
            f"--trainer.logger.init_args.save_dir={scenario_dir()}",
            "--model.num_hidden_layers=2",
            "--model.hidden_size=32",
            "--model.intermediate_size=64",
            "--data.batch_size=8",
            "--data.max_bytes=200000",
        ]
    )


for _schedule in SCHEDULES:
    scenario(2, f"gpt_cli_{_schedule}", _gpt_cli, _schedule)
scenario(2, "hf_llama_cli", _hf_llama_cli)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_gpt_config_trains_logs_and_checkpoints(launched, schedule: str) -> None:
    launched(2).ok(f"gpt_cli_{schedule}")
    run = launched(2).dir(f"gpt_cli_{schedule}") / f"gpt_{schedule}" / "version_0"
    acc = EventAccumulator(str(run))
    acc.Reload()
    losses = [e.value for e in acc.Scalars("train_loss")]
    assert len(losses) == 6 and all(torch.isfinite(torch.tensor(losses)))
    assert len(acc.Scalars("val_loss")) == 2
    # The sharded checkpoint, consolidated, loads into the plain model in this one process.
    ckpt = next((run / "checkpoints").glob("*.ckpt"))
    assert ckpt.is_dir() and (ckpt / "meta.pt").is_file()
    model = load_plain(GPT, ckpt)
    data = StdlibText(block_size=64, batch_size=4, max_bytes=200000)
    data.setup("validate")
    x, y = next(iter(data.val_dataloader()))
    with torch.no_grad():
        out = x
        for block in model.pipeline_blocks():
            out = block(out)
        val = float(model.pipeline_loss(out, (x, y)))
    assert val < torch.log(torch.tensor(256.0)).item()  # better than uniform: the weights trained


def test_hf_llama_config_trains_with_tied_embeddings(launched) -> None:
    # transformers' Llama from a config, its embedding tied to the head across the 2 stages.
    launched(2).ok("hf_llama_cli")
    from hf_llama import HFLlama

    run = launched(2).dir("hf_llama_cli") / "hf_llama" / "version_0"
    acc = EventAccumulator(str(run))
    acc.Reload()
    losses = [e.value for e in acc.Scalars("train_loss")]
    assert len(losses) == 12 and losses[-1] < losses[0] < 6.0, losses  # it learns from about ln 256 = 5.55
    model = load_plain(HFLlama, next((run / "checkpoints").glob("*.ckpt")))
    assert model.tokens_out.head.weight is model.tokens_in.embed.weight  # one copy saved, tied again on load
