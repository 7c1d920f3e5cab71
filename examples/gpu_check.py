"""GPU checks on one CUDA device: host synchronisations per step, the AutoPlanner through Trainer.fit (not in CI).

python examples/gpu_check.py      # from the repository root, on a machine with a GPU
"""

import os
import sys
import time
import warnings

sys.path.insert(0, ".")
sys.path.insert(0, "examples")
import lightning as L
import torch
from gpt import GPT, StdlibText

from lightning_pipe import AutoPlanner, PipelinePlan, PipelineStrategy, place

print("torch", torch.__version__, "lightning", L.__version__, torch.cuda.get_device_name(0), flush=True)
dev = torch.device("cuda", 0)

# 1. host synchronisations per training step (d = 1, m = 8): sync debug mode counts them
for schedule in () if os.environ.get("SKIP_SYNC") else ("1f1b", "gpipe"):
    torch.manual_seed(0)
    model = GPT(n_layer=4, n_embd=256, n_head=4, block_size=128)
    engine = place(model, PipelinePlan(1, 1, 8, schedule, partition="uniform"), 0, device=dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, 256, (32, 129), device=dev)
    batch = (tokens[:, :-1], tokens[:, 1:])
    for _ in range(2):
        engine.train_step(batch, opt)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = engine.train_step(batch, opt)
    torch.cuda.set_sync_debug_mode(0)
    where = sorted({str(w.filename).split("site-packages/")[-1] + ":" + str(w.lineno) for w in caught})
    print(
        f"[sync] {schedule} d=1 m=8: {len(caught)} host synchronisations in one step; "
        f"loss {float(loss):.4f}; at {where}",
        flush=True,
    )


# 2. AutoPlanner on CUDA through Trainer.fit, one device: budget from the device, measured peak from CUDA
class Report(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        torch.cuda.synchronize()
        print(
            f"[fit] step {trainer.global_step} plan {trainer.strategy.plan.describe()} "
            f"step peak {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB, {time.perf_counter() - self.start:.4f} s",
            flush=True,
        )


for memory in (None, "tight"):
    torch.manual_seed(0)
    model = GPT(n_layer=4, n_embd=256, n_head=4, block_size=128)
    planner = AutoPlanner(profile_steps=3, memory=None if memory is None else 64 * 2**20)
    trainer = L.Trainer(
        accelerator="gpu",
        devices=1,
        max_steps=12,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[planner, Report()],
        strategy=PipelineStrategy(global_batch_size=32, microbatches=4, process_group_backend="nccl"),
    )
    start = time.perf_counter()
    try:
        trainer.fit(model, StdlibText(block_size=128, batch_size=32, max_bytes=300_000))
        print(
            f"[fit] memory={memory}: finished in {time.perf_counter() - start:.1f} s "
            f"on {trainer.strategy.plan.describe()}",
            flush=True,
        )
    except Exception as err:
        import traceback

        print(f"[fit] memory={memory}: {type(err).__name__}: {err}"[:2000], flush=True)
        print("".join(traceback.format_exception(err))[-3000:], flush=True)
