"""Issue 48: the memory model on chains nobody tuned it on, every schedule family, against an independent tracker.

:class:`~tests.models.NonUniformChain` (an embedding, MLPs of different widths, attention, a block
that triples the width and one that narrows it, a per-token head; AdamW) and
:class:`~tests.models.LogitsChain` (a tiny GPT whose head's logits, wider than its blocks, feed a
cross-entropy loss) are profiled once per process, and each plan of the matrix below is placed on
every rank of one shared launch per world size. Each rank's peak tensor bytes over a training
step, tracked by ``_TrackedBytes`` (every CPU storage, test-side), is compared with
``predict.predict``'s prediction for that rank: within 2% above it and never under (an
under-prediction is how a plan "that fits" runs out of memory).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any, Callable, Optional

import pytest
import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes

from benchmarks.nonuniform import NonUniform
from lightning_pipe import PipelinePlan, place
from lightning_pipe.planning import predict
from lightning_pipe.planning.profiler import profile_blocks
from tests.models import LogitsChain, NonUniformChain, adamw, logits_data, token_data
from tests.shared import profile_on_rank_0, scenario
from tests.test_planner import _TrackedBytes

#: Samples a microbatch: the profile is measured at this size (and twice it), so no interpolation.
B = 2
PARTITIONS = {2: (5, 5), 4: (3, 2, 2, 3), 8: (1, 1, 1, 1, 1, 1, 2, 2)}


def _matrix(width: int, depth: int) -> list[PipelinePlan]:
    """GPipe, 1F1B and 2BW, split backward off, on and (1F1B) drained, recompute off and on."""
    m = 2 * depth
    plans = []
    for schedule, recompute in itertools.product(("gpipe", "1f1b", "2bw"), (False, True)):
        splits = [(False, None), (True, None)] + ([(True, "drain")] if schedule == "1f1b" else [])
        for split, placement in splits:
            plans.append(
                PipelinePlan(
                    width,
                    depth,
                    m,
                    schedule,
                    split,
                    partition=PARTITIONS[depth],
                    recompute=recompute,
                    split_placement=placement,
                )
            )
    return plans


def _interleaved() -> list[PipelinePlan]:
    """Interleaved 1F1B, 2 stages per rank on 2 ranks, recompute and split backward off and on."""
    return [
        PipelinePlan(1, 2, 4, "1f1b", split, partition=PARTITIONS[4], recompute=recompute, virtual_stages=2)
        for split, recompute in itertools.product((False, True), (False, True))
    ]


def _interleaved_world4() -> list[PipelinePlan]:
    """Two stages per rank on 4 processes: interleaved 1F1B (loop placement) and ZB-V (the V)
    with split backward (without it: :data:`WIDE_PLANS`), on 4 ranks (8 stages, one block each but the last two: the
    embedding alone on rank 0, stages of different widths sharing a link) and on 2 ranks of 2
    replicas; looped BFS in a V (every backward of the turn's later stage before the earlier
    one's: the gradients it hands over wait); and one stage per rank whose last block
    (``Resize``'s tanh) saves its output."""
    return [
        PipelinePlan(1, 4, 4, "1f1b", True, partition=PARTITIONS[8], virtual_stages=2),
        PipelinePlan(1, 4, 8, "zbv", True, partition=PARTITIONS[8], virtual_stages=2),
        PipelinePlan(2, 2, 4, "1f1b", True, partition=PARTITIONS[4], virtual_stages=2),
        PipelinePlan(1, 4, 4, "looped_bfs", partition=PARTITIONS[8], virtual_stages=2, placement="v"),
        PipelinePlan(1, 4, 8, "1f1b", False, partition=(4, 2, 2, 2)),
    ]


def _interleaved_two_bw() -> dict[int, list[PipelinePlan]]:
    """Interleaved 2BW, two stages per rank: two weight versions of each stage, and on each rank
    the stages whose next batch's backwards start before the rank's deferred step hold two
    batches' gradients (rank 0 steps right after its all-reduce); on 2 ranks and on 4, under the
    loop placement (split backward on 2 ranks) and in a V (rank r holds stages r and 2d - 1 - r),
    split backward off and on (each stage keeps its own W waiting: under split a stage may run
    the next batch's first I before its rank's step, writing the gradients of the weights W does
    not defer)."""
    plan = functools.partial(PipelinePlan, schedule="2bw", virtual_stages=2)
    return {
        2: [
            plan(1, 2, 2, partition=PARTITIONS[4]),
            plan(1, 2, 2, split_backward=True, partition=PARTITIONS[4]),
            plan(1, 2, 3, partition=PARTITIONS[4], placement="v"),
            plan(1, 2, 3, split_backward=True, partition=PARTITIONS[4], placement="v"),
        ],
        4: [
            plan(1, 4, 8, partition=PARTITIONS[8]),
            plan(1, 4, 8, partition=PARTITIONS[8], placement="v"),
            plan(1, 4, 8, split_backward=True, partition=PARTITIONS[8], placement="v"),
        ],
    }


def _first_weight_gradient() -> list[PipelinePlan]:
    """GPipe with split backward on 2 replicas at m = 4d: the last stage peaks at its first W,
    which makes the replica bucket whole beside the gradients the running microbatch's I wrote of
    the weights W does not defer (norms), and adds its products into it beside a bias's summed
    gradient."""
    return [PipelinePlan(2, 2, 8, "gpipe", True, partition=PARTITIONS[2])]


PLANS = {
    2: _matrix(1, 2) + _interleaved() + _interleaved_two_bw()[2],
    4: _matrix(1, 4) + _matrix(2, 2) + _first_weight_gradient() + _interleaved_world4() + _interleaved_two_bw()[4],
}

#: Split backward on :class:`LogitsChain`, ZB-H1's placement and the drained one: the last stage's
#: I frees the graph block by block, the head's logits-sized tensors (the loss's saved
#: log-softmax) among the first it frees. Looped BFS in a V with split backward (:data:`V_TURN`).
LOGITS_PLANS = {
    2: [
        PipelinePlan(1, 2, 4, "1f1b", True, partition=(3, 3), split_placement=placement)
        for placement in (None, "drain")
    ]
    + [PipelinePlan(1, 2, 2, "looped_bfs", True, partition=(2, 1, 1, 2), virtual_stages=2, placement="v")],
    4: [],
}

#: Looped BFS in a V with split backward: at the turn a stage's output is the next stage's input,
#: which that stage's pending microbatches keep for their W (a transformer block's LayerNorm), and
#: the earlier stage's I runs while they wait. The output is alive once: counted by the earlier
#: stage until its I ends, then as kept for the W. Counted twice (with a message's header, though
#: no message carries it), rank 1 comes out 1.5% over; counted once, 0.1%.
V_TURN = LOGITS_PLANS[2][-1]

#: Interleaved 1F1B and ZB-V on 4 ranks at 8 samples a microbatch: the messages of stages of
#: different widths that share a link weigh more beside the rest. 2BW with split backward at
#: m = d: between a rank's deferred step and its next batch's first W only one batch's gradients
#: live, where the activations it holds peak. Interleaved 2BW with replicas: a batch's gradient
#: bucket spans the rank's stages, so a stage's part of the next batch's exists once another
#: stage of its rank starts that batch. Interleaved 2BW in a V on 2 ranks: after rank 0's deferred
#: step its last stage holds its own batch's gradients alone. 2BW with split backward where a
#: narrow stage sends a wide output (``Resize``): the receive for its next gradient is posted in
#: the window that reads it, not at the end of the one before. Looped BFS with split backward:
#: a pending microbatch keeps its input message once, not its input and an input gradient
#: (on the stage that narrows the width, whose input is three times its output). Interleaved 2BW
#: with replicas and split backward: a batch's bucket, which spans the rank's stages, exists from
#: its first W on the rank, not from another stage's I of it (an I's gradients wait in its work).
WIDE_PLANS = {
    2: [PipelinePlan(1, 2, 4, "2bw", partition=PARTITIONS[4], virtual_stages=2, placement="v")],
    4: [
        PipelinePlan(1, 4, 4, "1f1b", False, partition=PARTITIONS[8], virtual_stages=2),
        PipelinePlan(1, 4, 8, "zbv", False, partition=PARTITIONS[8], virtual_stages=2),
        PipelinePlan(1, 4, 4, "2bw", True, partition=PARTITIONS[4]),
        PipelinePlan(2, 2, 2, "2bw", partition=PARTITIONS[4], virtual_stages=2),
        PipelinePlan(1, 4, 4, "2bw", True, partition=(5, 1, 1, 3)),
        PipelinePlan(1, 4, 2, "looped_bfs", True, partition=PARTITIONS[8], virtual_stages=2),
        PipelinePlan(2, 2, 2, "2bw", True, partition=PARTITIONS[4], virtual_stages=2),
    ],
}


def user_tokens(n: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Tokens and targets for the user-path benchmark's chain (benchmarks/nonuniform.py's defaults:
    a vocabulary of 256, sequences of 32)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 32), generator=g), torch.randint(0, 256, (n, 32), generator=g)


#: The user-path benchmark's chain in ZB-V with split backward, the narrowing Resize alone as
#: stage 6: its LayerNorm keeps the whole input message for W, and the send after each I is a
#: moment of its own (the receive it posts, what the I kept and the message), not an input more
#: beside the I's peak. 2BW in a V: a rank reads a neighbour's messages in the order it sent them,
#: so a receive that waits for a later message (an activation of one stage behind a gradient of
#: the other) takes the earlier one in first, kept whole until its own receive reads it (counted
#: only until taken in, ranks 1 and 2 come out one message under); each window is its own program.
USER_PLANS = {
    2: [],
    4: [
        PipelinePlan(1, 4, 2, "zbv", True, partition=(1, 1, 1, 1, 1, 1, 1, 2), virtual_stages=2),
        PipelinePlan(1, 4, 8, "2bw", partition=(1, 1, 1, 1, 1, 1, 1, 2), virtual_stages=2, placement="v"),
    ],
}

#: Per model (a name, the microbatch size after a colon where not :data:`B`): the model, its
#: data, and its plans per world size.
MODELS = {
    "NonUniformChain": (NonUniformChain, token_data, PLANS),
    "NonUniformChain:8": (NonUniformChain, token_data, WIDE_PLANS),
    "LogitsChain": (LogitsChain, logits_data, LOGITS_PLANS),
    "NonUniform": (NonUniform, user_tokens, USER_PLANS),
}


def microbatch_size(name: str) -> int:
    """Samples a microbatch of ``MODELS[name]``'s plans."""
    return int(name.partition(":")[2] or B)


def family(plan: PipelinePlan) -> str:
    """The schedule family a plan's test checks it under."""
    name = plan.schedule if plan.virtual_stages == 1 else "interleaved" if plan.schedule == "1f1b" else plan.schedule
    if plan.virtual_stages > 1 and plan.spec.streams:
        name = "v-2bw" if plan.stage_placement == "v" else "interleaved-2bw"
    if plan.split_backward:
        name += "-drain" if plan.split_placement == "drain" else "-split"
    return name


FAMILIES = sorted({family(p) for *_, plans in MODELS.values() for p in plans[2] + plans[4]})


def _tracked_steps(engine: Any, batch: Any, steps: int = 3, fresh: Optional[Callable[[int], Any]] = None) -> int:
    """Peak tensor bytes over steps 2 to ``steps`` of training (AdamW's state exists from the first
    on, 2BW's second weight version from its second): every storage the steps create, tracked from
    before the first, plus the weights and the batch. A flushed schedule's steps after the first
    hold the same tensors (nothing crosses a flush), so its callers track step 2 alone; a 2BW
    stream's third step is its first steady one. ``fresh(k)``: step ``k``'s own batch (from the
    second step on), made untracked and tracked from that step's start, as a data loader hands
    one over: a 2BW window starts beside the last batch, whose microbatches are still in flight."""
    from lightning_pipe.runtime.comm import p2p

    params = list(engine.parameters())
    opt = adamw(params)
    p2p.packing.cache_clear()  # its header templates are made (and counted) as in a fresh process
    with _TrackedBytes(params + list(batch)) as tracker:
        engine.train_step(batch, opt)
        tracker.peak = sum(tracker.alive.values())
        for k in range(1, steps):
            if fresh is not None:
                with _disable_current_modes():
                    batch = fresh(k)
                for t in batch:
                    tracker._track(t.untyped_storage())
            engine.train_step(batch, opt)
        peak = tracker.peak
    engine.drain()  # 2BW: nothing left in flight for the next plan's links
    return peak


def _batch(data: Callable[..., Any], samples: int, replica: int, step: int) -> Any:
    """Step ``step``'s batch of ``samples`` for one replica (its own per step and replica)."""
    return data(samples, seed=replica + 100 * step)


def _exact_memory(rank: int, world: int) -> dict[str, list[tuple[int, int, int]]]:
    """Per model, per plan of this world size: this rank's pipeline position, predicted and
    tracked peak tensor bytes."""
    from lightning_pipe import PipelineGroups

    out = {}
    for name, (model, data, plans) in MODELS.items():
        if not plans[world]:
            continue
        b = microbatch_size(name)
        torch.manual_seed(0)
        profile = profile_on_rank_0(model(), data(4 * b), [b, 2 * b], repeats=1, optimizer=adamw)
        rows = []
        for plan in plans[world]:
            torch.manual_seed(0)
            engine = place(model(), plan, rank, groups=PipelineGroups.build(plan.topology, rank))
            replica = plan.topology.replica_of(rank)
            fresh = functools.partial(_batch, data, plan.microbatches * b, replica) if plan.spec.streams else None
            measured = _tracked_steps(engine, _batch(data, plan.microbatches * b, replica, 0), 3 if fresh else 2, fresh)
            predicted = predict.predict(profile, plan, b).stage_memory[engine.stage_index]
            rows.append((engine.stage_index, predicted, measured))
        out[name] = rows
    return out


for _world in PLANS:
    scenario(_world, "memory_exact", _exact_memory)


def ratios(launched: Any) -> list[tuple[str, PipelinePlan, int, int, int, int]]:
    """Every (model, plan, rank, stage, predicted, measured) of both launches."""
    out = []
    for world in PLANS:
        for rank, models in enumerate(launched(world).ok("memory_exact")):
            for name, rows in models.items():
                for plan, (stage, predicted, measured) in zip(MODELS[name][2][world], rows):
                    out.append((name, plan, rank, stage, predicted, measured))
    return out


@pytest.mark.parametrize("name", FAMILIES)
def test_memory_is_predicted_within_two_percent_and_never_under(launched, name: str) -> None:
    # Issue 48's target: every rank of every layout, 1.00 <= predicted / tracked <= 1.02. What the
    # families exercise: split backward's later stages (W's products beside a replicated stage's
    # bucket) and its first stage (one microbatch activation more); 2BW with split and recompute;
    # LogitsChain's last stage under split backward, where a block's I runs beside the saved
    # tensors of the blocks not yet run (counted beside the whole graph, with the head's freed
    # logits-sized tensors, that stage comes out 11 to 13% over); two stages per rank on 4
    # processes (interleaved 1F1B, ZB-V), whose buffers are counted at the layout their receive
    # was posted for (stages of different widths share a link), a stage's saved output kept
    # beside its earlier blocks' backwards, an I's input gradient and its packed message at its
    # end, and the gradients handed over at the V's turn while they wait (looped BFS).
    misses = [
        (model, plan.describe(), rank, stage, predicted, measured, round(predicted / measured, 4))
        for model, plan, rank, stage, predicted, measured in ratios(launched)
        if family(plan) == name and not measured <= predicted <= 1.02 * measured
    ]
    assert not misses, misses


def test_a_v_turns_output_kept_for_the_next_stages_w_is_counted_once(launched) -> None:
    # V_TURN: rank 1 runs stage 1's I beside stage 2's pending microbatch, which keeps stage 1's
    # output (its input) for its W. Byte-exact but a header or so, where counting it twice is
    # 1.5% over: the 2% bound of the family's test does not tell them apart.
    rows = [row for row in ratios(launched) if row[0] == "LogitsChain" and row[1] == V_TURN]
    assert len(rows) == 2
    for *_, stage, predicted, measured in rows:
        assert measured <= predicted <= 1.005 * measured, (stage, predicted, measured)


@pytest.mark.parametrize("m", [1, 2])
def test_two_bw_on_one_stage_counts_the_previous_batchs_gradients_only(m: int) -> None:
    # 2BW on one stage: window t runs batch t's forwards and backwards, then steps batch t-1's
    # gradients (PipeDream-2BW paper, section 3.1). Batch t's first backward runs beside batch
    # t-1's gradients alone, its own appearing as its activations go; only later backwards (and
    # the step) hold both batches' sets. Tracked in one process, as test_planner's one-stage check.
    torch.manual_seed(0)
    profile = profile_blocks(NonUniformChain(), token_data(4 * B), [B, 2 * B], repeats=1, optimizer=adamw)
    plan = PipelinePlan(1, 1, m, "2bw", partition=(10,))
    torch.manual_seed(0)
    measured = _tracked_steps(place(NonUniformChain(), plan, 0), token_data(m * B), steps=4)
    predicted = predict.predict(profile, plan, B).stage_memory[0]
    assert measured <= predicted <= 1.02 * measured, (predicted, measured)


def test_a_peak_past_the_profiled_sizes_is_the_largest_of_its_moments_lines() -> None:
    # A microbatch larger than the profiled ones (a plan with fewer replicas than devices): the
    # peak alive from a block's first weight-gradient accumulation on is a gradient-sized moment at
    # small sizes and an activation-sized one at large sizes; its line through 4 and 8 falls under
    # it at 16 (NonUniformChain's narrow MLPs by 6 to 18%). Each moment is a line: their largest
    # is exact. The shared launches' plans are profiled at their own size (no extrapolation).
    torch.manual_seed(0)
    profile = profile_blocks(NonUniformChain(), token_data(32), [4, 8, 16], repeats=1, optimizer=adamw)
    for i, block in enumerate(profile.blocks):
        at = {s.microbatch_size: s for s in block.samples}
        extrapolated = dataclasses.replace(block, samples=[at[4], at[8]]).at(16)
        assert extrapolated.after_gradient_bytes == at[16].after_gradient_bytes, i
