"""Predicted against measured CUDA peak of one GPT step, term by term (one device; not run in CI).

python examples/gpu_memory.py     # from the repository root, on a machine with a GPU
"""

import sys

sys.path.insert(0, ".")
sys.path.insert(0, "examples")
import torch
from gpt import GPT

from lightning_pipe import PipelinePlan, place
from lightning_pipe.planning.costs import stage_costs
from lightning_pipe.planning.predict import _size, predict
from lightning_pipe.planning.profiler import profile_blocks

dev = torch.device("cuda", 0)
for b, m in ((32, 1), (8, 4)):
    torch.manual_seed(0)
    model = GPT(n_layer=4, n_embd=256, n_head=4, block_size=128).to(dev)
    tokens = torch.randint(0, 256, (32, 129), device=dev)
    batch = (tokens[:, :-1], tokens[:, 1:])
    profile = profile_blocks(model, batch, [b // 2, b], optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4), device=dev)
    plan = PipelinePlan(1, 1, m, "gpipe", partition="uniform").resolve([1.0] * len(model.pipeline_blocks()))
    pred = predict(profile, plan, b)
    st = stage_costs(profile, plan, b)[0]
    engine = place(model, plan, 0, device=dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(3):
        engine.train_step(batch, opt)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    engine.train_step(batch, opt)
    torch.cuda.synchronize()
    print(
        f"b={b} m={m}: predicted {_size(pred.stage_memory[0])}, "
        f"measured step peak {_size(torch.cuda.max_memory_allocated())} "
        f"(held between steps {_size(base)})",
        flush=True,
    )
    print("  terms:", {k: _size(v) for k, v in vars(st).items() if k.endswith("bytes")}, flush=True)
