"""``python -m lightning_pipe.plan``: profile a LightningCLI config's model and print the ranked plans for N devices."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import inspect
import re
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

import lightning as L
import torch
import yaml
from tqdm import tqdm

from lightning_pipe.core.pipeline_plan import PipelinePlan
from lightning_pipe.planning import predict, search
from lightning_pipe.planning.links import profile_links
from lightning_pipe.planning.profile import Profile
from lightning_pipe.planning.profiler import profile_blocks
from lightning_pipe.runtime.microbatch import batch_size

_UNITS = {"": 1, "B": 1, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9}


def parse_bytes(text: str) -> int:
    """``"256MiB"`` -> 268435456; plain numbers are bytes."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([KMG]i?B|B)?\s*", text, flags=re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 512MiB, 2GiB or bytes)")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])


def _classes(script: Path) -> tuple[type, type]:
    """The PipelineMixin LightningModule and the LightningDataModule that ``script`` defines."""
    spec = importlib.util.spec_from_file_location(script.stem, script)
    assert spec is not None and spec.loader is not None
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


def _build(script: Path, config: Path) -> tuple[Any, Any]:
    """The model and data module a LightningCLI config describes (built from its ``model``/``data`` sections)."""
    model_cls, data_cls = _classes(script)
    cfg = yaml.safe_load(config.read_text())
    return model_cls(**(cfg.get("model") or {})), data_cls(**(cfg.get("data") or {}))


def _global_batch(cfg: dict[str, Any], data: Any) -> int:
    """The config's global batch: its per-replica batch size times its data-parallel width."""
    trainer = cfg.get("trainer") or {}
    init = ((trainer.get("strategy") or {}).get("init_args") or {}) if isinstance(trainer.get("strategy"), dict) else {}
    devices = int(trainer.get("devices") or 1)
    depth = int(init.get("pipeline_depth") or devices)
    return int(init.get("global_batch_size") or getattr(data, "batch_size") * (devices // depth))


def profile_config(model: Any, data: Any, sizes: Sequence[int]) -> Profile:
    """Take one training batch of ``data`` and profile every block of ``model`` at ``sizes``."""
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    if batch_size(batch) < max(sizes):
        raise SystemExit(f"the data module's batches hold {batch_size(batch)} samples; profiling needs {max(sizes)}")
    return profile_blocks(model, batch, sizes)


def table(ranked: Sequence[predict.Prediction], top: int) -> str:
    """The ranked plans as a markdown table (the best ``top`` feasible, then a few infeasible)."""
    rows = [
        "| w | d | v | b | m | schedule | split | recompute | partition | step (s) | samples/s | peak per rank "
        "| infeasible because |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
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
            f"{_split(plan)} | {recompute} | {list(plan.partition)} | {p.step_time:.4f} | "
            f"{p.samples_per_second:.1f} | {peaks} | {p.why_infeasible()} |"
        )
    return "\n".join(rows)


def _split(plan: PipelinePlan) -> str:
    """The table's split column: no, yes, or yes with its W placement."""
    if not plan.split_backward:
        return "no"
    return f"yes ({plan.split_placement})" if plan.split_placement else "yes"


def snippet(best: predict.Prediction, global_batch: int) -> str:
    """The best plan as YAML for ``trainer.strategy.init_args``."""
    plan = best.plan
    init = {
        "schedule": plan.schedule,
        "pipeline_depth": plan.depth,
        "microbatches": plan.microbatches,
        "partition": list(plan.partition),
        "recompute": list(plan.recompute),
        "split_backward": plan.split_backward,
        "inner": plan.inner,
        "global_batch_size": global_batch,
        "virtual_stages": plan.virtual_stages,
    }
    if plan.split_placement is not None:
        init["split_placement"] = plan.split_placement
    return yaml.safe_dump({"trainer": {"devices": plan.world_size, "strategy": {"init_args": init}}}, sort_keys=False)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse arguments, profile, search, print the table and write the best plan's YAML."""
    parser = argparse.ArgumentParser(prog="python -m lightning_pipe.plan", description=__doc__)
    parser.add_argument("--config", type=Path, required=True, help="a LightningCLI YAML config")
    parser.add_argument(
        "--script",
        type=Path,
        default=None,
        help="the script defining the model and data module (default: examples/<config name before its first '_'>.py)",
    )
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--ranks-per-node", type=int, default=None, help="processes per node (default: all on one)")
    parser.add_argument(
        "--memory",
        type=parse_bytes,
        default=None,
        help="budget of tensor bytes per device, e.g. 256MiB (default on GPU: the device's free memory)",
    )
    parser.add_argument("--global-batch", type=int, default=None, help="default: the config's")
    parser.add_argument("--allow-stale", action="store_true", help="also plan PipeDream-2BW (1-stale updates)")
    parser.add_argument(
        "--virtual-stages",
        type=int,
        nargs="+",
        default=[1, 2],
        help="stages per rank to plan (above 1: interleaved 1F1B; default: 1 2)",
    )
    parser.add_argument("--no-links", action="store_true", help="skip measuring transfers (they are then free)")
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--output", type=Path, default=Path("plan.yaml"))
    args = parser.parse_args(argv)
    if args.memory is None and torch.cuda.is_available():
        args.memory = torch.cuda.mem_get_info()[0]
    script = args.script or Path("examples") / f"{args.config.stem.split('_')[0]}.py"
    cfg = yaml.safe_load(args.config.read_text())
    model, data = _build(script, args.config)
    global_batch = args.global_batch or _global_batch(cfg, data)
    sizes = sorted({1, max(global_batch // args.devices, 1)})
    print(f"profiling {type(model).__name__} at microbatch sizes {sizes} ...", flush=True)
    profile = profile_config(model, data, sizes)
    if not args.no_links:
        print("measuring transfers and all-reduce between 2 local processes ...", flush=True)
        profile = dataclasses.replace(profile, **profile_links())
    candidates = list(
        search.candidates(
            profile,
            args.devices,
            global_batch,
            args.allow_stale,
            memory_limit=args.memory,
            virtual_stages=args.virtual_stages,
        )
    )
    ranked = search.rank([search.evaluate(profile, c, args.memory) for c in tqdm(candidates, desc="simulating plans")])
    print(table(ranked, args.top))
    if not ranked or not ranked[0].feasible:
        print("no plan fits the memory budget", file=sys.stderr)
        return 1
    best = ranked[0]
    if args.ranks_per_node:
        oriented = predict.orient(profile, best.plan, best.microbatch_size, args.ranks_per_node)
        best = dataclasses.replace(best, plan=oriented)
    args.output.write_text(snippet(best, global_batch))
    print(f"\nbest plan written to {args.output}:\n{args.output.read_text()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
