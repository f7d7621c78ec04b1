"""Worker functions for bench_distributed.py (a module of its own so spawned workers import it)."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from muonlab import Muon

D_MODEL, N_LAYERS = 256, 4


def gpt_matrix_shapes(d_model: int = D_MODEL, n_layers: int = N_LAYERS):
    """The hidden matrices of the small GPT (the ones Muon orthogonalizes)."""
    per_layer = [("attn.qkv", (3 * d_model, d_model)), ("attn.proj", (d_model, d_model)),
                 ("mlp.fc", (4 * d_model, d_model)), ("mlp.out", (d_model, 4 * d_model))]
    return [(f"blocks.{i}.{n}", s) for i in range(n_layers) for n, s in per_layer]


def _params(layout: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",)) if layout == "fsdp" else None
    out = []
    for seed, (name, shape) in enumerate(gpt_matrix_shapes()):
        full = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
        p = distribute_tensor(full, mesh, [Shard(0)]) if mesh is not None else full
        out.append((name, torch.nn.Parameter(p)))
    return out, mesh


def time_steps(opt, params, mesh, steps: int, warmup: int = 2):
    from torch.distributed.tensor import Shard, distribute_tensor

    times = []
    for step in range(warmup + steps):
        for seed, (_, p) in enumerate(params):
            g = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 + seed + step))
            p.grad = distribute_tensor(g, mesh, [Shard(0)]) if mesh is not None else g
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        opt.step()
        if dist.is_initialized():
            dist.barrier()  # the step is done when the slowest rank is done
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_worker(layout: str, strategy: str, steps: int):
    params, mesh = _params(layout)
    opt = Muon(params, strategy=strategy)
    seconds = time_steps(opt, params, mesh, steps)
    stats = opt.last_step_stats()
    plan = opt.plan()
    flops = [0] * dist.get_world_size()
    for b in plan:
        for r, f in enumerate(b.flops):
            flops[r] += f
    return dict(seconds=seconds, sent=sum(stats["bytes_sent"].values()), recv=sum(stats["bytes_recv"].values()),
                paths=sorted({b.path for b in plan}), plan_flops=flops, phases=stats["seconds"])


def single_process(steps: int):
    params, _ = _params("single")
    opt = Muon(params)
    return time_steps(opt, params, None, steps)
