"""Trainer.fit through torchrun and Lightning's launcher: parity, sampler, logging, validation,
predict, LR schedulers, checkpoints and bf16, all against a single-process reference."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_pipe.schedules import get as get_schedule
from tests.launch import SCRIPTS, launch
from tests.models import ToyChain, assert_close_dicts, load_plain, make_data, reference_grads, reference_train
from tests.scripts.train_toy import FIT_DEFAULTS, fit_toy
from tests.shared import scenario

BATCH, STEPS, M = 8, 5, 4
SCRIPT = str(SCRIPTS / "train_toy.py")


def _load(out: Path, tag: str, world: int) -> list[dict]:
    return [torch.load(out / f"{tag}_rank{r}.pt", weights_only=False) for r in range(world)]


def _tag(schedule: str, recompute: bool = False, split: bool = False, precision: str = "32-true") -> str:
    suffix = f"{'_split' if split else ''}{'_' + precision if precision != '32-true' else ''}"
    return f"{schedule}_{'rc' if recompute else 'plain'}{suffix}"


def _configs(width: int, depth: int) -> list[dict]:
    """Every Trainer run of one layout; each test reads the runs it needs (none runs twice)."""
    runs = [dict(schedule=s, recompute=r, sharded=not r) for s in ("gpipe", "1f1b") for r in (False, True)]
    runs += [dict(schedule=s, split=True) for s in ("gpipe", "1f1b")]
    runs += [dict(schedule="2bw", scheduler=True), dict(schedule="2bw", split=True, scheduler=True)]
    if width * depth == 2 or width == 2:
        runs.append(dict(schedule="2bw", recompute=True, scheduler=True, sharded=False))
    if width * depth == 2:
        runs += [dict(schedule=s, recompute=True, precision="bf16-mixed") for s in ("gpipe", "2bw")]
    return runs


LAYOUTS = [(1, 2), (1, 4), (2, 2)]
for _w, _d in LAYOUTS:
    for _run in _configs(_w, _d):
        _name = f"toy_{_w}x{_d}_" + _tag(
            _run["schedule"], _run.get("recompute", False), _run.get("split", False), _run.get("precision", "32-true")
        )
        scenario(_w * _d, _name, fit_toy, _d, *[_run.get(k, v) for k, v in FIT_DEFAULTS.items()])


for _w, _d in LAYOUTS:  # 1F1B split only in its drain: whole backwards and I + W in one program
    scenario(_w * _d, f"toy_{_w}x{_d}_1f1b_drain", partial(fit_toy, placement="drain"), _d, "1f1b", False, True)


#: Interleaved 1F1B: two stages per rank over a chain of 8 blocks (ToyChain with 6 residual blocks).
INTERLEAVED_BLOCKS = 6


def _interleaved_tags(width: int, depth: int) -> list[tuple[str, bool, bool]]:
    """(tag, recompute, split backward) of every interleaved run of a layout."""
    runs = [(rc, split) for rc in ((False, True) if width * depth == 2 else (False,)) for split in (False, True)]
    return [(f"interleaved{'_rc' if rc else ''}{'_split' if split else ''}", rc, split) for rc, split in runs]


for _w, _d in LAYOUTS:
    for _tag_name, _rc, _split in _interleaved_tags(_w, _d):
        scenario(
            _w * _d,
            f"toy_{_w}x{_d}_{_tag_name}",
            partial(fit_toy, virtual=2, blocks=INTERLEAVED_BLOCKS),
            _d,
            "1f1b",
            _rc,
            _split,
        )


def _interleaved_two_bw_microbatches(depth: int, placement: str = "loop") -> int:
    """The fewest microbatches interleaved 2BW runs at two stages per rank that split the batch
    evenly: the loop placement needs a multiple of ``d`` with ``2 m >= 2 (d - 1) + d`` (``d`` at
    ``d = 2``, ``2 d`` beyond), the V ``m >= 2 d - 1``."""
    spec = get_schedule("2bw")
    return next(m for m in (2, 4, 8) if spec.runs(depth, m, 2, placement) and BATCH % m == 0)


#: Interleaved 2BW runs: (tag, stage placement, split backward). Each stage of a rank keeps its
#: own W waiting under split backward (schedules/w_placement.py, ``carry_split``).
INTERLEAVED_TWO_BW = [
    ("interleaved_2bw", "loop", False),
    ("interleaved_2bw_split", "loop", True),
    ("v_2bw", "v", False),
    ("v_2bw_split", "v", True),
]


for _w, _d in LAYOUTS:  # interleaved 2BW: two stages per rank, the stream never flushed
    for _tag_name, _shape, _split in INTERLEAVED_TWO_BW:
        scenario(
            _w * _d,
            f"toy_{_w}x{_d}_{_tag_name}",
            partial(
                fit_toy,
                virtual=2,
                blocks=INTERLEAVED_BLOCKS,
                microbatches=_interleaved_two_bw_microbatches(_d, _shape),
                stage_placement=_shape,
            ),
            _d,
            "2bw",
            False,
            _split,
            True,
        )


def _v_runs(width: int, depth: int) -> list[tuple[str, str, bool, Optional[str]]]:
    """(tag, schedule, split backward, stage placement) of every run of the V-shaped placement and
    looped BFS of a layout: ZB-V and DualPipeV split (their own W placement), looped BFS in a V
    (split at d = 2). ZB-V without split runs the same order with whole backwards (its programs
    are checked in tests/test_schedules.py)."""
    runs = [("zbv_split", "zbv", True, None), ("dualpipev_split", "dualpipev", True, None)]
    runs.append(("looped_bfs_v", "looped_bfs", width * depth == 2, "v"))
    return runs


for _w, _d in LAYOUTS:
    for _tag_name, _schedule, _split, _shape in _v_runs(_w, _d):
        scenario(
            _w * _d,
            f"toy_{_w}x{_d}_{_tag_name}",
            partial(
                fit_toy,
                virtual=2,
                blocks=INTERLEAVED_BLOCKS,
                stage_placement=_shape,
                microbatches=max(4, 2 * _d) if _schedule == "dualpipev" else 4,  # DualPipeV: m >= 2d
            ),
            _d,
            _schedule,
            False,
            _split,
        )


class Profiled(ToyChain):
    """ToyChain with an example batch, so partition="profile" can profile it."""

    def __init__(self) -> None:
        super().__init__()
        self.example_input_array = make_data(BATCH)[0]


def _fit_profiled(rank: int, world: int) -> dict:
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_pipe import PipelineStrategy
    from tests.scripts.train_toy import Indexed, Recorder

    torch.manual_seed(0)
    model, recorder = Profiled(), Recorder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder],
        strategy=PipelineStrategy(pipeline_depth=2, microbatches=M, partition="profile"),
    )
    trainer.fit(model, DataLoader(Indexed(BATCH * STEPS, 0), batch_size=BATCH))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"partition": trainer.strategy.plan.partition, "params": params, "indices": recorder.indices}


scenario(2, "toy_profiled_partition", _fit_profiled)


def test_profiled_partition_is_resolved_once_and_trains(launched) -> None:
    ranks = launched(2).ok("toy_profiled_partition")
    assert ranks[0]["partition"] == ranks[1]["partition"] and sum(ranks[0]["partition"]) == 6
    assert min(ranks[0]["partition"]) >= 1
    x, y = make_data(BATCH * STEPS, 0)
    torch.manual_seed(0)
    want = reference_train(ToyChain(), [(x[torch.tensor(i)], y[torch.tensor(i)]) for i in ranks[0]["indices"]])
    assert_close_dicts({**ranks[0]["params"], **ranks[1]["params"]}, want, rtol=1e-5)


def _ranks(launched, width: int, depth: int, tag: str) -> list[dict]:
    return launched(width * depth).ok(f"toy_{width}x{depth}_{tag}")


def _restored(launched, width: int, depth: int, tag: str) -> ToyChain:
    """The plain module loaded in one process from the run's last checkpoint (consolidated if sharded)."""
    return load_plain(ToyChain, launched(width * depth).dir(f"toy_{width}x{depth}_{tag}") / "ckpt" / "last.ckpt")


def _global_batches(ranks: list[dict], width: int, depth: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # Lightning's DistributedSampler shuffles training data: step t's global batch is the union
    # of the samples every replica recorded at step t.
    x, y = make_data(BATCH * width * STEPS, 0)
    idx = [torch.tensor(sum((ranks[rep * depth]["indices"][t] for rep in range(width)), [])) for t in range(STEPS)]
    return [(x[i], y[i]) for i in idx]


def _merged(ranks: list[dict], key: str, depth: int) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for r in range(depth):
        merged.update(ranks[r][key])
    return merged


def _check_run(
    ranks: list[dict], width: int, depth: int, step_lr: bool = False, delay: int = 0, blocks: int = 4
) -> dict[str, torch.Tensor]:
    batches = _global_batches(ranks, width, depth)
    if delay == 0:  # under 2BW the first batch's gradient is still being accumulated after step 1
        torch.manual_seed(0)
        assert_close_dicts(_merged(ranks, "grads", depth), reference_grads(ToyChain(blocks), batches[0]), rtol=1e-5)
    torch.manual_seed(0)
    model, losses = ToyChain(blocks), []
    want = reference_train(model, batches, losses, step_lr=step_lr, delay=delay)
    assert_close_dicts(_merged(ranks, "params", depth), want, rtol=1e-5)
    for r, rank in enumerate(ranks):  # every replica of a stage holds the same weights
        assert_close_dicts(rank["params"], {k: want[k] for k in rank["params"]}, rtol=1e-5)
        assert rank["global_step"] == STEPS
    # Sampler: all stages of one pipeline read the same samples; replicas read disjoint shards.
    for replica in range(width):
        seen = [ranks[replica * depth + s]["indices"] for s in range(depth)]
        assert all(s == seen[0] for s in seen)
    shards = [{i for batch in ranks[rep * depth]["indices"] for i in batch} for rep in range(width)]
    assert sum(len(s) for s in shards) == len(set().union(*shards)) == BATCH * width * STEPS
    # Validation: the logged val_loss is the mean loss of the final model over the val set.
    with torch.no_grad():
        xv, yv = make_data(BATCH * width * 2, 99)
        val = float(F.cross_entropy(model(xv), yv))
        for rank in ranks:
            assert rank["val_loss"] == pytest.approx(val, rel=1e-5)
        # Test: the same forward-only path, on its own data.
        xt, yt = make_data(8 * width * 2, 5)
        for rank in ranks:
            assert rank["test_loss"] == pytest.approx(float(F.cross_entropy(model(xt), yt)), rel=1e-5)
        # Predict: each rank returns its replica's shard of outputs, computed through the pipeline.
        xp, _ = make_data(10 * width, 7)
        for r, rank in enumerate(ranks):
            replica = r // depth
            got = torch.cat(rank["predictions"])
            torch.testing.assert_close(got, model(xp[replica::width]), rtol=1e-5, atol=1e-6)
    if width == 1:
        for rank in ranks:
            assert rank["losses"] == pytest.approx(losses, rel=1e-5)
    return want


@pytest.mark.parametrize("width,depth", LAYOUTS)
def test_fit_matches_single_process(launched, width: int, depth: int) -> None:
    for schedule in ("gpipe", "1f1b"):
        for recompute in (False, True):
            tag = _tag(schedule, recompute)
            want = _check_run(_ranks(launched, width, depth, tag), width, depth)
            # The last checkpoint (a DCP directory, consolidated, or one file when recompute is on
            # here) loads into the plain module in one process.
            restored = _restored(launched, width, depth, tag)
            assert_close_dicts(dict(restored.named_parameters()), want, rtol=1e-5)


@pytest.mark.parametrize("width,depth", LAYOUTS)
def test_fit_interleaved_matches_single_process(launched, width: int, depth: int) -> None:
    # With and without split backward (each rank places its W's as ZB-H1 does), and recompute at d = 2.
    for tag, recompute, split in _interleaved_tags(width, depth):
        ranks = _ranks(launched, width, depth, tag)
        assert all(r["plan"].virtual_stages == 2 and r["plan"].stages == 2 * depth for r in ranks)
        assert all(r["plan"].split_backward == split and all(r["plan"].recompute) == recompute for r in ranks)
        # Each rank holds two non-adjacent stages: rank 0 of d = 2 trains blocks 0-1 and 4-5.
        held = {n.split(".")[0] + ("." + n.split(".")[1] if n.startswith("blocks") else "") for n in ranks[0]["params"]}
        size = (INTERLEAVED_BLOCKS + 2) // (2 * depth)
        chain = ["embed", *[f"blocks.{i}" for i in range(INTERLEAVED_BLOCKS)], "head"]
        assert held == {chain[i] for s in (0, depth) for i in range(s * size, (s + 1) * size)}
        want = _check_run(ranks, width, depth, blocks=INTERLEAVED_BLOCKS)
        path = launched(width * depth).dir(f"toy_{width}x{depth}_{tag}") / "ckpt" / "last.ckpt"
        restored = load_plain(ToyChain, path, depth=INTERLEAVED_BLOCKS)
        assert_close_dicts(dict(restored.named_parameters()), want, rtol=1e-5)


@pytest.mark.parametrize("width,depth", LAYOUTS)
@pytest.mark.parametrize("tag,placement,split", INTERLEAVED_TWO_BW)
def test_fit_interleaved_two_bw_follows_delayed_rule(
    launched, width: int, depth: int, tag: str, placement: str, split: bool
) -> None:
    # Two stages per rank (the loop placement, or the V: rank r holds stages r and 2d - 1 - r),
    # each rank's stream never flushed, with and without split backward: parameters after fit
    # (drained at the end), validation, predict, losses, LR steps and the last checkpoint all
    # follow the PipeDream-2BW rule W(t+1) = W(t) - lr * grad f(W(t-1)).
    ranks = _ranks(launched, width, depth, tag)
    m = _interleaved_two_bw_microbatches(depth, placement)
    assert all(r["plan"].schedule == "2bw" and r["plan"].virtual_stages == 2 for r in ranks)
    assert all(r["plan"].stage_placement == placement and r["plan"].microbatches == m for r in ranks)
    assert all(r["plan"].split_backward == split for r in ranks)
    want = _check_run(ranks, width, depth, step_lr=True, delay=1, blocks=INTERLEAVED_BLOCKS)
    assert ranks[0]["lrs"] == pytest.approx([1e-2 * 0.5 ** (t // 2) for t in range(STEPS)])
    path = launched(width * depth).dir(f"toy_{width}x{depth}_{tag}") / "ckpt" / "last.ckpt"
    restored = load_plain(ToyChain, path, depth=INTERLEAVED_BLOCKS)
    assert_close_dicts(dict(restored.named_parameters()), want, rtol=1e-5)


@pytest.mark.parametrize("width,depth", LAYOUTS)
def test_fit_v_shape_and_looped_bfs_match_single_process(launched, width: int, depth: int) -> None:
    # ZB-V, DualPipeV and looped BFS over the V placement: rank r holds stages r and 2d - 1 - r,
    # so rank 0 trains the first and the last blocks (the embedding and the head) and rank d - 1
    # the two middle stages, handed from one to the other without a message.
    for tag, schedule, split, _ in _v_runs(width, depth):
        ranks = _ranks(launched, width, depth, tag)
        assert all(r["plan"].schedule == schedule and r["plan"].stage_placement == "v" for r in ranks)
        assert all(r["plan"].split_backward == split and r["plan"].stages == 2 * depth for r in ranks)
        size = (INTERLEAVED_BLOCKS + 2) // (2 * depth)
        chain = ["embed", *[f"blocks.{i}" for i in range(INTERLEAVED_BLOCKS)], "head"]
        for r in range(depth):
            held = {
                n.split(".")[0] + ("." + n.split(".")[1] if n.startswith("blocks") else "") for n in ranks[r]["params"]
            }
            assert held == {chain[i] for s in (r, 2 * depth - 1 - r) for i in range(s * size, (s + 1) * size)}
        want = _check_run(ranks, width, depth, blocks=INTERLEAVED_BLOCKS)
        path = launched(width * depth).dir(f"toy_{width}x{depth}_{tag}") / "ckpt" / "last.ckpt"
        restored = load_plain(ToyChain, path, depth=INTERLEAVED_BLOCKS)
        assert_close_dicts(dict(restored.named_parameters()), want, rtol=1e-5)


def test_fit_through_lightning_launcher_with_scheduler_logs_loss(tmp_path: Path) -> None:
    launch(
        [
            SCRIPT,
            "--devices=2",
            "--depth=2",
            "--scheduler",
            "--schedules=1f1b",
            "--recompute=false",
            f"--out={tmp_path}",
        ],
        timeout=300,
    )
    ranks = _load(tmp_path, "1f1b_False", 2)
    _check_run(ranks, 1, 2, step_lr=True)
    assert ranks[0]["lrs"] == pytest.approx([1e-2 * 0.5 ** (k // 2) for k in range(1, STEPS + 1)])
    # The loss reached rank 0's progress bar and TensorBoard, at every step.
    assert ranks[0]["progress_bar"]["train_loss"] == pytest.approx(ranks[0]["losses"][-1])
    accumulators = [EventAccumulator(str(f)) for f in (tmp_path / "1f1b_False" / "tb").rglob("events.out.tfevents.*")]
    for acc in accumulators:
        acc.Reload()
    training = [acc for acc in accumulators if "train_loss" in acc.Tags()["scalars"]]
    assert len(training) == 1, "only rank 0 writes TensorBoard logs"  # trainer.test adds its own file
    logged = [e.value for e in training[0].Scalars("train_loss")]
    assert logged == pytest.approx(ranks[0]["losses"], rel=1e-6)
    # Both processes destroyed their process groups before the interpreter finalized.
    exits = [f.read_text() for f in tmp_path.glob("exit_*.txt")]
    assert exits == ["initialized=False"] * 2, exits


@pytest.mark.parametrize("width,depth", [(1, 2), (2, 2)])
def test_fit_two_bw_follows_delayed_rule(launched, width: int, depth: int) -> None:
    for recompute in (False, True):
        tag = _tag("2bw", recompute)
        ranks = _ranks(launched, width, depth, tag)
        # Parameters after fit (drained at the end), validation, predict, loss per step and
        # global_step all follow W(t+1) = W(t) - lr * grad f(W(t-1)).
        want = _check_run(ranks, width, depth, step_lr=True, delay=1)
        # StepLR is stepped with each applied update: after step t, t updates were applied.
        assert ranks[0]["lrs"] == pytest.approx([1e-2 * 0.5 ** (t // 2) for t in range(STEPS)])
        assert_close_dicts(dict(_restored(launched, width, depth, tag).named_parameters()), want, rtol=1e-5)


@pytest.mark.parametrize("width,depth", LAYOUTS)
def test_fit_with_split_backward_matches_without(launched, width: int, depth: int) -> None:
    for schedule in ("gpipe", "1f1b", "2bw"):
        plain = _ranks(launched, width, depth, _tag(schedule))
        split = _ranks(launched, width, depth, _tag(schedule, split=True))
        _check_run(split, width, depth, step_lr=schedule == "2bw", delay=int(schedule == "2bw"))
        runs = [split]
        if schedule == "1f1b":  # split only in its drain: against one process and against no split
            drain = _ranks(launched, width, depth, "1f1b_drain")
            _check_run(drain, width, depth)
            assert all(r["plan"].split_backward and r["plan"].split_placement == "drain" for r in drain)
            runs.append(drain)
        for p, s in ((p, s) for run in runs for p, s in zip(plain, run)):
            for name, value in p["params"].items():  # same sums in another order: 1e-6, 1e-8 near 0
                torch.testing.assert_close(s["params"][name], value, rtol=1e-6, atol=1e-8)
            if schedule != "2bw":
                for name, value in p["grads"].items():
                    torch.testing.assert_close(s["grads"][name], value, rtol=1e-6, atol=1e-8)


def test_bf16_mixed_on_cpu(launched) -> None:
    ranks = _ranks(launched, 1, 2, _tag("gpipe", True, precision="bf16-mixed"))
    batch = _global_batches(ranks, 1, 2)[0]
    torch.manual_seed(0)
    model = ToyChain()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = reference_grads(model, batch)
    # bf16 keeps 8 mantissa bits (~3 significant digits) and microbatches round differently
    # from the whole batch, so compare at bf16 resolution rather than float32's 1e-5.
    assert_close_dicts(_merged(ranks, "grads", 2), want, rtol=3e-2, atol=2e-3)
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in ranks)
    assert ranks[0]["losses"][-1] < ranks[0]["losses"][0]
    # 2BW under bf16-mixed: the first step's loss (on W(0)) matches float32 at bf16 resolution,
    # and training makes progress without non-finite values.
    two_bw = _ranks(launched, 1, 2, _tag("2bw", True, precision="bf16-mixed"))
    x, y = _global_batches(two_bw, 1, 2)[0]
    torch.manual_seed(0)
    with torch.no_grad():
        first = float(F.cross_entropy(ToyChain()(x), y))
    assert two_bw[0]["losses"][0] == pytest.approx(first, rel=2e-2)
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in two_bw)
    assert two_bw[0]["losses"][-1] < two_bw[0]["losses"][0]
