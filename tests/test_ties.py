"""Weights tied across stages (a GPT-2-style input embedding reused by the output head): each stage holds a copy."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_pipe import PipelineGroups, PipelinePlan, Topology, place
from tests.models import ToyChain, assert_close_dicts, reference_train
from tests.shared import scenario_per_layout

VOCAB, WIDTH, BATCH, M, STEPS = 11, 8, 16, 4, 5
#: (schedule, split backward, gradient clip)
VARIANTS = [
    ("gpipe", False, None),
    ("gpipe", True, None),
    ("1f1b", False, None),
    ("1f1b", True, None),
    ("2bw", False, None),
    ("2bw", True, None),
    ("1f1b", False, 0.05),
]


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(VOCAB, WIDTH)

    def forward(self, ids: Tensor) -> Tensor:
        return self.table(ids)


class Mix(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, h: Tensor) -> Tensor:
        return h + torch.tanh(self.fc(h))


class Head(nn.Module):
    """Logits through the embedding table: its weight is the embedding's (tied), no annotation."""

    def __init__(self, table: nn.Embedding) -> None:
        super().__init__()
        self.out = nn.Linear(WIDTH, VOCAB, bias=False)
        self.out.weight = table.weight

    def forward(self, h: Tensor) -> Tensor:
        return self.out(h)


class TiedChain(ToyChain):
    """Embedding, two mixing blocks, a head tied to the embedding: the tie spans the first and last stage."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = Embed()  # type: ignore[assignment]
        self.blocks = nn.ModuleList(Mix() for _ in range(2))
        self.head = Head(self.embed.table)  # type: ignore[assignment]
        self.lr = 0.5

    def pipeline_loss(self, output: Tensor, batch: Any) -> Tensor:
        return F.cross_entropy(output.flatten(0, 1), batch[1].flatten())


class SharedChain(TiedChain):
    """Embedding, four mixing blocks where the third reuses the first's layer and the fourth the
    second's, a tied head. Interleaved at d = 2 (stages [embed, mix 0], [mix 1], [mix 2], [mix 3,
    head]) each rank runs both users of one shared layer, and the embedding tie spans the ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Mix() for _ in range(4))
        for user, owner in ((2, 0), (3, 1)):
            self.blocks[user].fc.weight, self.blocks[user].fc.bias = (
                self.blocks[owner].fc.weight,
                self.blocks[owner].fc.bias,
            )
        # at TiedChain's 0.5 the shared layers' doubled gradients amplify rounding (5e-5 after 5 steps, any layout)
        self.lr = 0.1


def _data(step: int, n: int = BATCH) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (n, 5), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


def _worker(rank: int, world: int, depth: int) -> dict:
    topo = Topology(world, depth)
    groups = PipelineGroups.build(topo, rank)
    replica, results = topo.replica_of(rank), {}
    for schedule, split, clip in VARIANTS:
        torch.manual_seed(0)
        model = TiedChain()
        plan = PipelinePlan(topo.width, depth, M, schedule, split, partition=[1] * (depth - 1) + [4 - depth + 1])
        engine = place(model, plan, rank, groups=groups, gradient_clip_val=clip, bucket_bytes=1)
        opt = torch.optim.SGD(engine.parameters(), lr=model.lr, momentum=0.9)
        copies = []
        for step in range(STEPS):
            engine.train_step(tuple(t.chunk(topo.width)[replica] for t in _data(step)), opt)
            copies.append(
                {
                    k: v.clone()
                    for k, v in engine.current_weights().items()
                    if k in ("embed.table.weight", "head.out.weight")
                }
            )
        engine.drain()
        results[(schedule, split, clip)] = {
            "copies": copies,
            "weights": dict(engine.current_weights()),
            "stage": engine.stage_index,
        }
    if depth == 2:
        results["interleaved"] = _interleaved(rank, topo, groups)
        results["v"] = _v_placed(rank, topo, groups)
    return results


def _interleaved(rank: int, topo: Topology, groups: PipelineGroups) -> dict:
    torch.manual_seed(0)
    model = SharedChain()
    plan = PipelinePlan(topo.width, 2, M, "1f1b", partition=[2, 1, 1, 2], virtual_stages=2)
    engine = place(model, plan, rank, groups=groups, bucket_bytes=1)  # buckets count the shared layers' two uses
    opt = torch.optim.SGD(engine.parameters(), lr=model.lr, momentum=0.9)
    for step in range(STEPS):
        engine.train_step(tuple(t.chunk(topo.width)[topo.replica_of(rank)] for t in _data(step)), opt)
    return {"weights": dict(engine.current_weights()), "stage": engine.stage_index}


def _v_placed(rank: int, topo: Topology, groups: PipelineGroups) -> dict:
    torch.manual_seed(0)
    model = TiedChain()
    plan = PipelinePlan(topo.width, 2, M, "zbv", True, partition=[1, 1, 1, 1], virtual_stages=2)
    engine = place(model, plan, rank, groups=groups, bucket_bytes=1)
    opt = torch.optim.SGD(engine.parameters(), lr=model.lr, momentum=0.9)
    for step in range(STEPS):
        engine.train_step(tuple(t.chunk(topo.width)[topo.replica_of(rank)] for t in _data(step)), opt)
    engine.drain()
    return {"weights": dict(engine.current_weights()), "stage": engine.stage_index, "ties": len(engine.stages[0].ties)}


LAYOUTS = [(1, 2), (1, 4), (2, 2)]
scenario_per_layout("ties", _worker, LAYOUTS)


@pytest.mark.parametrize("width,depth", LAYOUTS)
def test_tied_embedding_trains_as_one_process_and_its_copies_stay_equal(launched, width: int, depth: int) -> None:
    ranks = launched(width * depth).ok(f"ties_{width}x{depth}")
    batches = [_data(s) for s in range(STEPS)]
    for variant in VARIANTS:
        schedule, _, clip = variant
        torch.manual_seed(0)
        want = reference_train(TiedChain(), batches, delay=1 if schedule == "2bw" else 0, optimizer="sgd", clip=clip)
        first, last = ranks[0][variant], ranks[depth - 1][variant]
        assert first["stage"] == 0 and last["stage"] == depth - 1
        # The first stage holds the table under its own name, the last under the head's: a copy each.
        assert "embed.table.weight" in first["weights"] and "head.out.weight" in last["weights"]
        for step, (a, b) in enumerate(zip(first["copies"], last["copies"])):
            assert torch.equal(a["embed.table.weight"], b["head.out.weight"]), (variant, step)  # bitwise, every step
        merged: dict = {}
        for rank in ranks[:depth]:
            merged.update({k: v for k, v in rank[variant]["weights"].items() if k != "head.out.weight"})
        assert_close_dicts(merged, want, rtol=1e-5, atol=1e-6)
        for rank in ranks[depth:]:  # replicas agree bit for bit with replica 0's rank of their stage
            twin = ranks[rank[variant]["stage"]][variant]["weights"]
            assert all(torch.equal(v, twin[k]) for k, v in rank[variant]["weights"].items())


@pytest.mark.parametrize("width", [1, 2])
def test_layers_shared_by_two_virtual_stages_of_one_rank_train_as_one_process(launched, width: int) -> None:
    ranks = launched(width * 2).ok(f"ties_{width}x2")
    torch.manual_seed(0)
    want = reference_train(SharedChain(), [_data(s) for s in range(STEPS)], optimizer="sgd")
    merged: dict = {}
    for rank in ranks[:2]:
        merged.update({k: v for k, v in rank["interleaved"]["weights"].items() if k != "head.out.weight"})
    assert_close_dicts(merged, want, rtol=1e-5, atol=1e-6)
    assert (
        "blocks.0.fc.weight" in ranks[0]["interleaved"]["weights"]
        and "blocks.1.fc.weight" in ranks[1]["interleaved"]["weights"]
    )
    assert "blocks.2.fc.weight" not in ranks[0]["interleaved"]["weights"]  # kept once, under its first name
    for rank in ranks[2:]:
        twin = ranks[rank["interleaved"]["stage"]]["interleaved"]["weights"]
        assert all(torch.equal(v, twin[k]) for k, v in rank["interleaved"]["weights"].items())


@pytest.mark.parametrize("width", [1, 2])
def test_tied_embedding_in_a_v_is_one_parameter_of_the_first_rank(launched, width: int) -> None:
    # ZB-V's placement puts the first stage (the embedding) and the last (the head) on rank 0:
    # the tied table is one parameter there, used by two stages, with no copy to keep equal.
    ranks = launched(width * 2).ok(f"ties_{width}x2")
    torch.manual_seed(0)
    want = reference_train(TiedChain(), [_data(s) for s in range(STEPS)], optimizer="sgd")
    first, second = ranks[0]["v"], ranks[1]["v"]
    assert first["ties"] == second["ties"] == 0
    assert "embed.table.weight" in first["weights"] and "head.out.weight" not in first["weights"]
    assert "embed.table.weight" not in second["weights"]
    assert_close_dicts({**first["weights"], **second["weights"]}, want, rtol=1e-5, atol=1e-6)
    for rank in ranks[2:]:
        twin = ranks[rank["v"]["stage"]]["v"]["weights"]
        assert all(torch.equal(v, twin[k]) for k, v in rank["v"]["weights"].items())


# -- through Trainer.fit: a checkpoint keeps one copy, resumes under another layout, loads plainly --------


class Tokens(torch.utils.data.Dataset):
    """(ids, targets, index): the test sees which samples each step read."""

    def __init__(self) -> None:
        self.ids, self.targets = _data(STEPS, BATCH * STEPS)  # a seed no engine-level step uses

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor, int]:
        return self.ids[i], self.targets[i], i


class TiedModule(TiedChain):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def _fit(world: int, depth: int, steps: int, out: Any, resume: Any = None) -> dict:
    import lightning as L

    from lightning_pipe import PipelineStrategy
    from tests.scripts.train_toy import Recorder

    torch.manual_seed(0)
    model, recorder = TiedModule(), Recorder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        max_steps=steps,
        max_epochs=-1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=out, save_last=True), recorder],
        strategy=PipelineStrategy(
            schedule="1f1b",
            pipeline_depth=depth,
            microbatches=M,
            partition=[1, 3] if depth == 2 else [4],
            global_batch_size=BATCH,
        ),
    )
    trainer.fit(model, torch.utils.data.DataLoader(Tokens(), batch_size=BATCH), ckpt_path=resume)
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "indices": recorder.indices}


def _fit_worker(rank: int, world: int) -> dict:
    from tests.shared import scenario_dir

    out = scenario_dir() / "ckpt"
    first = _fit(world, 2, 3, out)  # (1,2): the tie spans both stages
    resumed = _fit(world, 1, STEPS, out, out / "last.ckpt")  # (2,1): one stage holds the table once
    return {"first": first, "resumed": resumed}


from tests.shared import scenario  # noqa: E402

scenario(2, "ties_fit", _fit_worker)


def _fit_switching_worker(rank: int, world: int) -> dict:
    """(1, 4) for 2 steps, then moved to (2, 2) while fitting: the tie spans stages 0 and 3, then 0 and 1."""
    import lightning as L

    from lightning_pipe import PipelineStrategy
    from tests.scripts.train_toy import Recorder
    from tests.test_reconfigure import SwitchAt

    torch.manual_seed(0)
    model, recorder = TiedModule(), Recorder()
    switch = SwitchAt(2, PipelinePlan(2, 2, M, "1f1b", partition=[1, 3]))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        max_steps=STEPS,
        max_epochs=-1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        enable_checkpointing=False,
        callbacks=[recorder, switch],
        strategy=PipelineStrategy(plan=PipelinePlan(1, 4, M, "1f1b", partition=[1, 1, 1, 1]), global_batch_size=BATCH),
    )
    trainer.fit(model, torch.utils.data.DataLoader(Tokens(), batch_size=BATCH))
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "indices": recorder.indices,
        "groups": switch.groups,
        "stage": trainer.strategy.engine.stage_index,
    }


scenario(4, "ties_reconfigure", _fit_switching_worker)


def test_tied_model_moved_to_another_layout_mid_fit_matches_one_process(launched) -> None:
    # The tied copies move by name with the rest of the state, and the old layout's tie groups go
    # with its other groups (none of the groups held before the switch is held after it).
    ranks = launched(4).ok("ties_reconfigure")
    data = Tokens()
    assert all(rank["indices"] == ranks[0]["indices"] for rank in ranks) and len(ranks[0]["indices"]) == STEPS
    batches = [(data.ids[i], data.targets[i]) for i in map(torch.tensor, ranks[0]["indices"])]
    torch.manual_seed(0)
    want = reference_train(TiedModule(), batches, optimizer="sgd")
    merged: dict = {}
    for rank in ranks[:2]:  # replica 0: stages 0 and 1
        merged.update({k: v for k, v in rank["params"].items() if k in want})
    assert_close_dicts(merged, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(ranks[0]["params"]["embed.table.weight"], ranks[1]["params"]["head.out.weight"])
    for rank in ranks:
        before, after, kept = rank["groups"]
        assert before > 0 and after > 0 and kept == 0, rank["groups"]


def test_tied_checkpoint_keeps_one_copy_and_resumes_under_another_layout(launched) -> None:
    from lightning_pipe.lightning.checkpoint import saved_shapes
    from tests.models import load_plain

    ranks = launched(2).ok("ties_fit")
    path = launched(2).dir("ties_fit") / "ckpt" / "last.ckpt"
    names = set(saved_shapes(path))
    assert "embed.table.weight" in names and "head.out.weight" not in names, sorted(names)  # one copy, its first name
    data, run = Tokens(), ranks[0]
    # The global batches: (1,2) read whole ones; at (2,1) each replica read half of each (the union).
    indices = run["first"]["indices"] + [
        a + b for a, b in zip(run["resumed"]["indices"], ranks[1]["resumed"]["indices"])
    ]
    assert len(indices) == STEPS and all(sorted(i) == sorted(set(i)) and len(i) == BATCH for i in indices), indices
    # One epoch of STEPS batches, stopped at max_steps after 3 and resumed at another width: every sample once.
    assert sorted(sum(indices, [])) == list(range(len(data))), indices
    torch.manual_seed(0)
    want = reference_train(
        TiedModule(), [(data.ids[i], data.targets[i]) for i in map(torch.tensor, indices)], optimizer="sgd"
    )
    merged = {**ranks[1]["resumed"]["params"], **ranks[0]["resumed"]["params"]}
    assert_close_dicts({k: merged[k] for k in want}, want, rtol=1e-5, atol=1e-6)  # 3 steps at (1,2), 2 more at (2,1)
    plain = load_plain(TiedModule, path)  # a plain load_state_dict wants both names: the mixin gives them
    assert plain.head.out.weight is plain.embed.table.weight
    assert_close_dicts(dict(plain.named_parameters()), want, rtol=1e-5, atol=1e-6)


def _fit_layout_worker(rank: int, world: int, depth: int) -> dict:
    """Every schedule, with and without split, through Trainer.fit at this layout (5 steps, SGD)."""
    import lightning as L

    from lightning_pipe import PipelineStrategy
    from tests.scripts.train_toy import Recorder

    results = {}
    for schedule, split, _ in VARIANTS[:-1]:
        torch.manual_seed(0)
        model, recorder = TiedModule(), Recorder()
        trainer = L.Trainer(
            accelerator="cpu",
            devices=world,
            max_steps=STEPS,
            max_epochs=-1,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            enable_checkpointing=False,
            callbacks=[recorder],
            strategy=PipelineStrategy(
                schedule=schedule,
                pipeline_depth=depth,
                microbatches=M,
                split_backward=split,
                partition=[1] * (depth - 1) + [5 - depth],
                global_batch_size=BATCH,
            ),
        )
        trainer.fit(model, torch.utils.data.DataLoader(Tokens(), batch_size=BATCH))
        results[(schedule, split)] = {
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "indices": recorder.indices,
            "stage": trainer.strategy.engine.stage_index,
        }
    return results


scenario_per_layout("ties_trainer", _fit_layout_worker, LAYOUTS)


@pytest.mark.parametrize("width,depth", LAYOUTS)
def test_tied_embedding_through_trainer_fit_matches_one_process(launched, width: int, depth: int) -> None:
    ranks = launched(width * depth).ok(f"ties_trainer_{width}x{depth}")
    data = Tokens()
    for schedule, split, _ in VARIANTS[:-1]:
        runs = [rank[(schedule, split)] for rank in ranks]
        # Replica r's ranks are r * depth .. (r + 1) * depth - 1; a global batch is the union of the replicas'.
        indices = [sum((runs[r * depth]["indices"][t] for r in range(width)), []) for t in range(STEPS)]
        assert all(len(set(i)) == BATCH for i in indices), indices
        torch.manual_seed(0)
        batches = [(data.ids[i], data.targets[i]) for i in map(torch.tensor, indices)]
        want = reference_train(TiedModule(), batches, delay=1 if schedule == "2bw" else 0, optimizer="sgd")
        merged: dict = {}
        for run in runs[:depth]:
            merged.update({k: v for k, v in run["params"].items() if k in want})
        assert_close_dicts(merged, want, rtol=1e-5, atol=1e-6)
        first, last = runs[0]["params"], runs[depth - 1]["params"]
        assert torch.equal(first["embed.table.weight"], last["head.out.weight"]), (schedule, split)  # the copies


def test_placement_records_which_blocks_share_weights_before_untying_them() -> None:
    # The AutoPlanner's in-job profile reads this (for 2BW's first stage): placing a layout
    # unties the remote copies, so the groups must come from the whole module.
    from lightning_pipe.runtime.placement import Placement

    placement = Placement(TiedChain())
    assert placement.shared_blocks == [[0, 3]]  # the embedding and the head
    placement.apply(PipelinePlan(1, 2, 2, "1f1b", partition=[2, 2]), 0)
    assert placement.shared_blocks == [[0, 3]]
    assert Placement(ToyChain()).shared_blocks == []


# -- tied copies edited in place: caught at the next drain or checkpoint save, on every rank --------------------

DIVERGED_LAYOUTS = [(1, 2), (2, 2)]


def _edit_head_copy(model: TiedChain, engine: Any, replica: int) -> None:
    """What a manual clamp or weight normalisation on one stage does: change one copy in place
    (the last stage's, under the head's name), on replica 0 only."""
    if engine.stage_index == engine.topology.depth - 1 and replica == 0:
        with torch.no_grad():
            model.head.out.weight.mul_(1.1)


def _outcome(call: Any) -> Any:
    """``None`` if ``call()`` returns, else the error's type name and message."""
    from lightning_pipe import TiedCopiesDivergedError

    try:
        call()
    except TiedCopiesDivergedError as err:
        return type(err).__name__, str(err)
    return None


def _diverged_worker(rank: int, world: int, depth: int) -> dict:
    topo = Topology(world, depth)
    groups = PipelineGroups.build(topo, rank)
    replica, results = topo.replica_of(rank), {}
    for schedule in ("1f1b", "2bw"):
        torch.manual_seed(0)
        model = TiedChain()
        plan = PipelinePlan(topo.width, depth, M, schedule, partition=[1, 3])
        engine = place(model, plan, rank, groups=groups)
        opt = torch.optim.SGD(engine.parameters(), lr=model.lr)
        batch = lambda step: tuple(t.chunk(topo.width)[replica] for t in _data(step))  # noqa: E731
        engine.train_step(batch(0), opt)
        clean = _outcome(engine.drain)  # the unedited copies pass
        _edit_head_copy(model, engine, replica)
        no_step = _outcome(engine.drain)  # no training step since the last comparison: not compared again
        save = _outcome(lambda: engine.drain(check_ties=True))  # before a checkpoint save: compared
        engine.train_step(batch(1), opt)
        after_step = _outcome(engine.drain)
        results[schedule] = {"clean": clean, "no_step": no_step, "save": save, "after_step": after_step}
        engine.close()
    return results


scenario_per_layout("ties_diverged", _diverged_worker, DIVERGED_LAYOUTS)


@pytest.mark.parametrize("width,depth", DIVERGED_LAYOUTS)
def test_a_tied_copy_edited_in_place_is_caught_on_every_rank(launched, width: int, depth: int) -> None:
    ranks = launched(width * depth).ok(f"ties_diverged_{width}x{depth}")
    for schedule in ("1f1b", "2bw"):
        runs = [rank[schedule] for rank in ranks]
        assert all(run["clean"] is None and run["no_step"] is None for run in runs), runs
        for when in ("save", "after_step"):
            errors = [run[when] for run in runs]
            assert all(e is not None and e == errors[0] for e in errors), (schedule, when, errors)  # every rank
            kind, message = errors[0]
            assert kind == "TiedCopiesDivergedError"
            assert "'embed.table.weight' on pipeline stages 0, 1 (replica 0) differ" in message, message
            assert "replica 1" not in message  # its copies were not edited
            assert "only through the optimizer" in message and "untie them" in message, message


def _fit_edited_worker(rank: int, world: int) -> Any:
    """Trainer.fit at (1, 2) with a callback that scales the head's copy of the tied table in
    place after step 2, just before ModelCheckpoint saves: the save raises on every rank."""
    import lightning as L

    from lightning_pipe import PipelineStrategy
    from tests.shared import scenario_dir

    class Edit(L.Callback):
        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == 1 and trainer.strategy.engine.stage_index == 1:
                _edit_head_copy(module, trainer.strategy.engine, 0)

    torch.manual_seed(0)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        max_steps=STEPS,
        max_epochs=-1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[Edit(), L.pytorch.callbacks.ModelCheckpoint(dirpath=scenario_dir() / "ckpt", every_n_train_steps=2)],
        strategy=PipelineStrategy(schedule="1f1b", pipeline_depth=2, microbatches=M, partition=[1, 3]),
    )
    try:
        trainer.fit(TiedModule(), torch.utils.data.DataLoader(Tokens(), batch_size=BATCH))
    except Exception as err:  # noqa: BLE001 - the test reads what each rank raised
        return type(err).__name__, str(err), trainer.global_step
    return None


scenario(2, "ties_fit_edited", _fit_edited_worker)


def test_fit_refuses_to_save_a_checkpoint_of_diverged_tied_copies(launched) -> None:
    ranks = launched(2).ok("ties_fit_edited")
    assert all(r is not None and r[0] == "TiedCopiesDivergedError" for r in ranks), ranks
    assert all(r[2] == 2 for r in ranks), ranks  # at the save after step 2, on both ranks
    assert "'embed.table.weight' on pipeline stages 0, 1" in ranks[0][1]
    saved = [p.name for p in (launched(2).dir("ties_fit_edited") / "ckpt").glob("*.ckpt")]
    assert not saved, saved  # no checkpoint of the diverged model was written
