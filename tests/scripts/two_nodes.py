"""One node of a two-node job on localhost: the planner orients the layout, the Trainer trains on it.

``torchrun --nnodes 2 --nproc_per_node 2 --node_rank N --master_addr 127.0.0.1 --master_port P two_nodes.py OUT``
"""

from __future__ import annotations

import faulthandler
import os
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_pipe import PipelinePlan, PipelineStrategy  # noqa: E402
from lightning_pipe.planning import predict  # noqa: E402
from lightning_pipe.planning.profiler import profile_blocks  # noqa: E402
from tests.models import ToyChain, make_data  # noqa: E402
from tests.scripts.train_toy import Indexed, Recorder  # noqa: E402

BATCH, STEPS = 8, 3


def main() -> None:
    # A stuck worker prints every thread's stack and exits, so the test fails with where it
    # stuck rather than at its own timeout (main takes under 3 s, the launch 12-16 s on 2 cores).
    faulthandler.dump_traceback_later(150, exit=True)
    out = Path(sys.argv[1])
    torch.manual_seed(0)
    model = ToyChain()
    # Every rank profiles the same chain in one process; the orientation only compares byte
    # counts (no timings), so every rank chooses the same.
    profile = profile_blocks(ToyChain(), make_data(8), [2, 4], repeats=1)
    plan = predict.orient(
        profile, PipelinePlan(width=2, depth=2, microbatches=2, partition=[3, 3]), 2, ranks_per_node=2
    )
    recorder = Recorder()
    trainer = L.Trainer(
        accelerator="cpu",
        num_nodes=2,
        devices=2,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[recorder],
        strategy=PipelineStrategy(plan=plan, timeout=timedelta(seconds=60)),
    )
    trainer.fit(model, DataLoader(Indexed(BATCH * 2 * STEPS, 0), batch_size=BATCH))
    strategy = trainer.strategy
    torch.save(
        {
            "node": int(os.environ["GROUP_RANK"]),
            "rank": trainer.global_rank,
            "inner": strategy.plan.inner,
            "stage": strategy.engine.stage_index,
            "replica": strategy.topology.replica_of(trainer.global_rank),
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "indices": recorder.indices,
        },
        out / f"rank{trainer.global_rank}.pt",
    )
    torch.distributed.destroy_process_group()  # the teardown too, inside the stack-dump window


if __name__ == "__main__":
    main()
