"""Run every registered scenario of this world size on one set of processes (see tests/shared.py).

``torchrun --nproc_per_node W scenarios.py ROOT``: results land in ``ROOT/worldW/<name>/rank<r>.pkl``.
"""

from __future__ import annotations

import gc
import importlib
import os
import pickle
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_pipe.runtime.comm.groups import destroy_groups  # noqa: E402
from tests import shared  # noqa: E402


def main() -> None:
    root = Path(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    for module in shared.MODULES:
        importlib.import_module(module)
    gc.freeze()  # each collection below then scans what the scenarios made, not every imported module's objects
    os.environ["SCENARIO_ROOT"] = str(root)
    only = set(filter(None, os.environ.get("SCENARIOS_ONLY", "").split(",")))  # for debugging one scenario
    for name in shared.in_order(world):
        if only and name not in only:
            continue
        fn, args = shared.SCENARIOS[world][name]
        folder = shared.launch_folder(root, world) / name
        folder.mkdir(parents=True, exist_ok=True)
        os.environ["SCENARIO_DIR"] = str(folder)
        start, cpu = time.monotonic(), time.process_time()
        try:
            result = ("ok", fn(rank, world, *args))
        except BaseException as err:  # noqa: BLE001 - reported to the test
            result = ("error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}")
        written = folder / f".rank{rank}.pkl"
        written.write_bytes(pickle.dumps(result))
        written.rename(folder / f"rank{rank}.pkl")  # whole when it appears: another launch may wait for it
        took = f"{time.monotonic() - start:.1f}s ({time.process_time() - cpu:.1f}s CPU)"
        print(f"[rank {rank}] {name}: {result[0]} in {took}", flush=True)
        dist.barrier()  # a scenario that failed on one rank only times out here and ends the launch
        destroy_groups(
            shared.live_groups()
        )  # each holds threads and sockets: the next scenario starts as a fresh launch would
        # a group a reference cycle keeps (a failed step's engine) closes its sockets now, not at a later collection
        gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
