"""The FSDP benchmark's layouts, workload checks, tracker, kept-state bytes and tables, without launching processes."""

from __future__ import annotations

import argparse
import sys

import pytest
import torch

from tests.launch import ROOT

sys.path[:0] = [str(ROOT / "benchmarks")]
from bench_fsdp import (  # noqa: E402
    CONTENDERS,
    LAYOUTS,
    WideMLP,
    Workload,
    adamw,
    check_workload,
    make_batch,
    memory_table,
    microbatch_sizes,
    parse_layouts,
    state_bytes,
    step_table,
)
from bench_pipelines import PeakTensorBytes  # noqa: E402


def test_layouts_parse_and_refuse_one_replica() -> None:
    assert parse_layouts("2x1, 4x1,2x2") == [(2, 1), (4, 1), (2, 2)] == list(LAYOUTS)
    for bad in ("1x2", "2by1", "x2", "2x0"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_layouts(bad)


def test_workload_splits_one_global_batch_and_refuses_what_a_layout_cannot_run() -> None:
    work = Workload(blocks=8, width=512, global_batch=32, microbatches=4)
    assert [work.microbatch_size(w) for w, _ in LAYOUTS] == [4, 2, 4]
    assert microbatch_sizes(work, LAYOUTS) == [2, 4]
    assert microbatch_sizes(work, [(2, 1)]) == [4, 8]  # two sizes to fit the profile on
    check_workload(work, LAYOUTS)
    with pytest.raises(ValueError, match="replicas"):
        check_workload(Workload(8, 512, 24, 4), [(4, 1)])
    with pytest.raises(ValueError, match="stages"):
        check_workload(Workload(1, 512, 32, 4), [(2, 2)])
    plans = {name: work.plan(2, 2, name) for name in CONTENDERS}
    assert {(p.data_parallel, p.reshard_after_forward) for p in plans.values()} == set(CONTENDERS.values())
    assert {(p.width, p.depth, p.microbatches, p.schedule) for p in plans.values()} == {(2, 2, 4, "1f1b")}


def test_default_model_is_dominated_by_weights_gradients_and_adam_state() -> None:
    # 16 bytes per parameter (fp32 weight, gradient, two moments) against a microbatch's
    # activations: a few width-sized tensors per block and sample, at the largest microbatch (4).
    work = Workload(blocks=8, width=512, global_batch=32, microbatches=4)
    parameters = sum(p.numel() for p in WideMLP(work.blocks, work.width).parameters())
    activations = 4 * work.microbatches * 4 * work.width * 4 * work.blocks  # 4 tensors, 4 microbatches held
    assert 16 * parameters > 50 * activations


def test_tracker_follows_resized_storages_and_state_bytes_count_sixteen_per_parameter() -> None:
    kept = torch.zeros(100)
    with PeakTensorBytes([kept]) as tracker:
        gathered = torch.ones(1000)  # 4000 bytes
        gathered.untyped_storage().resize_(0)  # as FSDP frees a gathered weight
        assert tracker.now() == 400
        gathered.untyped_storage().resize_(4000)
        torch.add(kept, 1)  # an op reads the sizes
    assert tracker.peak == 400 + 4000 + 400
    model = WideMLP(1, 8)
    opt = adamw(model.parameters())
    x, y = make_batch(2, 8)
    model.pipeline_loss(model.chain[0](x), (x, y)).backward()
    opt.step()
    params = list(model.parameters())
    # weights and their reduced gradients, AdamW's two moments, and its step counts (a scalar per parameter)
    assert state_bytes(params, opt) == 16 * sum(p.numel() for p in params) + sum(
        st["step"].nbytes for st in opt.state.values()
    )


def _rows() -> list[dict]:
    rows = []
    for name, scale in zip(CONTENDERS, (1.0, 0.5, 0.25)):
        rows.append(
            {
                "layout": (2, 1),
                "name": name,
                "rounds": [1.0 / scale, 2.0 / scale, 3.0],
                "stages": [0, 0],
                "peaks": [int(8e6 * scale), int(10e6 * scale)],
                "predicted": [int(8e6 * scale), int(11e6 * scale)],
                "state": [int(4e6 * scale)] * 2,
            }
        )
    return rows


def test_tables_give_ratios_to_ddp_of_the_same_layout_round_and_rank() -> None:
    steps = step_table(_rows()).splitlines()
    assert steps[0].startswith("| (w, d) | replicas | s/step (median)")
    # per-round ratios to DDP's (1, 2, 3): zero-3's rounds are 4, 8, 3 -> 4, 4, 1 -> median 4
    assert steps[2].split(" | ")[3] == "1.000" and steps[4].split(" | ")[3] == "4.000"
    memory = memory_table(_rows()).splitlines()
    assert len(memory) == 2 + 3 * 2  # a row per contender and rank
    zero3_rank1 = memory[-1].split(" | ")
    assert zero3_rank1[2:] == ["1", "0", "2.50", "0.250", "2.75", "1.100", "1.00", "0.250 |"]
