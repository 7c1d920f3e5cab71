"""PipelineMonitor and timelines: the measured bubble against the simulator, and the drawing."""

from __future__ import annotations

import csv
import pickle
from pathlib import Path

import matplotlib.image
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from benchmarks.sleep_chain import SleepChain
from lightning_pipe.schedules import build_schedule
from lightning_pipe.schedules.actions import COMPUTE_KINDS, Action, Kind
from lightning_pipe.schedules.simulate import simulate
from lightning_pipe.schedules.timeline import COLOURS, bubble_fraction, draw
from tests.scripts.monitor_sleep import fit_monitored
from tests.shared import scenario, scenario_dir

DEPTH, M, STEPS = 4, 8, 4


def _monitored(rank: int, world: int) -> None:
    fit_monitored(scenario_dir(), "1f1b", split=True, microbatches=M, steps=STEPS, cost=0.02)


scenario(DEPTH, "monitor_sleep", _monitored)


def test_bubble_fraction_of_a_simulated_timeline_is_the_simulators_bubble() -> None:
    chain = SleepChain(DEPTH, 2, (1.0, 1.0, 2.0))
    for name, split in (("gpipe", False), ("1f1b", True)):
        sim = simulate(build_schedule(name, DEPTH, M, split=split), chain.predicted_cost())
        per_rank, total = bubble_fraction(sim.timeline)
        assert total == pytest.approx(sim.total_bubble)
        assert [per_rank[r] for r in range(DEPTH)] == pytest.approx(sim.bubble)


def test_draw_puts_one_box_per_action_where_it_ran() -> None:
    sim = simulate(
        build_schedule("1f1b", DEPTH, M, split=True), SleepChain(DEPTH, 2, (0.01, 0.01, 0.02)).predicted_cost()
    )
    fig = draw(sim.timeline, "test")  # a span under 10 s is drawn in milliseconds
    ax = fig.axes[0]
    drawn = sorted(
        (round(p.get_x(), 6), round(p.get_y() + p.get_height() / 2), round(p.get_width(), 6)) for p in ax.patches
    )
    # rounded as the drawn side is, so that boxes starting together on two ranks sort alike
    want = sorted(
        (round(i.start * 1e3, 6), i.rank, round((i.end - i.start) * 1e3, 6))
        for i in sim.timeline
        if i.action.kind in COLOURS
    )
    assert drawn == [pytest.approx(w) for w in want]
    assert sum(i.action.kind in COMPUTE_KINDS for i in sim.timeline) == 3 * DEPTH * M  # F, I and W of each microbatch


SENDER = {Kind.RECV_ACT: (Kind.SEND_ACT, -1), Kind.RECV_GRAD: (Kind.SEND_GRAD, +1)}


def _simulated_with_measured_costs(records: list[dict], schedule: str, split: bool) -> float:
    """The simulator's bubble for the schedule, charging each action what it measured plus the
    host time between it and its rank's previous action (executor overhead, which a loaded host
    stretches and the schedule does not know). A receive is charged only the time from the
    matching send's end to its own end (or from its start, if it started later): the transfer;
    its waiting the simulator derives."""
    intervals = [i for r in records for i in r["intervals"]]
    by_action = {i.action: i for i in intervals}
    cost = {}
    for r in records:
        previous_end = None
        for i in sorted(r["intervals"], key=lambda i: i.start):
            a, began = i.action, i.start
            if a.kind in SENDER:
                kind, offset = SENDER[a.kind]
                began = max(began, by_action[Action(a.stage + offset, kind, a.microbatch)].end)
            cost[a] = i.end - began + (i.start - previous_end if previous_end is not None else 0.0)
            previous_end = i.end
    return simulate(build_schedule(schedule, DEPTH, M, split=split), lambda a: cost.get(a, 0.0)).total_bubble


def test_monitor_bubble_agrees_with_simulator_and_draws_the_timeline(launched) -> None:
    launched(DEPTH).ok("monitor_sleep")
    dump = pickle.loads((launched(DEPTH).dir("monitor_sleep") / "monitor.pkl").read_bytes())
    with open(Path(dump["csv"]) / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("pipeline/bubble")]
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
    measured = float(rows[-1]["pipeline/bubble"])
    # The reference is the simulator run on the same schedule with each action charged what it
    # measured: sleeps overshoot and the host adds time between actions by machine- and
    # load-dependent amounts, while idle time must follow from the schedule.
    reference = _simulated_with_measured_costs(dump["records"], "1f1b", split=True)
    assert measured == pytest.approx(reference, rel=0.10)
    nominal = simulate(build_schedule("1f1b", DEPTH, M, split=True), SleepChain(DEPTH, 2, (1, 1, 1)).predicted_cost())
    assert abs(measured - nominal.total_bubble) < abs(measured - 0.5)  # nearer split 1F1B's bubble than a serial run's
    for s in range(DEPTH):
        assert int(float(rows[-1][f"pipeline/stage{s}/peak_stash"])) == nominal.peak_stash[s]
        assert float(rows[-1][f"pipeline/stage{s}/compute_s"]) > 0
        assert (
            float(rows[-1][f"pipeline/stage{s}/memory_bytes"])
            >= float(rows[-1][f"pipeline/stage{s}/peak_stash_bytes"])
            > 0
        )
    assert float(rows[-1]["pipeline/samples_per_s"]) > 0
    # The figure: one PNG per STEPS steps, and the same image in TensorBoard.
    assert dump["saved"] == [str(Path(dump["tb"]) / "pipeline_timeline" / f"timeline_step{STEPS:06d}.png")]
    assert matplotlib.image.imread(dump["saved"][0]).shape[0] > 100
    events = EventAccumulator(dump["tb"], size_guidance={"images": 0})
    events.Reload()
    assert [e.step for e in events.Images("pipeline/timeline")] == [STEPS]
