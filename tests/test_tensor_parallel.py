"""Tensor-parallel stages (tensor_parallel=t): Trainer.fit of the example's MLP chain, each stage
split over t ranks by its configure_stage hook, matches one process with clipping on; the
layout's rank arithmetic; and the refusals.

The fits run in float64. A row-parallel layer sums its parts' products in another order than one
process's matmul, and in float32 that differs in the last bits; Adam divides each gradient by its
own running magnitude, so for a weight whose gradient nearly cancels that difference reaches
4e-5 of the weight within three steps (seen at (1, 2, 2)). In float64 the same order
differences stay far below 1e-5, so the comparison checks the layout, not rounding.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from types import SimpleNamespace
from typing import Any, Optional

import pytest
import torch
from torch import nn

from lightning_pipe import PipelinePlan, PipelineStrategy
from lightning_pipe.core.topology import Topology
from lightning_pipe.runtime.placement import Placement
from lightning_pipe.runtime.tensor_parallel import squared_norm
from tests.launch import ROOT
from tests.models import assert_close_dicts, load_plain, make_data, reference_train
from tests.shared import launch_root, scenario, scenario_dir

sys.path.insert(0, str(ROOT / "examples"))
from tensor_parallel import MLPChain  # noqa: E402

BATCH, STEPS, M, CLIP = 8, 3, 2, 0.05
CKPT = "tp.ckpt"
#: (w, d, t): 2 stages of 2 tensor-parallel ranks; 2 replicas of one stage of 2 ranks.
LAYOUTS = [(1, 2, 2), (2, 1, 2)]


def _name(width: int, depth: int, tp: int) -> str:
    return f"tp_{width}x{depth}x{tp}"


def fit_tensor_parallel(rank: int, world: int, depth: int, tp: int, resume: Optional[str] = None) -> dict[str, Any]:
    """Fit the example's MLP chain, each MLP block split over its stage's ``tp`` ranks, and save a
    checkpoint; or (``resume``: a checkpoint of the launch) resume from it for one more step.
    Return this rank's weights (gathered whole), their local shapes, the samples it read and the mesh."""
    import lightning as L
    from torch.distributed.tensor import DTensor
    from torch.utils.data import DataLoader

    from tests.scripts.train_toy import Indexed

    class Doubles(Indexed):
        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
            x, y, index = super().__getitem__(i)
            return x.double(), y, index

    class Samples(L.Callback):
        def __init__(self) -> None:
            self.indices: list[list[int]] = []

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.indices.append(batch[2].tolist())

    torch.manual_seed(0)
    model, samples = MLPChain().double(), Samples()
    strategy = PipelineStrategy(
        schedule="1f1b",
        pipeline_depth=depth,
        tensor_parallel=tp,
        microbatches=M,
        partition="uniform",
        gradient_clip_val=CLIP,
        timeout=timedelta(seconds=60),
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=STEPS + (resume is not None),
        limit_val_batches=1,
        val_check_interval=STEPS,  # once, after the fit's last step (before a resumed step)
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        callbacks=[samples],
    )
    width = world // (depth * tp)
    train = DataLoader(Doubles(BATCH * width * (STEPS + 1), 0), batch_size=BATCH)
    val = DataLoader(Doubles(BATCH * width, 99), batch_size=BATCH)
    if resume is not None:
        trainer.fit(model, train, val, ckpt_path=str(launch_root() / "world4" / resume / CKPT))
    else:
        trainer.fit(model, train, val)
        trainer.save_checkpoint(scenario_dir() / CKPT)  # a sharded (DCP) directory: each rank its parts
    mesh = trainer.strategy.device_mesh
    params = dict(model.named_parameters())
    return {
        "params": {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in params.items()},
        "local_shape": {n: tuple((p.to_local() if isinstance(p, DTensor) else p).shape) for n, p in params.items()},
        "indices": samples.indices,
        "mesh": (mesh.mesh_dim_names, mesh.mesh.tolist()),
        "tp": mesh["tensor_parallel"].mesh.tolist() if tp > 1 else None,
        "loss": float(trainer.callback_metrics["train_loss"]),
        "val_loss": float(trainer.callback_metrics.get("val_loss", float("nan"))),
    }


for _w, _d, _t in LAYOUTS:
    scenario(_w * _d * _t, _name(_w, _d, _t), fit_tensor_parallel, _d, _t)
#: (1, 2, 2)'s checkpoint resumed without tensor parallel, on 2 replicas of the 2 stages.
scenario(4, "tp_resume_2x2x1", fit_tensor_parallel, 2, 1, _name(*LAYOUTS[0]))


def _reference(
    batches: list[Any], clip: Any = CLIP, then: Optional[list[Any]] = None
) -> tuple[dict[str, torch.Tensor], MLPChain]:
    """One process's weights after ``batches`` (and, with the same optimizer, ``then``)."""
    torch.manual_seed(0)
    model = MLPChain().double()
    opt = torch.optim.Adam(model.parameters(), lr=model.lr)
    want = reference_train(model, batches, clip=clip, opt=opt)  # type: ignore[arg-type]
    if then:
        want = reference_train(model, then, clip=clip, opt=opt)  # type: ignore[arg-type]
    return want, model


def _global_batches(ranks: list[dict], width: int, depth: int, tp: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each step's union of the samples the replicas read (the first stage's first part of each)."""
    topology = Topology(width * depth * tp, depth, tensor_parallel=tp)
    x, y = make_data(BATCH * width * (STEPS + 1), 0)
    first = [ranks[topology.rank_of(replica, 0)]["indices"] for replica in range(width)]
    steps = len(first[0])
    return [(x[i].double(), y[i]) for i in (torch.tensor(sum((f[s] for f in first), [])) for s in range(steps))]


@pytest.mark.parametrize("width,depth,tp", LAYOUTS, ids=[_name(*layout) for layout in LAYOUTS])
def test_tensor_parallel_fit_matches_single_process(launched, width: int, depth: int, tp: int) -> None:
    ranks = launched(width * depth * tp).ok(_name(width, depth, tp))
    topology = Topology(width * depth * tp, depth, tensor_parallel=tp)
    for r, rank in enumerate(ranks):  # every rank of a replica (its stages, their parts) read the replica's samples
        assert rank["indices"] == ranks[topology.rank_of(topology.replica_of(r), 0)]["indices"]
    batches = _global_batches(ranks, width, depth, tp)
    assert len(batches) == STEPS
    want, model = _reference(batches)
    merged: dict[str, torch.Tensor] = {}
    for r, rank in enumerate(ranks):
        assert_close_dicts(rank["params"], {k: want[k] for k in rank["params"]}, rtol=1e-5)
        merged.update(rank["params"])
        # fc1 is split by output features (rows of its weight), fc2 by input features (columns).
        for name, shape in rank["local_shape"].items():
            whole = tuple(want[name].shape)
            if ".fc1." in name:
                assert shape == (whole[0] // tp, *whole[1:]), name
            elif name.endswith(".fc2.weight"):
                assert shape == (whole[0], whole[1] // tp), name
            else:
                assert shape == whole, name
        names, grid = rank["mesh"]
        assert names == ("data_parallel", "pipeline_parallel", "tensor_parallel")
        assert grid == topology.mesh_ranks()
        assert rank["tp"] == [r - r % tp + k for k in range(tp)]
        assert rank["loss"] == ranks[r - r % tp]["loss"]  # the parts of a stage replica compute one loss
    assert merged.keys() == want.keys()
    # Lightning's consolidate tool reads the parts every rank saved into the whole (float32) model.
    restored = load_plain(MLPChain, launched(width * depth * tp).dir(_name(width, depth, tp)) / CKPT)
    whole = {k: v.float() for k, v in merged.items()}
    assert_close_dicts({n: p.detach() for n, p in restored.named_parameters()}, whole, rtol=0, atol=0)
    unclipped, _ = _reference(batches, clip=None)  # clipping was active: without it the run ends elsewhere
    assert max(float((unclipped[k] - want[k]).abs().max()) for k in want) > 1e-4
    with torch.no_grad():  # the validation at the end of fit: a forward-only pass through the split stages
        xv, yv = make_data(BATCH * width, 99)
        val = float(model.pipeline_loss(model(xv.double()), (xv, yv)))
    for rank in ranks:
        assert rank["val_loss"] == pytest.approx(val, rel=1e-5)


def test_topology_places_tensor_parallel_ranks_innermost() -> None:
    pp = Topology(8, 2, "pp", tensor_parallel=2)  # w=2, d=2, t=2
    assert pp.width == 2
    assert pp.mesh_ranks() == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert [(pp.replica_of(r), pp.position_of(r), pp.tp_index_of(r)) for r in (0, 3, 5)] == [
        (0, 0, 0),
        (0, 1, 1),
        (1, 0, 1),
    ]
    assert pp.lane_ranks(3) == [1, 3] and pp.lane_ranks(4) == [4, 6]
    assert pp.lanes() == [(0, 0), (0, 1), (1, 0), (1, 1)]
    dp = Topology(8, 2, "dp", tensor_parallel=2)
    assert dp.mesh_ranks() == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    assert dp.mesh_dims == ("data_parallel", "pipeline_parallel", "tensor_parallel")
    assert Topology(4, 2).mesh_dims == ("data_parallel", "pipeline_parallel")  # t = 1: the mesh is unchanged
    with pytest.raises(ValueError, match="not divisible by pipeline_depth=2 x tensor_parallel=3"):
        Topology(8, 2, tensor_parallel=3)


def test_plan_counts_tensor_parallel_ranks() -> None:
    plan = PipelinePlan.for_world(8, 2, tensor_parallel=2)
    assert (plan.width, plan.depth, plan.world_size) == (2, 2, 8)
    assert PipelinePlan.for_world(4, tensor_parallel=2).depth == 2  # one pipeline of 2-rank stages
    assert "2 tensor-parallel ranks" in plan.describe()


@pytest.mark.parametrize(
    "fields,message",
    [
        (
            {"data_parallel": "fsdp"},
            "tensor_parallel=2 does not run with data_parallel='fsdp'.*use data_parallel='ddp'",
        ),
        ({"schedule": "2bw", "microbatches": 2}, "does not run schedule '2bw'.*use schedule='1f1b' or 'gpipe'"),
        ({"split_backward": True}, "does not run split_backward=True.*use split_backward=False"),
        ({"virtual_stages": 2, "microbatches": 2}, "runs one stage per rank; use virtual_stages=1"),
    ],
)
def test_plan_refuses_what_tensor_parallel_does_not_run(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PipelinePlan(width=1, depth=2, tensor_parallel=2, **fields)
    with pytest.raises(ValueError, match=message):  # the strategy refuses it before any process starts
        PipelineStrategy(pipeline_depth=2, tensor_parallel=2, **fields)


def test_strategy_refuses_reconfiguration_and_the_autoplanner_with_tensor_parallel() -> None:
    from lightning_pipe import AutoPlanner

    strategy = PipelineStrategy(pipeline_depth=2, tensor_parallel=2)
    with pytest.raises(ValueError, match="reconfiguration.*tensor_parallel=2.*fix the layout in PipelineStrategy"):
        strategy.enable_reconfiguration()
    trainer = SimpleNamespace(strategy=strategy, max_steps=100)
    with pytest.raises(ValueError, match="does not apply with tensor_parallel=2"):
        AutoPlanner().setup(trainer, None, "fit")  # type: ignore[arg-type]
    strategy._plan = PipelinePlan(width=1, depth=2, tensor_parallel=2)
    with pytest.raises(ValueError, match=r"reconfigure\(\) does not apply with tensor_parallel=2"):
        strategy.reconfigure(PipelinePlan(width=2, depth=2))


class _Tied(nn.Module):
    """Two linear blocks sharing one weight (as an embedding and its tied head)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.last = nn.Linear(4, 4), nn.Linear(4, 4)
        self.last.weight = self.first.weight

    def pipeline_blocks(self) -> list[nn.Module]:
        return [self.first, self.last]


def test_placement_refuses_weights_tied_across_tensor_parallel_stages() -> None:
    plan = PipelinePlan(width=1, depth=2, tensor_parallel=2, partition=[1, 1])
    with pytest.raises(ValueError, match="tied across stages .*not supported with tensor_parallel=2"):
        Placement(_Tied()).apply(plan, rank=0)


def test_tensor_parallel_checkpoint_resumes_without_tensor_parallel(launched) -> None:
    # (1, 2, 2) saved each weight and its Adam state in parts; (2, 2, 1) loads them whole and trains on.
    saved = launched(4).ok(_name(*LAYOUTS[0]))
    ranks = launched(4).ok("tp_resume_2x2x1")
    resumed = _global_batches(ranks, 2, 2, 1)
    assert len(resumed) == 1  # the one step after the checkpoint's three
    want, _ = _reference(_global_batches(saved, *LAYOUTS[0]), then=resumed)
    for rank in ranks:
        assert_close_dicts(rank["params"], {k: want[k] for k in rank["params"]}, rtol=1e-5)
        assert rank["tp"] is None and all(shape == tuple(want[n].shape) for n, shape in rank["local_shape"].items())


def test_the_squared_norm_without_tensor_parallel_is_the_per_tensor_norms_summed_in_order() -> None:
    # One _foreach_norm per dtype gives each gradient's vector_norm bit for bit on the CPU, summed in the given order.
    torch.manual_seed(0)
    grads = [torch.randn(64, 32), torch.randn(7, dtype=torch.float64), torch.randn(33).bfloat16(), torch.randn(5)]
    want = torch.stack(
        [torch.linalg.vector_norm(g, dtype=torch.promote_types(g.dtype, torch.float32)).float() for g in grads]
    )
    got = squared_norm(grads, torch.device("cpu"))
    assert got.dtype == torch.float32 and torch.equal(got, want.pow(2).sum())
    assert torch.equal(squared_norm([], torch.device("cpu")), torch.zeros(()))
