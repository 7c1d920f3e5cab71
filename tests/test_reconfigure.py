"""Reconfiguring a running fit in place (PipelineStrategy.reconfigure) on 4 processes, against a
single-process reference on the same global batches."""

from __future__ import annotations

import dataclasses
import re
from datetime import timedelta
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.data import DataLoader

from lightning_pipe import PipelinePlan, PipelineStrategy
from tests.models import HIDDEN, ToyChain, assert_close_dicts, load_plain, reference_train
from tests.scripts.train_toy import Indexed, Recorder, WithScheduler
from tests.shared import live_groups, profile_on_rank_0, scenario, scenario_dir

GLOBAL, SWITCH, STEPS = 16, 2, 5  # the switch after step 2, then 3 more steps
START = PipelinePlan(1, 4, 4, "1f1b", partition="uniform")
#: Where the AutoPlanner tests start: every stage recomputes with no memory budget, so the same plan
#: without recomputation (a candidate: the running partition always is) is predicted strictly
#: faster whatever the machine measures. Noise alone once made the planner rightly keep (1, 4) m=4,
#: and once keep (1, 4) m=1 when its own partition was not a candidate.
POOR_START = PipelinePlan(1, 4, 1, "1f1b", partition="uniform", recompute=(True,) * 4)
TARGETS = {
    "1f1b": PipelinePlan(2, 2, 8, "1f1b", partition="uniform", recompute=(True, False)),
    "2bw": PipelinePlan(2, 2, 8, "2bw", partition="uniform"),
    "interleaved": PipelinePlan(2, 2, 8, "1f1b", partition="uniform", virtual_stages=2),
    "zbv": PipelinePlan(2, 2, 8, "zbv", True, partition="uniform", virtual_stages=2),
    "v_2bw": PipelinePlan(2, 2, 8, "2bw", True, partition="uniform", virtual_stages=2, placement="v"),
}
#: Each target's partition of ToyChain's 6 blocks, resolved.
RESOLVED = {"1f1b": (3, 3), "2bw": (3, 3), "interleaved": (2, 2, 1, 1), "zbv": (2, 2, 1, 1), "v_2bw": (2, 2, 1, 1)}


class SwitchAt(L.Callback):
    """Lets the strategy reconfigure (global batches), and moves the job to ``plan`` after step ``step``."""

    def __init__(self, step: int, plan: PipelinePlan) -> None:
        self.step, self.plan = step, plan
        self.plans: list[PipelinePlan] = []
        self.groups = (0, 0, 0)  # groups held before the switch, after it, and both

    def setup(self, trainer: L.Trainer, pl_module: Any, stage: str) -> None:
        trainer.strategy.enable_reconfiguration()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            before = live_groups()
            trainer.strategy.reconfigure(self.plan)
            self.groups = (len(before), len(live_groups()), len(before & live_groups()))
        self.plans.append(trainer.strategy.plan)


def _trainer(**settings: Any) -> L.Trainer:
    """A CPU Trainer without sanity checks, validation, progress bar, summary, logger or
    checkpoints (``settings`` add to or override these)."""
    quiet = dict(
        accelerator="cpu",
        max_epochs=-1,
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        enable_checkpointing=False,
    )
    return L.Trainer(**{**quiet, **settings})


def _fit_switching(rank: int, world: int, target: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = WithScheduler() if target == "1f1b" else ToyChain()
    recorder, switch = Recorder(), SwitchAt(SWITCH, TARGETS[target])
    out = scenario_dir()
    trainer = _trainer(
        devices=world,
        max_steps=STEPS,
        callbacks=[recorder, switch, L.pytorch.callbacks.ModelCheckpoint(dirpath=out / "ckpt", save_last=True)],
        strategy=PipelineStrategy(plan=START, global_batch_size=GLOBAL, timeout=timedelta(seconds=60)),
        enable_checkpointing=True,
    )
    trainer.fit(model, DataLoader(Indexed(GLOBAL * STEPS, 0), batch_size=GLOBAL))
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "indices": recorder.indices,
        "lrs": recorder.lrs,
        "plans": switch.plans,
        "groups": switch.groups,
        "global_step": trainer.global_step,
        "stage": trainer.strategy.engine.stage_index,
    }


for _target in TARGETS:
    scenario(4, f"reconfigure_{_target}", _fit_switching, _target)


#: DDP to FSDP, FSDP to FSDP under another (w, d) and ZeRO stage, FSDP to DDP: the plan after each step.
FSDP_SWITCHES = {
    1: PipelinePlan(2, 2, 4, "1f1b", partition="uniform", data_parallel="fsdp"),
    2: PipelinePlan(4, 1, 2, "gpipe", data_parallel="fsdp", reshard_after_forward=False),
    3: PipelinePlan(2, 2, 4, "1f1b", partition="uniform"),
}
FSDP_STEPS = 5


class SwitchEach(L.Callback):
    """Lets the strategy reconfigure, and moves the job to ``plans[step]`` after each listed step;
    records the plan each step ran on and whether its blocks were FSDP-wrapped."""

    def __init__(self, plans: dict[int, PipelinePlan]) -> None:
        self.todo = plans
        self.plans: list[PipelinePlan] = []
        self.sharded: list[bool] = []

    def setup(self, trainer: L.Trainer, pl_module: Any, stage: str) -> None:
        trainer.strategy.enable_reconfiguration()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.plans.append(trainer.strategy.plan)
        self.sharded.append(trainer.strategy.placement.sharded)
        if trainer.global_step in self.todo:
            trainer.strategy.reconfigure(self.todo[trainer.global_step])


def _fit_switching_fsdp(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    model, recorder, switch = ToyChain(), Recorder(), SwitchEach(FSDP_SWITCHES)
    trainer = _trainer(
        devices=world,
        max_steps=FSDP_STEPS,
        callbacks=[recorder, switch],
        strategy=PipelineStrategy(plan=START, global_batch_size=GLOBAL, timeout=timedelta(seconds=60)),
    )
    trainer.fit(model, DataLoader(Indexed(GLOBAL * FSDP_STEPS, 0), batch_size=GLOBAL))
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "dtensors": [n for n, p in model.named_parameters() if isinstance(p, DTensor)],
        "indices": recorder.indices,
        "plans": [(p.width, p.depth, p.data_parallel, p.reshard_after_forward) for p in switch.plans],
        "sharded": switch.sharded,
    }


scenario(4, "reconfigure_fsdp", _fit_switching_fsdp)


def test_switch_between_ddp_and_fsdp_replicas_matches_single_process(launched) -> None:
    # (1, 4) DDP, then (2, 2) FSDP ZeRO-3, (4, 1) FSDP ZeRO-2 and (2, 2) DDP: each switch gathers the
    # stage's shards of weights and Adam state, moves them and shards them again where the new plan does.
    ranks = launched(4).ok("reconfigure_fsdp")
    for rank in ranks:
        assert rank["plans"] == [(1, 4, "ddp", True), (2, 2, "fsdp", True), (4, 1, "fsdp", False)] + [
            (2, 2, "ddp", True)
        ] * (FSDP_STEPS - 3)
        assert rank["sharded"] == [False, True, True] + [False] * (FSDP_STEPS - 3)
        assert rank["dtensors"] == [] and rank["indices"] == ranks[0]["indices"]
    merged: dict[str, torch.Tensor] = {}
    for rank in ranks:
        for name, value in rank["params"].items():
            if name in merged:  # DDP replicas of a stage hold the same weights
                torch.testing.assert_close(value, merged[name], rtol=0, atol=0)
            merged[name] = value
    torch.manual_seed(0)
    want = reference_train(ToyChain(), _batches(ranks[0]["indices"], FSDP_STEPS))
    assert_close_dicts(merged, want, rtol=1e-5)


def _fit_one_step(model: Any, plan: PipelinePlan, world: int) -> int:
    trainer = _trainer(
        devices=world,
        max_steps=1,
        strategy=PipelineStrategy(plan=plan, timeout=timedelta(seconds=60)),
    )
    trainer.fit(model, DataLoader(Indexed(GLOBAL, 0), batch_size=GLOBAL // plan.width))
    return len(live_groups())


def _fit_again(rank: int, world: int) -> dict[str, Any]:
    from lightning_pipe.runtime.comm.groups import destroy_groups

    wide, deep = PipelinePlan(2, 2, 4, "1f1b", partition="uniform"), PipelinePlan(1, 4, 4, "1f1b", partition="uniform")
    fresh = _fit_one_step(ToyChain(), deep, world)  # what one (1, 4) fit holds
    destroy_groups(live_groups())
    model = ToyChain()
    held = [_fit_one_step(model, plan, world) for plan in (wide, wide)]
    try:  # another layout on the placed model, without a checkpoint: refused on every rank at once
        _fit_one_step(model, deep, world)
        refused = ""
    except RuntimeError as err:
        refused = str(err)
    return {"fresh_deep": fresh, "held": held + [len(live_groups())], "refused": refused}


scenario(4, "fit_again_same_module", _fit_again)


def test_later_trainers_on_one_module_hold_one_layouts_groups(launched) -> None:
    # A second Trainer on the same layout keeps the placed engine and its groups (not another set
    # beside them); a third on another layout drops the earlier layout's groups, and without a
    # checkpoint for the blocks that moved every rank refuses to train (none waits for the others).
    ranks = launched(4).ok("fit_again_same_module")
    for rank in ranks:
        first, again, other = rank["held"]
        assert first > 0 and again == first and other == rank["fresh_deep"] > 0, rank
    # "Refused at once": every rank raised the refusal after one collective count of the blocks
    # missing anywhere (a rank left waiting would end with a timeout instead). The (2, 2) layout
    # held blocks 0-2 on ranks 0 and 2, 3-5 on ranks 1 and 3; the (1, 4) one wants 0-1, 2-3, 4, 5:
    # rank 1 lacks block 2, rank 2 block 4. Each rank names its own, and all the same total.
    refusals = [
        re.fullmatch(
            r"(\d+) pipeline block\(s\) moved to ranks without their weights \(here: \[([\d, ]*)\]\); .*",
            rank["refused"],
        )
        for rank in ranks
    ]
    assert all(refusals), [rank["refused"] for rank in ranks]
    assert [int(m.group(1)) for m in refusals] == [2] * 4, [rank["refused"] for rank in ranks]  # type: ignore[union-attr]
    assert [m.group(2) for m in refusals] == ["", "2", "4", ""], [rank["refused"] for rank in ranks]  # type: ignore[union-attr]


def _batches(indices: list[list[int]], steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = Indexed(GLOBAL * steps, 0)
    return [(data.x[torch.tensor(i)], data.y[torch.tensor(i)]) for i in indices]


def _check_layout_and_steps(ranks: list[dict[str, Any]], target: str) -> dict[str, torch.Tensor]:
    """Every rank ran the start plan, then the target; the global batches agree; replicas agree; merged params."""
    start, after = START.replace(partition=(2, 2, 1, 1)), TARGETS[target].replace(partition=RESOLVED[target])
    for rank in ranks:  # the plan in use after each step
        assert rank["plans"] == [start] * (SWITCH - 1) + [after] * (STEPS - SWITCH + 1)
        assert rank["global_step"] == STEPS
        assert rank["indices"] == ranks[0]["indices"] and all(len(i) == GLOBAL for i in rank["indices"])
        held_before, held_after, kept = rank["groups"]  # the old layout's groups destroyed, the new layout's built
        assert held_before > 0 and held_after > 0 and kept == 0, rank["groups"]
    merged: dict[str, torch.Tensor] = {}
    for rank in ranks:
        for name, value in rank["params"].items():
            if name in merged:  # replicas of a stage hold the same weights
                torch.testing.assert_close(value, merged[name], rtol=0, atol=0)
            merged[name] = value
    return merged


def test_switch_from_1x4_to_2x2_with_recompute_matches_single_process(launched) -> None:
    ranks = launched(4).ok("reconfigure_1f1b")
    got = _check_layout_and_steps(ranks, "1f1b")
    torch.manual_seed(0)
    want = reference_train(ToyChain(), _batches(ranks[0]["indices"]), step_lr=True)
    assert_close_dicts(got, want, rtol=1e-5)
    # The LR schedule went on across the switch: StepLR(step_size=2, gamma=0.5) after each step.
    assert ranks[0]["lrs"] == [1e-2 * 0.5 ** ((t + 1) // 2) for t in range(STEPS)]
    # ModelCheckpoint went on too: the last checkpoint, saved under the new layout, holds the weights.
    restored = load_plain(ToyChain, launched(4).dir("reconfigure_1f1b") / "ckpt" / "last.ckpt")
    assert_close_dicts(dict(restored.named_parameters()), want, rtol=1e-5)


def test_switch_to_interleaved_matches_single_process(launched) -> None:
    # The state moves by name to the rank that runs each block's stage (stage s on rank s % d).
    ranks = launched(4).ok("reconfigure_interleaved")
    got = _check_layout_and_steps(ranks, "interleaved")
    torch.manual_seed(0)
    assert_close_dicts(got, reference_train(ToyChain(), _batches(ranks[0]["indices"])), rtol=1e-5)
    restored = load_plain(ToyChain, launched(4).dir("reconfigure_interleaved") / "ckpt" / "last.ckpt")
    assert_close_dicts(dict(restored.named_parameters()), got, rtol=1e-5)


def test_switch_to_zbv_moves_blocks_to_the_v_and_matches_single_process(launched) -> None:
    # Under the V placement stage s runs on rank s for s < d, else on rank 2d - 1 - s: the last
    # stage's block (the head) moves to the first rank of each pipeline.
    ranks = launched(4).ok("reconfigure_zbv")
    got = _check_layout_and_steps(ranks, "zbv")
    assert {n.split(".")[0] for n in ranks[0]["params"]} == {"embed", "blocks", "head"}
    assert "head.out.weight" in ranks[2]["params"] and "head.out.weight" not in ranks[1]["params"]
    torch.manual_seed(0)
    assert_close_dicts(got, reference_train(ToyChain(), _batches(ranks[0]["indices"])), rtol=1e-5)
    restored = load_plain(ToyChain, launched(4).dir("reconfigure_zbv") / "ckpt" / "last.ckpt")
    assert_close_dicts(dict(restored.named_parameters()), got, rtol=1e-5)


@pytest.mark.parametrize("target", ["2bw", "v_2bw"])
def test_switch_to_2bw_follows_the_2bw_rule_from_the_switch(launched, target: str) -> None:
    # One stage per rank, and 2BW in a V with split backward (rank r holds stages r and 2d - 1 - r).
    ranks = launched(4).ok(f"reconfigure_{target}")
    got = _check_layout_and_steps(ranks, target)
    batches = _batches(ranks[0]["indices"])
    torch.manual_seed(0)
    model = ToyChain()
    opt = torch.optim.Adam(model.parameters(), lr=model.lr)
    reference_train(model, batches[:SWITCH], opt=opt)  # flushed 1F1B steps
    # The stream starts at the switch: batch t runs on W(max(t - 1, SWITCH)) (PipeDream-2BW paper, section 3.1).
    want = reference_train(model, batches[SWITCH:], delay=1, opt=opt)
    assert_close_dicts(got, want, rtol=1e-5)


def _fit_auto(rank: int, world: int, memory: Any) -> dict[str, Any]:
    from lightning_pipe import AutoPlanner

    torch.manual_seed(0)
    # revert_factor=None: a toy step can double with one hiccup of a shared host, and a revert
    # restarts the re-check clock (test_errors checks the revert with the clock patched).
    auto = AutoPlanner(memory=memory, profile_steps=3, min_gain=0.0, recheck_every_n_steps=1, revert_factor=None)
    model, recorder = ToyChain(), Recorder()
    trainer = _trainer(
        devices=world,
        max_steps=STEPS + 2,
        callbacks=[recorder, auto],
        logger=L.pytorch.loggers.TensorBoardLogger(scenario_dir() / "tb", name="run"),
        strategy=PipelineStrategy(plan=POOR_START, global_batch_size=GLOBAL, timeout=timedelta(seconds=60)),
    )
    try:
        trainer.fit(model, DataLoader(Indexed(GLOBAL * (STEPS + 2), 0), batch_size=GLOBAL))
    except RuntimeError as err:
        return {"error": str(err), "steps": trainer.global_step}
    decision = auto.decisions[0]
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "indices": recorder.indices,
        "plan": trainer.strategy.plan,
        "decided_at": [d["step"] for d in auto.decisions],
        "last_chosen": auto.decisions[-1]["chosen"].plan,
        "decision": {
            k: decision[k]
            for k in (
                "step",
                "reason",
                "table",
                "switch_seconds",
                "measured_step_s",
                "current_measured_step_s",
                "calibrated_step_s",
            )
        },
        "predicted": (decision["current"].step_time, decision["chosen"].step_time),
        "shared_blocks": [d["profile"].shared_blocks for d in auto.decisions],
        "chosen": decision["chosen"].plan,
        "current": decision["current"].plan,
        "feasible": decision["chosen"].feasible,
    }


def _fit_misused(rank: int, world: int) -> str:
    """An AutoPlanner misuse, refused at setup: a fit shorter than its profiling."""
    from lightning_pipe import AutoPlanner

    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        callbacks=[AutoPlanner(profile_steps=5)],
        strategy=PipelineStrategy(pipeline_depth=2, microbatches=2, global_batch_size=GLOBAL),
    )
    try:
        trainer.fit(ToyChain(), DataLoader(Indexed(GLOBAL * 4, 0), batch_size=GLOBAL))
    except ValueError as err:
        return str(err)
    return f"no error; trained {trainer.global_step} steps"


scenario(2, "autoplan_misused", _fit_misused)


def test_autoplanner_refuses_a_short_fit(launched) -> None:
    for short in launched(2).ok("autoplan_misused"):
        assert (
            "AutoPlanner(profile_steps=5) profiles that many training steps before deciding, but "
            "Trainer(max_steps=...) allows only 2"
        ) in short, short


INTERLEAVED_START = PipelinePlan(1, 2, 4, "1f1b", partition="uniform", virtual_stages=2)


def _fit_auto_interleaved(rank: int, world: int) -> dict[str, Any]:
    from lightning_pipe import AutoPlanner

    torch.manual_seed(0)
    auto = AutoPlanner(  # revert_factor=None: as _fit_auto, the re-check must not depend on the clock
        profile_steps=3, min_gain=0.0, recheck_every_n_steps=1, virtual_stages=(2,), revert_factor=None
    )
    model, recorder = ToyChain(), Recorder()
    trainer = _trainer(
        devices=world,
        max_steps=STEPS + 2,
        callbacks=[recorder, auto],
        strategy=PipelineStrategy(plan=INTERLEAVED_START, global_batch_size=GLOBAL, timeout=timedelta(seconds=60)),
    )
    trainer.fit(model, DataLoader(Indexed(GLOBAL * (STEPS + 2), 0), batch_size=GLOBAL))
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "indices": recorder.indices,
        "decided_at": [d["step"] for d in auto.decisions],
        "current": [d["current"] for d in auto.decisions],
        "chosen": [d["chosen"].plan for d in auto.decisions],
        "plan": trainer.strategy.plan,
    }


scenario(2, "autoplan_interleaved", _fit_auto_interleaved)


def _assert_matches_one_process(ranks: list[dict[str, Any]]) -> None:
    """Every rank's parameters, merged, against one process trained on the same global batches."""
    merged: dict[str, torch.Tensor] = {}
    for rank in ranks:
        merged.update(rank["params"])
    torch.manual_seed(0)
    want = reference_train(ToyChain(), _batches(ranks[0]["indices"], STEPS + 2))
    assert_close_dicts(merged, want, rtol=1e-5)


def test_autoplanner_profiles_an_interleaved_start_and_matches_single_process(launched) -> None:
    # Each rank profiles both its stages; the search (told to offer interleaved plans only) sees
    # all four stages' blocks, predicts the running plan per rank, and training stays exact.
    ranks = launched(2).ok("autoplan_interleaved")
    for rank in ranks:
        assert rank["decided_at"] == [3, 7]
        first = rank["current"][0]
        assert first.plan == INTERLEAVED_START.replace(partition=(2, 2, 1, 1)) and len(first.stage_memory) == 2
        assert first.step_time > 0 and all(m > 0 for m in first.stage_memory)
        assert rank["plan"] == ranks[0]["plan"]
        assert all(
            p.virtual_stages == 2 for p in rank["chosen"]
        )  # AutoPlanner(virtual_stages=(2,)): only interleaved plans
    _assert_matches_one_process(ranks)


scenario(4, "autoplan_fit", _fit_auto, None)
scenario(4, "autoplan_no_plan_fits", _fit_auto, 1)  # 0.85 bytes after the headroom


def test_autoplanner_profiles_plans_switches_and_matches_single_process(launched) -> None:
    ranks = launched(4).ok("autoplan_fit")
    for rank in ranks:
        assert rank["decision"]["step"] == 3  # after the 3 profiled steps
        assert rank["current"] == POOR_START.replace(partition=(2, 2, 1, 1))
        # Re-checked one step after the decision: profiled again for 3 steps, decided again at step 7.
        assert rank["decided_at"] == [3, 7]
        assert rank["plan"] == rank["last_chosen"] == ranks[0]["last_chosen"]  # every rank runs the plan it decided on
        assert rank["decision"]["table"] == ranks[0]["decision"]["table"]
    assert ranks[0]["chosen"] != ranks[0]["current"], ranks[0]["decision"]  # min_gain=0: a faster plan exists
    assert ranks[0]["shared_blocks"] == [[], []]  # known: no ties (unknown would count 2BW's stage 0 as tied)
    assert ranks[0]["decision"]["switch_seconds"] > 0 and ranks[0]["decision"]["measured_step_s"] > 0
    # Both plans predicted and measured: the running plan's measured step calibrates the chosen one's prediction.
    current_predicted, chosen_predicted = ranks[0]["predicted"]
    measured_before = ranks[0]["decision"]["current_measured_step_s"]
    assert measured_before > 0
    assert ranks[0]["decision"]["calibrated_step_s"] == pytest.approx(
        chosen_predicted * measured_before / current_predicted
    )
    assert "current" in ranks[0]["decision"]["table"] and "candidates" in ranks[0]["decision"]["table"]
    # Whatever it chose (no stale schedule without allow_stale), training is exact.
    _assert_matches_one_process(ranks)


def test_autoplanner_budget_no_plan_meets_is_a_clear_error_before_any_step(launched) -> None:
    ranks = launched(4).ok("autoplan_no_plan_fits")
    for rank in ranks:
        assert "no plan fits the memory budget of 0 B per device (after 15% headroom)" in rank["error"], rank
        assert "smallest predicted peak is" in rank["error"]
        assert rank["steps"] == 0


# -- memory: a starting plan over the budget is left before its first step ------------------------

WIDE, WIDE_BATCH = 2048, 64


class Keep(torch.nn.Module):
    """``tanh(x * w)``: keeps two activations of ``WIDE`` floats per sample for its backward, few weights."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(WIDE) + 0.01 * torch.randn(WIDE))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * self.w)


class WideChain(ToyChain):
    """8 :class:`Keep` blocks: activations, not weights, fill memory."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = None, None  # type: ignore[assignment]
        self.blocks = torch.nn.ModuleList(Keep() for _ in range(8))

    def pipeline_blocks(self) -> list[torch.nn.Module]:
        return list(self.blocks)

    def pipeline_inputs(self, batch: Any) -> torch.Tensor:
        return batch[0]

    def pipeline_loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        return output.pow(2).mean()


class Dense(torch.nn.Module):
    """``x + tanh(up(tanh(down(x))))``: linear layers, so split backward defers their weight gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.down, self.up = torch.nn.Linear(WIDE, 64), torch.nn.Linear(64, WIDE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.up(torch.tanh(self.down(x))))


class DenseChain(WideChain):
    """8 :class:`Dense` blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Dense() for _ in range(8))


class ConvDense(torch.nn.Module):
    """:class:`Dense` with 1-D convolutions over 16 channels: split backward defers their weight gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.down, self.up = torch.nn.Conv1d(16, 4, 5, padding=2), torch.nn.Conv1d(4, 16, 5, padding=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.up(torch.tanh(self.down(x.view(x.shape[0], 16, WIDE // 16))))
        return x + torch.tanh(y).flatten(1)


class ConvDenseChain(WideChain):
    """8 :class:`ConvDense` blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(ConvDense() for _ in range(8))


class Wide(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return WIDE_BATCH * 8

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        with _disable_current_modes():  # the data loader's host-side work is not the job's device memory
            return torch.randn(WIDE, generator=torch.Generator().manual_seed(i)), i


def _collate(items: list[Any]) -> Any:
    with _disable_current_modes():
        return torch.utils.data.default_collate(items)


class StepPeaks:
    """Test-side tracker of each training step's peak tensor bytes on this rank (tests/test_planner.py's
    _TrackedBytes: every storage created during the step, plus weights, gradients, optimizer state
    and the batch), independent of the planner. ``opener`` enters at a batch's start and ``closer``
    leaves at its end: list them around the AutoPlanner, ``[closer, auto, opener]``, to measure the
    steps and not the planner's own work between them. What the last step's tracker saw counts too
    while it stays alive (a 2BW stream's microbatches in flight and their batch), held here by weak
    reference."""

    def __init__(self) -> None:
        self.peaks: list[int] = []
        self._tracker: Any = None
        self._last: list[Any] = []  # weak references to the storages the last step's tracker saw
        peaks = self

        class Opener(L.Callback):
            def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
                peaks._open(trainer, pl_module, batch)

        class Closer(L.Callback):
            def on_train_batch_end(
                self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
            ) -> None:
                peaks._tracker.__exit__(None, None, None)
                peaks.peaks.append(peaks._tracker.peak)

        self.opener, self.closer = Opener(), Closer()

    def _open(self, trainer: L.Trainer, pl_module: Any, batch: Any) -> None:
        from lightning_pipe.lightning.monitor import held_tensors
        from tests.test_planner import _TrackedBytes

        held = held_tensors(list(pl_module.parameters()), trainer.optimizers)
        tensors = [t for t in batch if isinstance(t, torch.Tensor)]
        alive = [torch.empty(0, dtype=torch.uint8).set_(s) for s in (ref() for ref in self._last) if s is not None]
        self._tracker = _TrackedBytes(held + tensors + alive)
        self._tracker.__enter__()
        self._last = self._tracker.refs


class JobPeak(L.Callback):
    """Test-side tracker of the whole fit's peak tensor bytes on this rank (tests/test_planner.py's
    _TrackedBytes), from the start of fit to its end: every step and everything between them (the
    AutoPlanner's check before the first step, profiling, link measurement, the switch). The data
    loader's samples, collation and prefetched batch are left out (:class:`Wide`): on an
    accelerator they live in host memory; the batch counts from its first use in the job."""

    def __init__(self) -> None:
        self.peak, self._tracker = 0, None

    def on_fit_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        from lightning_pipe.lightning.monitor import held_tensors
        from tests.test_planner import _TrackedBytes

        self._tracker = _TrackedBytes(held_tensors(list(pl_module.parameters()), trainer.optimizers))
        self._tracker.__enter__()

    def on_fit_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        self._tracker.__exit__(None, None, None)
        self.peak = self._tracker.peak

    def on_exception(self, trainer: L.Trainer, pl_module: Any, exception: BaseException) -> None:
        # a fit that fails leaves no tracker on the dispatch stack for the scenarios after it
        if self._tracker is not None:
            self._tracker.__exit__(None, None, None)


def _fit_wide(plan: PipelinePlan, steps: int, callbacks: list[Any], model: type = WideChain) -> L.Trainer:
    torch.manual_seed(0)
    trainer = _trainer(
        devices=4,
        max_steps=steps,
        callbacks=callbacks,
        strategy=PipelineStrategy(plan=plan, global_batch_size=WIDE_BATCH, timeout=timedelta(seconds=60)),
    )
    trainer.fit(model(), DataLoader(Wide(), batch_size=WIDE_BATCH, collate_fn=_collate))
    return trainer


WIDE_START = PipelinePlan(1, 4, 16, "gpipe", partition="uniform")


def _fit_over_budget(rank: int, world: int) -> dict[str, Any]:
    from lightning_pipe import AutoPlanner

    plain = StepPeaks()
    _fit_wide(WIDE_START, 2, [plain.closer, plain.opener])
    peak = torch.tensor(float(max(plain.peaks)))
    torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
    budget = 0.6 * float(peak)  # the starting plan measured above it
    # DDP replicas only: the tracker counts storages FSDP frees by resizing as still held (the
    # move into FSDP under a budget is autoplan_fsdp's).
    job, auto = JobPeak(), AutoPlanner(memory=budget, profile_steps=3, min_gain=0.05, fsdp=False)
    trainer = _fit_wide(WIDE_START, 6, [job, auto])
    return {
        "start_peak": float(peak),
        "budget": budget,
        "job_peak": job.peak,
        "steps": trainer.global_step,
        "decisions": [{k: d[k] for k in ("step", "reason", "table")} for d in auto.decisions],
        "predicted": [d["chosen"].stage_memory for d in auto.decisions],
        "plan": trainer.strategy.plan,
        "stage": trainer.strategy.engine.stage_index,
        "plans": [d["chosen"].plan for d in auto.decisions],
    }


scenario(4, "autoplan_over_budget", _fit_over_budget)


def test_autoplanner_leaves_a_plan_over_the_budget_before_its_first_step(launched) -> None:
    ranks = launched(4).ok("autoplan_over_budget")
    for rank in ranks:
        assert rank["steps"] == 6  # it finished
        # The whole job, not only its steps: profiling, link measurement and the switch fit too.
        assert rank["job_peak"] <= rank["budget"], (
            rank["job_peak"],
            rank["budget"],
            rank["predicted"],
            rank["plans"],
            rank["stage"],
        )
    first = ranks[0]["decisions"][0]
    assert first["step"] == 0 and "before the first step: the starting plan does not fit" in first["reason"]
    assert "rejected: stage" in first["table"] and "over the budget" in first["table"], first["table"]


#: Plans whose whole job, profiling included, once peaked 1.18 (WideChain) and 1.55 (DenseChain
#: [1, 7], its one-block stage) times their own steps: the
#: AutoPlanner profiled a block at twice the microbatch (above a recomputed stage's step) and ran
#: trial optimizer steps beside the job's optimizer state (DenseChain's weights).
#:
#: Each with the most its job may hold against its steps: 3% in general (the capturing step keeps
#: only its last microbatch's inputs, the AutoPlanner's profiling holds little else). 25% for
#: DenseChain's one-block stage, whose 1 MiB of weights dwarf its activations: the check before
#: the first step still runs one trial optimizer step per block (no optimizer state exists yet),
#: and the copy of the block's weights it keeps on the host is the same memory on a CPU device
#: (1.18 measured; 1.55 when the profile after the steps ran trial steps too).
PROFILED_PLANS = [
    (WideChain, PipelinePlan(2, 2, 4, "1f1b", partition=(3, 5), recompute=True), 1.03),
    (DenseChain, PipelinePlan(2, 2, 4, "1f1b", partition=(1, 7)), 1.25),
]


def _profiled_job_peaks(rank: int, world: int) -> list[dict[str, Any]]:
    from lightning_pipe import AutoPlanner

    rows = []
    for model, plan, most in PROFILED_PLANS:
        steps = StepPeaks()
        _fit_wide(plan, 3, [steps.closer, Reconfigurable(), steps.opener], model)
        job = JobPeak()  # the same plan kept (min_gain), so the job's steps equal the ones measured above
        auto = AutoPlanner(memory=1e12, profile_steps=3, min_gain=1e9, headroom=0.0)
        trainer = _fit_wide(plan, 4, [job, auto], model)
        rows.append(
            {
                "model": model.__name__,
                "step_peak": max(steps.peaks),
                "job_peak": job.peak,
                "most": most,
                "decided_at": [d["step"] for d in auto.decisions],
                "kept": trainer.strategy.plan == plan,
            }
        )
    return rows


scenario(4, "autoplan_profiles_within_step_memory", _profiled_job_peaks)


def test_autoplanner_profiling_holds_no_more_than_a_step(launched) -> None:
    # The AutoPlanner's own work (the check before the first step, capturing inputs, profiling each
    # block, measuring links) against the plan's steps, per rank (PROFILED_PLANS says how close).
    for rank in launched(4).ok("autoplan_profiles_within_step_memory"):
        for row in rank:
            assert row["kept"] and row["decided_at"] == [3], row  # it profiled (and kept the plan that fits)
            assert row["job_peak"] <= row["most"] * row["step_peak"], row


@pytest.mark.parametrize("rows,microbatches", [(10, 4), (8, 4), (9, 3), (5, 5), (7, 4)])
def test_autoplanner_keeps_the_last_inputs_and_finds_their_rows(rows: int, microbatches: int) -> None:
    # Against the split itself: the kept inputs are the last microbatch (the last two where it
    # holds one sample), and the row where they begin indexes them in the batch, uneven sizes included.
    from lightning_pipe import AutoPlanner
    from lightning_pipe.runtime.microbatch import split_batch

    batch = torch.arange(rows * 3.0).view(rows, 3)
    parts, _ = split_batch(batch, microbatches)
    auto = AutoPlanner()
    auto._captured, auto._rows_seen = {0: []}, {0: 0}
    for part in parts:
        auto._capture(0, (part, "not a tensor"))
    kept = [inputs[0] for inputs in auto._captured[0]]
    assert len(kept) == (2 if len(parts[-1]) == 1 else 1)
    assert [k.data_ptr() for k in kept] == [p.data_ptr() for p in parts[-len(kept) :]]  # references, not copies
    start = auto._first_captured_row(0)
    assert torch.equal(torch.cat(kept), batch[start:])


class Reconfigurable(L.Callback):
    """Every rank loads the global batch, as under the AutoPlanner (``Profile.loads_global_batch``)."""

    def setup(self, trainer: L.Trainer, pl_module: Any, stage: str) -> None:
        trainer.strategy.enable_reconfiguration()


#: Plans whose memory the planner once under-predicted by 5 to 39% (recompute kept no outputs,
#: split backward no captured gradients, no stage the gradient it received or the one it sent).
SPOT_PLANS = [
    PipelinePlan(1, 4, 16, "1f1b", partition="uniform"),
    PipelinePlan(2, 2, 8, "1f1b", partition="uniform"),
    PipelinePlan(2, 2, 32, "gpipe", partition="uniform", recompute=True),
    PipelinePlan(4, 1, 16, "gpipe", partition="uniform", recompute=True),
    PipelinePlan(1, 4, 16, "1f1b", True, partition="uniform"),
    PipelinePlan(2, 2, 8, "1f1b", True, partition="uniform"),
    PipelinePlan(2, 2, 8, "2bw", partition="uniform"),
    PipelinePlan(1, 4, 16, "1f1b", partition="uniform", virtual_stages=2),
    PipelinePlan(2, 2, 8, "1f1b", partition="uniform", virtual_stages=2),
    PipelinePlan(2, 2, 8, "1f1b", True, partition="uniform", virtual_stages=2),
]
#: Split backward plans of :class:`DenseChain`, whose stages after the first free their graph at I.
DENSE_SPOT_PLANS = [
    PipelinePlan(1, 4, 16, "1f1b", True, partition="uniform"),
    PipelinePlan(2, 2, 8, "2bw", True, partition="uniform"),
    PipelinePlan(1, 4, 8, "2bw", True, partition="uniform"),
]  # 2BW's carry placement holds a W across windows


def _spot_check_memory(rank: int, world: int) -> list[dict[str, Any]]:
    from lightning_pipe.planning import predict

    batch = next(iter(DataLoader(Wide(), batch_size=WIDE_BATCH)))
    rows = []
    for model, plans in (
        (WideChain, SPOT_PLANS),
        (DenseChain, DENSE_SPOT_PLANS),
        (ConvDenseChain, DENSE_SPOT_PLANS[:1]),
    ):
        profile = profile_on_rank_0(
            model(), batch, [2, 4], repeats=1, optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-2)
        )
        profile = dataclasses.replace(profile, loads_global_batch=True)
        for plan in plans:
            resolved = plan.replace(partition=tuple([8 // plan.stages] * plan.stages))
            b = WIDE_BATCH // (plan.width * plan.microbatches)
            tracked = StepPeaks()
            steps = 3 if resolved.spec.streams else 2  # flushed: step 3 holds what step 2 did
            trainer = _fit_wide(resolved, steps, [tracked.closer, Reconfigurable(), tracked.opener], model)
            stage = trainer.strategy.engine.stage_index
            rows.append(
                {
                    "plan": resolved,
                    "model": model.__name__,
                    "stage": stage,
                    "measured": max(tracked.peaks[1:]),
                    "predicted": predict.predict(profile, resolved, b).stage_memory[stage],
                }
            )
    return rows


scenario(4, "planner_memory_spot_check", _spot_check_memory)


def test_predicted_stage_memory_bounds_what_every_stage_measures(launched) -> None:
    # Each stage's peak tensor bytes in real 4-process steps (test-side tracker, step 2, and 3 under 2BW)
    # against the planner's prediction for that stage. A prediction under the measurement lets
    # the AutoPlanner exceed a budget; 2% below is the tracker's noise (a few KiB). Over by at
    # most 11%: split backward's captured gradients are counted for every pending microbatch
    # but the running one, an upper bound (2 to 6% over at d = 4; about 10% on the last stage,
    # whose worst moment in the bound still has an input receive posted that the executor's
    # worst moment does not; the plain 1F1B stages here match to the byte). An interleaved rank
    # without split backward within 3%: its buffers are counted per moment, its posted receives
    # at the size of the stage that reads each.
    # DenseChain (linear blocks): its stages after the first free their graph at I (deferred linear
    # weight gradients), which the model counts. On its first stage W is the whole backward, a
    # plain backward that adds each gradient as it goes; under 2BW at (1, 4) its placement holds a
    # W across windows. ConvDenseChain: the same with convolutions, whose weight gradients split
    # backward defers. Their I peaks above a full backward's workspace (the output gradients kept
    # for W build up while the graph is still being freed), which the profile measures. A block's
    # I peak is counted beside the saved tensors of the blocks not yet run, the later blocks' kept
    # tensors, its incoming gradient and the microbatch's output (the I's root).
    for rank in launched(4).ok("planner_memory_spot_check"):
        for row in rank:
            ratio = row["measured"] / row["predicted"]
            assert 0.89 <= ratio <= 1.02, (
                row["model"],
                row["plan"].describe(),
                row["stage"],
                row["measured"],
                row["predicted"],
            )
            if row["plan"].virtual_stages > 1 and not row["plan"].split_backward:
                assert ratio >= 0.97, (row["plan"].describe(), row["stage"], row["measured"], row["predicted"])
            if (
                row["model"] == "DenseChain"
            ):  # 0.987 to 1.001 measured; 0.941 to 0.984 after I when the model kept the graph
                assert ratio >= 0.98, (row["plan"].describe(), row["stage"], row["measured"], row["predicted"])
            if row["model"] == "ConvDenseChain":
                assert ratio >= 0.98, (row["plan"].describe(), row["stage"], row["measured"], row["predicted"])


class PlanAtStart(L.Callback):
    """The plan in use at each training step's start."""

    def __init__(self) -> None:
        self.plans: list[PipelinePlan] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.plans.append(trainer.strategy.plan)


class WideResidual(torch.nn.Module):
    """A residual block through ``HEAVY_WIDTH`` hidden units: its 135 KB of weights, and Adam's 270 KB beside
    them, are nearly all the model's."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(HIDDEN, HEAVY_WIDTH), torch.nn.Linear(HEAVY_WIDTH, HIDDEN)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return h + self.down(torch.tanh(self.up(h))) * mask.unsqueeze(-1).to(h.dtype), mask


class HeavyChain(ToyChain):
    """ToyChain with one wide block that no pipeline stage can split: its stage's Adam state is the model's.

    Adam's ``eps`` is :data:`HEAVY_EPS`. Adam's step ``g / (|g| + eps)`` turns a gradient's
    last-bit differences (a batch summed in another order: per microbatch, per replica, then
    averaged) into differences of the update, by up to ``1 / eps`` where ``|g|`` is well under
    ``eps``, and most where ``eps`` is near ``|g|``. With torch's ``eps=1e-8`` the wide block's
    near-zero gradients make the update itself rounding noise; with ``1e-3`` the batch of
    :func:`_fit_auto_fsdp` summed in 8 or 16 chunks instead of whole moves the final weights by
    1.5 to 2.3 times ``rtol=1e-5``; with ``1e-2`` by at most 0.4 times, for every chunking a (4, 1)
    plan can take."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks[1] = WideResidual()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr, eps=HEAVY_EPS)


HEAVY_WIDTH, HEAVY_EPS = 1024, 1e-2
#: Bytes per device, 498 KiB after the AutoPlanner's 15% headroom: HeavyChain's FSDP (4, 1) plans at a
#: global batch of 16 are predicted to peak at about 460 to 475 KiB, FSDP (2, 2) plans at 545 KiB or
#: more, and DDP plans at 665 KiB or more (the wide block's stage holds its weights, gradients and
#: Adam state whole): only FSDP (4, 1) fits.
HEAVY_MEMORY = 600_000
HEAVY_STEPS = 4  # 2 profiled, 2 after the decision


def _whole(param: torch.Tensor) -> torch.Tensor:
    """A copy of ``param``'s whole value: an FSDP shard (a DTensor) gathered over its replicas (a collective)."""
    from torch.distributed.tensor import DTensor

    return (param.full_tensor() if isinstance(param, DTensor) else param).detach().clone()


def _fit_auto_fsdp(rank: int, world: int) -> dict[str, Any]:
    from lightning_pipe import AutoPlanner

    torch.manual_seed(0)
    model, recorder, seen = HeavyChain(), Recorder(), PlanAtStart()
    auto = AutoPlanner(memory=HEAVY_MEMORY, profile_steps=2, min_gain=0.0, virtual_stages=(1,))
    trainer = _trainer(
        devices=world,
        max_steps=HEAVY_STEPS,
        callbacks=[recorder, auto, seen],  # seen after the AutoPlanner: the plan each step ran on,
        strategy=PipelineStrategy(plan=START, global_batch_size=GLOBAL, timeout=timedelta(seconds=60)),
    )
    trainer.fit(model, DataLoader(Indexed(GLOBAL * HEAVY_STEPS, 0), batch_size=GLOBAL))
    return {
        "params": {n: _whole(p) for n, p in model.named_parameters()},
        "indices": recorder.indices,
        "plans": seen.plans,
        "decisions": [
            (d["step"], d["current"].plan, d["current"].feasible, d["chosen"].plan, d["reason"]) for d in auto.decisions
        ],
        "offered": [d["table"] for d in auto.decisions],
    }


scenario(4, "autoplan_fsdp", _fit_auto_fsdp)


def test_autoplanner_moves_a_job_whose_adam_state_fits_only_fsdp_replicas(launched) -> None:
    # Under the budget the (1, 4) DDP start does not fit, nor does any DDP plan: the AutoPlanner
    # moves the job to FSDP replicas before its first step, profiles them (on the same plan with
    # DDP replicas, and back), and decides again among FSDP plans. Training stays exact.
    ranks = launched(4).ok("autoplan_fsdp")
    for rank in ranks:
        assert rank["decisions"] == ranks[0]["decisions"] and rank["plans"] == ranks[0]["plans"]
    (start, current, fits, chosen, reason), (step, running, _, kept, _) = ranks[0]["decisions"]
    assert start == 0 and current == START.replace(partition=(2, 2, 1, 1)) and not fits, reason
    assert "does not fit" in reason
    assert (chosen.width, chosen.depth, chosen.data_parallel) == (4, 1, "fsdp"), chosen
    assert step == 2 and running == chosen and kept.data_parallel == "fsdp", kept
    assert all(p.data_parallel == "fsdp" for p in ranks[0]["plans"]), ranks[0]["plans"]
    assert "FSDP replicas" in ranks[0]["offered"][0]
    merged: dict[str, torch.Tensor] = {}
    for rank in ranks:
        merged.update(rank["params"])
    torch.manual_seed(0)
    model = HeavyChain()
    opt = torch.optim.Adam(model.parameters(), lr=model.lr, eps=HEAVY_EPS)
    want = reference_train(model, _batches(ranks[0]["indices"], HEAVY_STEPS), opt=opt)
    assert_close_dicts(merged, want, rtol=1e-5)


def _fit_resume(rank: int, world: int) -> dict[str, Any]:
    from lightning_pipe import AutoPlanner

    out = scenario_dir()
    records = []
    for steps, resume in ((5, None), (STEPS + 2, out / "ckpt" / "last.ckpt")):
        torch.manual_seed(0)
        model, recorder, seen = ToyChain(), Recorder(), PlanAtStart()
        auto = AutoPlanner(profile_steps=3, min_gain=0.0)
        trainer = _trainer(
            devices=world,
            max_steps=steps,
            callbacks=[recorder, seen, auto, L.pytorch.callbacks.ModelCheckpoint(dirpath=out / "ckpt", save_last=True)],
            strategy=PipelineStrategy(plan=POOR_START, global_batch_size=GLOBAL, timeout=timedelta(seconds=60)),
            enable_checkpointing=True,
        )
        trainer.fit(model, DataLoader(Indexed(GLOBAL * (STEPS + 2), 0), batch_size=GLOBAL), ckpt_path=resume)
        records.append(
            {
                "indices": recorder.indices,
                "plans": seen.plans,
                "decisions": len(auto.decisions),
                "plan": trainer.strategy.plan,
                "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            }
        )
    return {"first": records[0], "resumed": records[1]}


scenario(4, "autoplan_resume", _fit_resume)


def test_resuming_an_autoplanned_fit_starts_on_the_checkpoints_plan(launched) -> None:
    ranks = launched(4).ok("autoplan_resume")
    first, resumed = ranks[0]["first"], ranks[0]["resumed"]
    assert first["decisions"] == 1 and first["plan"] != POOR_START.replace(partition=(2, 2, 1, 1))
    assert resumed["decisions"] == 0 and resumed["plans"] == [first["plan"]] * (STEPS + 2 - 5)
    # One epoch of STEPS + 2 global batches, stopped at max_steps after 5 and resumed: every sample once.
    assert sorted(sum(first["indices"] + resumed["indices"], [])) == list(range(GLOBAL * (STEPS + 2)))
    merged: dict[str, torch.Tensor] = {}
    for rank in ranks:
        merged.update(rank["resumed"]["params"])
    torch.manual_seed(0)
    want = reference_train(ToyChain(), _batches(first["indices"] + resumed["indices"], STEPS + 2))
    assert_close_dicts(merged, want, rtol=1e-5)


def test_autoplanner_reports_to_tensorboard(launched) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ranks = launched(4).ok("autoplan_fit")
    files = list((launched(4).dir("autoplan_fit") / "tb").rglob("events.out.tfevents.*"))
    assert len(files) == 1, files  # rank 0 only
    acc = EventAccumulator(str(files[0]), size_guidance={"tensors": 0})
    acc.Reload()
    texts = [t for t in acc.Tags()["tensors"] if t.startswith("autoplan/decision")]
    assert texts, acc.Tags()
    logged = [e.tensor_proto.string_val[0].decode() for e in acc.Tensors(texts[0])]
    assert len(logged) == 2 and ranks[0]["decision"]["table"] in logged[0]  # both decisions, with their tables
    scalars = acc.Tags()["scalars"]
    for tag in ("autoplan/switch_s", "autoplan/predicted_step_s", "autoplan/measured_step_s"):
        assert tag in scalars, scalars
    assert acc.Scalars("autoplan/switch_s")[0].value == pytest.approx(ranks[0]["decision"]["switch_seconds"], rel=1e-6)


def _fit_no_layout(rank: int, world: int) -> dict[str, Any]:
    from lightning_pipe import AutoPlanner

    torch.manual_seed(0)
    model, recorder, seen = ToyChain(), Recorder(), PlanAtStart()
    auto = AutoPlanner(profile_steps=2, min_gain=0.0)
    trainer = _trainer(
        devices=world,
        max_steps=4,
        callbacks=[recorder, seen, auto],
        strategy=PipelineStrategy(global_batch_size=GLOBAL, timeout=timedelta(seconds=60)),
    )
    trainer.fit(model, DataLoader(Indexed(GLOBAL * 4, 0), batch_size=GLOBAL))
    return {
        "plans": seen.plans,
        "decided_at": [d["step"] for d in auto.decisions],
        "indices": recorder.indices,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


scenario(4, "autoplan_safe_start", _fit_no_layout)


def test_without_a_layout_the_profiled_steps_run_on_a_safe_start(launched) -> None:
    ranks = launched(4).ok("autoplan_safe_start")
    safe = ranks[0]["plans"][0]
    assert (safe.width, safe.depth, safe.microbatches, safe.recompute) == (1, 4, GLOBAL, (True,) * 4)
    assert ranks[0]["plans"][:2] == [safe, safe] and ranks[0]["decided_at"] == [2]
    merged: dict[str, torch.Tensor] = {}
    for rank in ranks:
        merged.update(rank["params"])
    torch.manual_seed(0)
    assert_close_dicts(merged, reference_train(ToyChain(), _batches(ranks[0]["indices"], 4)), rtol=1e-5)
