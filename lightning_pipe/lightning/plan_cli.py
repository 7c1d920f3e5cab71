"""``python -m lightning_pipe.plan``: profile a LightningCLI config's model and print the ranked plans for N devices."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import inspect
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Callable, Collection, Optional, Sequence, TypeVar

import lightning as L
import torch
import yaml
from lightning.fabric.utilities.distributed import _suggested_max_num_threads
from tqdm import tqdm

from lightning_pipe.core.pipeline_plan import PipelinePlan
from lightning_pipe.core.sizes import parse_size
from lightning_pipe.lightning.trial import run_trial, strategy_init_args
from lightning_pipe.planning import predict, programs, search
from lightning_pipe.planning.calibration import Trial, calibrate, measured_spreads, median_error
from lightning_pipe.planning.links import profile_links
from lightning_pipe.planning.profile import Profile, median_profile
from lightning_pipe.planning.profiler import profile_concurrently
from lightning_pipe.runtime.microbatch import batch_size


def parse_bytes(text: str) -> int:
    """``--memory`` in bytes: ``"256MiB"``, ``"2GB"`` or a number (:func:`~lightning_pipe.core.sizes.parse_size`)."""
    try:
        return parse_size(text, "--memory")
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _at_least_one(text: str) -> int:
    """A count flag (devices, ranks, batch, stages, rows): an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def _classes(script: Path) -> tuple[type, type]:
    """The PipelineMixin LightningModule and the LightningDataModule that ``script`` defines."""
    spec = importlib.util.spec_from_file_location(script.stem, script)
    if spec is None or spec.loader is None or not script.is_file():
        raise SystemExit(f"--script {script}: no such Python file")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(script.parent))
    sys.modules[script.stem] = module
    spec.loader.exec_module(module)
    own = [c for _, c in inspect.getmembers(module, inspect.isclass) if c.__module__ == module.__name__]
    models = [c for c in own if issubclass(c, L.LightningModule) and hasattr(c, "pipeline_blocks")]
    data = [c for c in own if issubclass(c, L.LightningDataModule)]
    if len(models) != 1 or len(data) != 1:
        raise SystemExit(f"{script} must define one PipelineMixin LightningModule and one LightningDataModule")
    return models[0], data[0]


def _imported(config: Path, section: str, class_path: str) -> type:
    """The class ``class_path`` names (``package.module.Class``), imported as LightningCLI does."""
    module_name, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise SystemExit(
            f"{config}: {section}.class_path {class_path!r} cannot be imported ({type(err).__name__}: {err}); "
            "make its package importable (pip install -e . or PYTHONPATH) or pass --script path/to/your_model.py"
        ) from None


def _section(cfg: dict[str, Any], section: str) -> tuple[Optional[str], dict[str, Any]]:
    """A config section's ``class_path`` (``None`` if it names none) and its init arguments."""
    body = cfg.get(section) or {}
    if "class_path" in body:
        return body["class_path"], dict(body.get("init_args") or {})
    return None, dict(body)


def _build(config: Path, script: Optional[Path]) -> tuple[Any, Any]:
    """The model and data module a LightningCLI config describes.

    Each class comes from its section's ``class_path`` when the config names one (LightningCLI's
    subclass mode), otherwise from ``script`` (the file calling ``LightningCLI(Model, Data)``).
    """
    cfg = yaml.safe_load(config.read_text()) or {}
    (model_path, model_args), (data_path, data_args) = _section(cfg, "model"), _section(cfg, "data")
    if model_path is None or data_path is None:
        if script is None:
            missing = "model" if model_path is None else "data"
            raise SystemExit(f"the config names no {missing} class_path, pass --script path/to/your_model.py")
        model_cls, data_cls = _classes(script)
    if model_path is not None:
        model_cls = _imported(config, "model", model_path)
    if data_path is not None:
        data_cls = _imported(config, "data", data_path)
    return model_cls(**model_args), data_cls(**data_args)


def _global_batch(cfg: dict[str, Any], data: Any) -> int:
    """The config's global batch: its per-replica batch size times its data-parallel width."""
    trainer = cfg.get("trainer") or {}
    init = ((trainer.get("strategy") or {}).get("init_args") or {}) if isinstance(trainer.get("strategy"), dict) else {}
    devices = int(trainer.get("devices") or 1)
    depth = int(init.get("pipeline_depth") or devices)
    return int(init.get("global_batch_size") or getattr(data, "batch_size") * (devices // depth))


def profiled_sizes(global_batch: int, devices: int, held: Optional[int] = None, whole: bool = True) -> list[int]:
    """The microbatch sizes the plan command profiles: 1, the largest a replica gets with every
    device a replica, between them their geometric middle, and the whole global batch (one
    microbatch of one replica: the largest any plan runs), as far as the data's batch (``held``
    samples; ``None``: all of them) reaches, unless ``whole`` is false. Time is interpolated
    linearly between the nearest two (:meth:`~lightning_pipe.planning.profile.BlockProfile.at`);
    a block's time is not linear in the size from one sample to many (per-op overheads, then
    caches), a middle sample halves the span a line must cover, and a line is not stretched
    past the samples it was drawn through. Bytes are linear in it."""
    largest = max(global_batch // devices, 1)
    sizes = {1, max(round(largest**0.5), 1), largest}
    if whole:
        sizes.add(max(min(global_batch, held if held is not None else global_batch), largest))
    return sorted(sizes)


def job_conditions(devices: int, ranks_per_node: Optional[int], device_type: str) -> tuple[int, int]:
    """``(processes, threads)``: the ranks that will share one host's cores and the torch threads each will use.

    On CPU the ranks of a node share its cores, and Lightning gives each rank
    ``max(1, cores // ranks)`` threads unless ``OMP_NUM_THREADS`` says otherwise; block times
    measured in one process with the host's default threads would not hold for them. On an
    accelerator each rank computes on a device of its own: one process, its current threads.
    """
    if device_type != "cpu":
        return 1, torch.get_num_threads()
    local = min(devices, ranks_per_node or devices)
    threads = os.environ.get("OMP_NUM_THREADS")
    return local, int(threads) if threads else _suggested_max_num_threads(local)


def _model(config: Path, script: Optional[Path]) -> Any:
    """The config's model, built afresh (in each profiling process)."""
    return _build(config, script)[0]


def profile_config(
    config: Path, script: Optional[Path], data: Any, sizes: Sequence[int], processes: int, threads: int
) -> Profile:
    """Profile every block of the config's model at ``sizes`` on one training batch of ``data``, as the job will run.

    ``processes`` profile at once, ``threads`` torch threads each (:func:`job_conditions`), so that
    block times include the contention of ranks sharing the host's cores. The conditions are
    recorded in ``profile.meta["conditions"]``.
    """
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    if batch_size(batch) < max(sizes):
        raise SystemExit(f"the data module's batches hold {batch_size(batch)} samples; profiling needs {max(sizes)}")
    factory = functools.partial(_model, config, script)
    profile = profile_concurrently(factory, batch, sizes, processes, threads)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    profile.meta["conditions"] = {"processes": processes, "threads": threads, "host_cores": cores}
    return profile


def stable_profiles(
    profiled: Callable[[], Profile], ranking: Callable[[Profile], list[predict.Prediction]], rounds: int
) -> tuple[list[Profile], list[predict.Prediction]]:
    """Profile until the top plans' predicted steps, under the median of the profiles so far, move
    less than 2% from one round to the next (at most ``rounds``; the first comparison is of the
    medians of 2 and of 3 rounds, so at least 3 when ``rounds`` allows); the profiles and the
    ranking under their median."""
    profiles = [profiled()]
    ranked = ranking(profiles[0])
    top = [search.Candidate(p.plan, p.microbatch_size) for p in ranked[:5] if p.feasible]
    before = None
    for _ in range(1, max(rounds, 1)):
        profiles.append(profiled())
        median = median_profile(profiles)
        now = [search.evaluate(median, c).step_time for c in top]
        if before is not None and all(abs(n / b - 1) < STABLE for n, b in zip(now, before)):
            break
        before = now
    return profiles, ranking(median_profile(profiles)) if len(profiles) > 1 else ranked


#: Rounds of profiling stop once the top plans' predictions move less than this between rounds.
STABLE = 0.02


def prediction_spread(
    profiles: Sequence[Profile], shown: Sequence[predict.Prediction], memory: Optional[float]
) -> dict[PipelinePlan, float]:
    """Each shown plan's spread: the standard error of the median of its predicted steps under each
    round's profile, relative to it (:func:`~lightning_pipe.planning.calibration.median_error`).
    The ranking's profile is the rounds' median, so this is how far its prediction can move with
    the rounds' noise; one disturbed round does not widen it, as it would a range."""
    if len(profiles) < 2:
        return {}
    spread = {}
    for p in shown:
        steps = [search.evaluate(q, search.Candidate(p.plan, p.microbatch_size), memory).step_time for q in profiles]
        spread[p.plan] = median_error(steps)
    return spread


def trial_ranking(
    profile: Profile,
    ranked: list[predict.Prediction],
    ranking: Callable[[Profile], list[predict.Prediction]],
    trained: Callable[[predict.Prediction], Trial],
    budget: int,
    choice: Optional[Callable[[list[predict.Prediction], dict[tuple[PipelinePlan, int], float]], Any]] = None,
) -> tuple[
    Profile, list[predict.Prediction], dict[tuple[PipelinePlan, int], float], dict[tuple[PipelinePlan, int], float]
]:
    """The profile fitted to trial runs (:func:`~lightning_pipe.planning.calibration.calibrate`),
    the plans ranked again (:func:`measured_first`: each plan that ran charged its measured step,
    each of a trial's layout its model step scaled by the trial), and, by plan and microbatch
    size, the fitted model's step of each plan charged so, and the measured step's spread of
    each plan that ran (:func:`~lightning_pipe.planning.calibration.measured_spreads`: with the
    host's launch noise pooled over the trials).

    The first trials run the best plan (and the best with DDP replicas where the best shards
    them: the fit reads DDP trials) and the best DDP plan of another data-parallel width
    (programs that differ in all-reduce and compute, for the fit), of the other kind where one
    is feasible (pipelined or data-parallel only: their step overheads differ,
    :meth:`~lightning_pipe.planning.profile.Profile.overhead_of`); then, refitted after each trial, the
    best plan that has not run, while it is predicted faster than every measured one, then the
    plan ``choice`` would take (given the ranking and the trials' spreads: a plan within the noise
    that needs less memory) while no trial has measured it, until ``budget`` trials have run. A
    trial that fails is reported and left out.
    """
    ran: dict[tuple[PipelinePlan, int], Trial] = {}
    tried: set[tuple[PipelinePlan, int]] = set()

    def attempt(p: predict.Prediction) -> None:
        tried.add((p.plan, p.microbatch_size))
        try:
            ran[(p.plan, p.microbatch_size)] = trained(p)
        except RuntimeError as err:
            print(f"trial run failed, left out of the fit: {err}", file=sys.stderr, flush=True)

    feasible = [p for p in ranked if p.feasible]
    ddp = [p for p in feasible if p.plan.data_parallel != "fsdp"]  # the fit reads DDP trials (calibrate)
    first = feasible[:1] + (ddp[:1] if feasible and feasible[0].plan.data_parallel == "fsdp" else [])
    others = [p for p in ddp if feasible and p.plan.width != feasible[0].plan.width and p not in first]
    other_kind = [p for p in others if (p.plan.depth > 1) != (feasible[0].plan.depth > 1)]
    first += (other_kind or others)[:1]
    for p in first[:budget]:
        attempt(p)
    while True:
        fitted = calibrate(profile, list(ran.values()))
        modeled = ranking(fitted)
        ranked = measured_first(modeled, ran)
        spreads = measured_spreads(list(ran.values()))
        fresh = _next_trial(ranked, ran, tried, choice(ranked, spreads) if choice else None)
        if len(tried) >= budget or fresh is None:
            layouts = layout_ratios(modeled, ran)
            steps = {
                (p.plan, p.microbatch_size): p.step_time
                for p in modeled
                if (p.plan, p.microbatch_size) in ran or layout(p.plan, p.microbatch_size) in layouts
            }
            return fitted, ranked, steps, spreads
        attempt(fresh)


def _next_trial(
    ranked: Sequence[predict.Prediction],
    ran: dict[tuple[PipelinePlan, int], Trial],
    tried: set[tuple[PipelinePlan, int]],
    chosen: Optional[predict.Prediction],
) -> Optional[predict.Prediction]:
    """The plan to try next (:func:`trial_ranking`): the best untried feasible plan if it is
    predicted faster than every measured one (or none was measured), else ``chosen`` if untried."""
    fresh = next((p for p in ranked if p.feasible and (p.plan, p.microbatch_size) not in tried), None)
    measured = [t.step for t in ran.values()]
    if fresh is not None and (not measured or fresh.step_time < min(measured)):
        return fresh
    if chosen is not None and (chosen.plan, chosen.microbatch_size) not in tried:
        return chosen
    return None


def confirmed(
    ranked: Sequence[predict.Prediction], trial_spreads: dict[tuple[PipelinePlan, int], float], noise: float
) -> list[predict.Prediction]:
    """The plans :func:`~lightning_pipe.planning.search.choose` may take where trials ran: the best
    feasible one and those a trial measured whose step, raised by their own spread, stays within
    ``noise`` of the best's. A plan predicted within the noise of a measured best is only a
    model's guess until it runs; it is not taken for its memory unconfirmed. A measured plan is
    taken only where its measurements show it no slower than the noise allows (an equivalence
    test: Schuirmann's two one-sided tests, at one standard error), not merely where a wide
    spread fails to tell it from the best: on a busy host plans whose trials read ±4% to ±8%
    lay within the noise of the best and trained 19% to 23% slower."""
    if not trial_spreads:
        return list(ranked)
    best = next((p for p in ranked if p.feasible), None)
    if best is None:
        return list(ranked)
    limit = best.step_time * (1 + noise)

    def equivalent(p: predict.Prediction) -> bool:
        spread = trial_spreads.get((p.plan, p.microbatch_size))
        return spread is not None and p.step_time * (1 + spread) <= limit

    return [p for p in ranked if p is best or equivalent(p)]


def measured_first(
    ranked: Sequence[predict.Prediction], ran: dict[tuple[PipelinePlan, int], Trial]
) -> list[predict.Prediction]:
    """``ranked`` with each plan that ran a trial (or runs the same job as one, :func:`same_run`)
    charged its measured step, and each plan of a
    trial's layout (:func:`layout`: the same blocks on the same ranks at the same microbatch
    size, another schedule, split or recompute) its model step times that trial's measured over
    model step (:func:`layout_ratios`); ranked again."""
    ratios = layout_ratios(ranked, ran)
    charged = []
    for p in ranked:
        trial = next(iter(of_same_run(ran, p.plan, p.microbatch_size)), None)
        step = trial.step if trial else p.step_time * ratios.get(layout(p.plan, p.microbatch_size), 1.0)
        charged.append(dataclasses.replace(p, step_time=step))
    return search.rank(charged)


_T = TypeVar("_T")


#: The plan fields that only order a program's actions: plans that differ in them alone and
#: build the same action lists run the same job.
ORDER_FIELDS = frozenset({"schedule", "split_placement", "split_max_pending"})


def of_same_run(entries: dict[tuple[PipelinePlan, int], _T], plan: PipelinePlan, microbatch_size: int) -> list[_T]:
    """The values of ``entries`` (keyed by plan and microbatch size) whose plans run the same job
    as ``plan`` at ``microbatch_size`` (:func:`same_run`)."""
    return [v for (q, b), v in entries.items() if b == microbatch_size and same_run(plan, q)]


def same_run(a: PipelinePlan, b: PipelinePlan) -> bool:
    """Whether two plans run the same job: equal but for the fields that order their actions
    (:data:`ORDER_FIELDS`), with schedules that keep as many weight versions and stream alike,
    and programs that are the same action lists (GPipe and 1F1B with one microbatch, a split
    backward's W placements with one microbatch). A trial of one measures the other."""
    if a == b:
        return True
    if any(getattr(a, f.name) != getattr(b, f.name) for f in dataclasses.fields(a) if f.name not in ORDER_FIELDS):
        return False
    if (a.spec.streams, a.spec.weight_versions) != (b.spec.streams, b.spec.weight_versions):
        return False
    return programs.program(a) == programs.program(b)


def layout(plan: PipelinePlan, microbatch_size: int) -> tuple:
    """What a plan shares with others that differ only in their schedule, split backward or
    recompute: its replicas and their kind, its stages, their placement and partition, and its
    microbatches and their size."""
    return (
        plan.width,
        plan.depth,
        plan.virtual_stages,
        plan.stage_placement,
        plan.partition,
        plan.data_parallel,
        plan.microbatches,
        microbatch_size,
    )


def layout_ratios(
    ranked: Sequence[predict.Prediction], ran: dict[tuple[PipelinePlan, int], Trial]
) -> dict[tuple, float]:
    """Per :func:`layout` of a plan that ran a trial, its measured over its model step (the model's
    miss on those blocks, ranks and sizes, which the layout's other plans share; ``ranked``:
    the model's predictions)."""
    model = {(p.plan, p.microbatch_size): p.step_time for p in ranked}
    return {
        layout(plan, b): trial.step / model[(plan, b)]
        for (plan, b), trial in ran.items()
        if model.get((plan, b), 0) > 0
    }


def choice_noise(
    ranked: Sequence[predict.Prediction],
    spread: dict[PipelinePlan, float],
    trial_spreads: dict[tuple[PipelinePlan, int], float],
) -> float:
    """How far another plan's step can lie from the best's before the measurements tell them apart,
    for :func:`~lightning_pipe.planning.search.choose`. If a trial measured the best (it, a plan
    of the same run, :func:`same_run`, or one of its :func:`layout`, whose measured step scales
    the best's): ``sqrt(2)`` times that trial's spread, the standard error of the difference of
    two steps each measured as closely (the others are measured, or scaled by a trial, on the
    same host). Else the best's prediction's spread over the rounds of profiling, which every
    plan's prediction shares (0 without either)."""
    if not ranked:
        return 0.0
    best = ranked[0]
    measured = of_same_run(trial_spreads, best.plan, best.microbatch_size) or [
        s for (q, b), s in trial_spreads.items() if layout(q, b) == layout(best.plan, best.microbatch_size)
    ]
    if measured:
        return math.sqrt(2) * max(measured)
    return max(spread.get(best.plan, 0.0), 0.0)


def calibration_note(profile: Profile) -> str:
    """One line: what the trial runs fitted."""
    c = profile.meta.get("calibration")
    if not c:
        return "no trial run finished: the plans are predicted from the profile alone"
    return (
        f"fitted to {len(c['trials'])} trial run(s): compute x{c['compute_scale']:.2f} + "
        f"{c['action_overhead'] * 1e3:.2f} ms an action, optimizer step "
        f"x{c['optimizer_scale']:.2f}, all-reduce x{c['allreduce_scale']:.2f} + "
        f"{c.get('allreduce_latency', 0.0) * 1e3:.2f} ms, "
        f"{c.get('message_stall', 0.0) * 1e3:.2f} ms a message's stalls, "
        f"{c['step_overhead'] * 1e3:.1f} ms a step outside the program{_per_layout(c.get('layout_overheads', {}))}"
    )


def _per_layout(overheads: dict[str, float]) -> str:
    """`` (2x1: 1.1 ms, 1x2: 9.8 ms)``: the step overhead fitted per layout, '' without."""
    return " (" + ", ".join(f"{k}: {v * 1e3:.1f} ms" for k, v in overheads.items()) + ")" if overheads else ""


def conditions_note(profile: Profile) -> str:
    """One line: the conditions the block times hold for."""
    c = profile.meta.get("conditions")
    if not c:
        return "block times measured under unrecorded conditions"
    shared = (
        f"; each computed {profile.meta['slowdown']:.2f}x slower with all at once than alone, so the ranks share "
        f"{profile.cores:.2f} effective cores"
        if profile.cores is not None and "slowdown" in profile.meta
        else ""
    )
    return (
        f"block times measured in {c['processes']} process(es) at once, {c['threads']} torch thread(s) each, on a "
        f"host of {c['host_cores']} cores{shared}: they hold for a job whose ranks run so (set OMP_NUM_THREADS to "
        "match)"
    )


def table(
    ranked: Sequence[predict.Prediction],
    top: int,
    spread: Optional[dict[PipelinePlan, float]] = None,
    trials: Optional[dict[tuple[PipelinePlan, int], float]] = None,
    ran: Optional[Collection[tuple[PipelinePlan, int]]] = None,
    noise: float = 0.0,
) -> str:
    """The ranked plans as a markdown table (the best ``top`` feasible, then a few infeasible); ``spread``:
    each plan's predicted step's spread over the rounds of profiling (:func:`prediction_spread`);
    ``trials``: the model's step of the plans charged by a trial (:func:`measured_first`); ``ran``:
    those that ran one themselves (default: all of them)."""
    spread, trials = spread or {}, trials or {}
    ran = set(trials) if ran is None else set(ran)
    rows = [
        "| w | d | v | b | m | schedule | split | replicas | recompute | partition | step (s) | spread | trial "
        "| samples/s | peak per rank | infeasible because |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    feasible = [p for p in ranked if p.feasible][:top]
    shown = feasible + [p for p in ranked if not p.feasible][: max(3, top - len(feasible))]
    for p in shown:
        plan = p.plan
        peaks = ", ".join(predict._size(x) for x in p.stage_memory)
        recompute = "".join("y" if r else "n" for r in plan.recompute)
        rows.append(
            f"| {plan.width} | {plan.depth} | {plan.virtual_stages} | {p.microbatch_size} | {plan.microbatches} "
            f"| {plan.schedule} | "
            f"{_split(plan)} | {_replicas(plan)} | {recompute} | {list(plan.partition)} | {p.step_time:.4f} | "
            f"{f'±{spread[plan]:.1%}' if plan in spread else ''} | {_trial(p, trials, ran)} | "
            f"{p.samples_per_second:.1f} | {peaks} | {p.why_infeasible()} |"
        )
    return "\n".join(rows)


def _trial(
    p: predict.Prediction, trials: dict[tuple[PipelinePlan, int], float], ran: Collection[tuple[PipelinePlan, int]]
) -> str:
    """The table's trial column: the fitted model's step beside the measured one of a plan that
    ran a trial, or beside the step scaled by its layout's trial."""
    key = (p.plan, p.microbatch_size)
    if key not in trials:
        return ""
    return f"measured (model {trials[key]:.4f})" if key in ran else f"layout's trial (model {trials[key]:.4f})"


def _replicas(plan: PipelinePlan) -> str:
    """The table's replicas column: ddp, or fsdp with its ZeRO stage (3: resharded after each
    forward, 2: kept gathered over the step)."""
    if plan.data_parallel != "fsdp":
        return plan.data_parallel
    return f"fsdp (ZeRO-{3 if plan.reshard_after_forward else 2})"


def _split(plan: PipelinePlan) -> str:
    """The table's split column: no, yes, or yes with its W placement."""
    if not plan.split_backward:
        return "no"
    return f"yes ({plan.split_placement})" if plan.split_placement else "yes"


def snippet(best: predict.Prediction, global_batch: int) -> str:
    """The best plan as YAML for ``trainer.strategy.init_args``."""
    init = strategy_init_args(best.plan, global_batch)
    return yaml.safe_dump(
        {"trainer": {"devices": best.plan.world_size, "strategy": {"init_args": init}}}, sort_keys=False
    )


def ranking_json(
    ranked: Sequence[predict.Prediction],
    devices: int,
    global_batch: int,
    chosen: Optional[predict.Prediction] = None,
    spread: Optional[dict[PipelinePlan, float]] = None,
    trials: Optional[dict[tuple[PipelinePlan, int], float]] = None,
    ran: Optional[Collection[tuple[PipelinePlan, int]]] = None,
    noise: float = 0.0,
) -> str:
    """Every ranked plan as JSON, in the table's order: its plan fields, microbatch size, predicted
    step seconds (and their spread over the rounds of profiling, where measured) and peak bytes per
    pipeline rank, and whether it fits the budget; ``chosen``: the index of the plan written as YAML;
    ``trials``: the plans charged by a trial (``model_step_seconds`` the fitted model's), ``ran``
    those that ran one (``trial``: ``step_seconds`` measured; default: all of them), the others
    scaled by their layout's (``layout_trial``); ``noise``: how far the best plan's step can be off
    (:func:`choice_noise`; ``within_noise``: the plans predicted within it of the best's step)."""
    spread, trials = spread or {}, trials or {}
    ran = set(trials) if ran is None else set(ran)
    close = {id(p) for p in search.within_noise(ranked, noise)}
    rows = [
        {
            "width": p.plan.width,
            "depth": p.plan.depth,
            "microbatches": p.plan.microbatches,
            "schedule": p.plan.schedule,
            "split_backward": p.plan.split_backward,
            "split_placement": p.plan.split_placement,
            "virtual_stages": p.plan.virtual_stages,
            "inner": p.plan.inner,
            "placement": p.plan.stage_placement,
            "data_parallel": p.plan.data_parallel,
            "reshard_after_forward": p.plan.reshard_after_forward,
            "partition": list(p.plan.partition),
            "recompute": list(p.plan.recompute),
            "microbatch_size": p.microbatch_size,
            "step_seconds": p.step_time,
            "peak_bytes_per_rank": list(p.stage_memory),
            "feasible": p.feasible,
            "spread": spread.get(p.plan),
            "trial": (p.plan, p.microbatch_size) in ran,
            "layout_trial": (p.plan, p.microbatch_size) in trials and (p.plan, p.microbatch_size) not in ran,
            "model_step_seconds": trials.get((p.plan, p.microbatch_size), p.step_time),
            "within_noise": id(p) in close,
        }
        for p in ranked
    ]
    index = next((i for i, p in enumerate(ranked) if p is chosen), None)
    head = {"devices": devices, "global_batch": global_batch, "chosen": index, "noise": noise}
    return json.dumps({**head, "plans": rows}, indent=1)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse arguments, profile, search, print the table and write the best plan's YAML."""
    parser = argparse.ArgumentParser(prog="python -m lightning_pipe.plan", description=__doc__)
    parser.add_argument("--config", type=Path, required=True, help="a LightningCLI YAML config")
    parser.add_argument(
        "--script",
        type=Path,
        default=None,
        help="the script defining the model and data module, for a config whose model or data section names "
        "no class_path",
    )
    parser.add_argument("--devices", type=_at_least_one, required=True, help="processes to plan for")
    parser.add_argument(
        "--ranks-per-node", type=_at_least_one, default=None, help="processes per node (default: all on one)"
    )
    parser.add_argument(
        "--memory",
        type=parse_bytes,
        default=None,
        help="budget of tensor bytes per device, e.g. 256MiB (default on GPU: the device's free memory)",
    )
    parser.add_argument("--global-batch", type=_at_least_one, default=None, help="default: the config's")
    parser.add_argument("--allow-stale", action="store_true", help="also plan PipeDream-2BW (1-stale updates)")
    parser.add_argument(
        "--virtual-stages",
        type=_at_least_one,
        nargs="+",
        default=[1, 2],
        help="stages per rank to plan (above 1: interleaved 1F1B, looped BFS, ZB-V, DualPipeV; default: 1 2)",
    )
    parser.add_argument("--no-links", action="store_true", help="skip measuring transfers (they are then free)")
    parser.add_argument("--top", type=_at_least_one, default=10)
    parser.add_argument(
        "--profile-rounds",
        type=_at_least_one,
        default=4,
        help="most rounds of profiling; they stop once the top plans' predictions are stable (default 4)",
    )
    parser.add_argument("--output", type=Path, default=Path("plan.yaml"))
    parser.add_argument(
        "--ranking-json", type=Path, default=None, help="also write every ranked plan, with its predictions, as JSON"
    )
    parser.add_argument(
        "--profile-json", type=Path, default=None, help="also write the profile the plans are predicted from, as JSON"
    )
    parser.add_argument(
        "--trials",
        type=int,
        default=3,
        help="plans trained for a few steps through the config's own script, as the job will run, to fit the "
        "cost model and measure them (default 3; 0: the profile alone)",
    )
    args = parser.parse_args(argv)
    if not args.config.is_file():
        parser.error(f"argument --config: no such file: {args.config}")
    if args.memory is None and torch.cuda.is_available():
        args.memory = torch.cuda.mem_get_info()[0]
    cfg = yaml.safe_load(args.config.read_text()) or {}
    model, data = _build(args.config, args.script)
    global_batch = args.global_batch or _global_batch(cfg, data)
    data.setup("fit")
    held = batch_size(next(iter(data.train_dataloader())))
    # A GPU may not hold one block's activations of the whole global batch (plans that would need
    # them do not fit it either): there the largest profiled size stays a replica's batch.
    sizes = profiled_sizes(global_batch, args.devices, held, whole=not torch.cuda.is_available())
    processes, threads = job_conditions(
        args.devices, args.ranks_per_node, "cuda" if torch.cuda.is_available() else "cpu"
    )
    print(
        f"profiling {type(model).__name__} at microbatch sizes {sizes} in {processes} process(es) of "
        f"{threads} thread(s), as the job's ranks will run ...",
        flush=True,
    )
    links = {}
    if not args.no_links:
        # As many local processes as the job runs, each on the job's threads: on a host whose
        # cores the ranks share, a message waits for its receiver to get a core back.
        print(f"measuring transfers and all-reduce between {max(processes, 2)} local processes ...", flush=True)
        links = profile_links(world=max(processes, 2), threads=threads if processes > 1 else 1)

    def profiled() -> Profile:
        return dataclasses.replace(profile_config(args.config, args.script, data, sizes, processes, threads), **links)

    def ranking(profile: Profile) -> list[predict.Prediction]:
        found = search.candidates(
            profile,
            args.devices,
            global_batch,
            args.allow_stale,
            memory_limit=args.memory,
            virtual_stages=args.virtual_stages,
        )
        return search.rank([search.evaluate(profile, c, args.memory) for c in tqdm(list(found), desc="simulating")])

    profiles, ranked = stable_profiles(profiled, ranking, args.profile_rounds)
    profile = median_profile(profiles)
    print(conditions_note(profile), flush=True)
    trials: dict[tuple[PipelinePlan, int], float] = {}
    trial_spreads: dict[tuple[PipelinePlan, int], float] = {}
    if args.trials > 0:

        def trained(p: predict.Prediction) -> Trial:
            print(f"trial run: {p.plan.describe()}, microbatch size {p.microbatch_size} ...", flush=True)
            trial = run_trial(args.config, args.script, p.plan, p.microbatch_size, global_batch)
            launches = ", ".join(f"{t:.4f}" for t in trial.launches)
            print(f"  step {trial.step:.4f} s ±{trial.spread:.1%} (each launch's median: {launches} s)", flush=True)
            return trial

        def memory_pick(ranked: list[predict.Prediction], spreads: dict) -> Optional[predict.Prediction]:
            shown = prediction_spread(profiles, ranked[: args.top], args.memory)
            return search.choose(ranked, choice_noise(ranked, shown, spreads))

        profile, ranked, trials, trial_spreads = trial_ranking(
            profile, ranked, ranking, trained, args.trials, memory_pick
        )
        print(calibration_note(profile), flush=True)
    if args.profile_json is not None:
        args.profile_json.write_text(profile.to_json())
    noise = prediction_spread(profiles, ranked[: args.top], args.memory)
    print(table(ranked, args.top, noise, trials, trial_spreads))
    top_noise = choice_noise(ranked, noise, trial_spreads)
    best = search.choose(confirmed(ranked, trial_spreads, top_noise), top_noise)
    close = search.within_noise(ranked, top_noise)
    if len(close) > 1:
        print(
            f"\nthe first {len(close)} feasible plans are predicted within the noise of the best one's step "
            f"(±{top_noise:.1%}): these measurements cannot tell them apart"
        )
    if args.ranking_json is not None:
        args.ranking_json.write_text(
            ranking_json(ranked, args.devices, global_batch, best, noise, trials, trial_spreads, noise=top_noise)
        )
    if best is None:
        print("no plan fits the memory budget", file=sys.stderr)
        return 1
    unconfirmed = search.choose(ranked, top_noise)
    if unconfirmed is not None and unconfirmed is not best:
        spread = trial_spreads.get((unconfirmed.plan, unconfirmed.microbatch_size))
        why = (
            "no trial measured it (none left in the budget, or it failed)"
            if spread is None
            else f"its trial's spread (±{spread:.1%}) leaves it possibly slower than the noise allows"
        )
        print(
            f"\n{unconfirmed.plan.describe()} needs less memory and is predicted within the noise of the best, "
            f"but {why}: keeping {best.plan.describe()}"
        )
    if best is not ranked[0]:
        print(
            f"\nthe best plans are within the noise of the best one's step (±{top_noise:.1%}): "
            f"choosing the one that needs the least memory, {best.plan.describe()}"
        )
    if args.ranks_per_node:
        oriented = predict.orient(profile, best.plan, best.microbatch_size, args.ranks_per_node)
        best = dataclasses.replace(best, plan=oriented)
    args.output.write_text(f"# {conditions_note(profile)}\n" + snippet(best, global_batch))
    print(f"\nbest plan written to {args.output}:\n{args.output.read_text()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
