"""Worker functions for bench_distributed.py and bench_checkpoint.py (a module of their own so
spawned workers import it)."""

from __future__ import annotations

import os
import shutil
import statistics
import time

import torch
import torch.distributed as dist

from muonlab import Muon, checkpoint
from muonlab.distributed import MeshAxis
from muonlab.distributed.device import rank_device
from muonlab.experiments.checkpoint import build, train_steps

D_MODEL, N_LAYERS = 256, 4


def gpt_matrix_shapes(d_model: int = D_MODEL, n_layers: int = N_LAYERS):
    """The hidden matrices of the small GPT (the ones Muon orthogonalizes)."""
    per_layer = [("attn.qkv", (3 * d_model, d_model)), ("attn.proj", (d_model, d_model)),
                 ("mlp.fc", (4 * d_model, d_model)), ("mlp.out", (d_model, 4 * d_model))]
    return [(f"blocks.{i}.{n}", s) for i in range(n_layers) for n, s in per_layer]


def _params(layout: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    device = rank_device()
    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=(MeshAxis.DP.value,)) if layout == "fsdp" else None
    out = []
    for seed, (name, shape) in enumerate(gpt_matrix_shapes()):
        # drawn on the CPU, so the values do not depend on the device
        full = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device)
        p = distribute_tensor(full, mesh, [Shard(0)]) if mesh is not None else full
        out.append((name, torch.nn.Parameter(p)))
    return out, mesh


def time_steps(opt, params, mesh, steps: int, warmup: int = 2):
    from torch.distributed.tensor import Shard, distribute_tensor

    device = rank_device()
    # CUDA work returns before it finishes: wait for it before reading the clock
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for step in range(warmup + steps):
        for seed, (_, p) in enumerate(params):
            g = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 + seed + step)).to(device)
            p.grad = distribute_tensor(g, mesh, [Shard(0)]) if mesh is not None else g
        if dist.is_initialized():
            dist.barrier()
        sync()
        t0 = time.perf_counter()
        opt.step()
        if dist.is_initialized():
            dist.barrier()  # the step is done when the slowest rank is done
        sync()
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_worker(layout: str, strategy: str, steps: int):
    params, mesh = _params(layout)
    # a bf16 wire, the lower bound's (comm_dtype "auto" sends fp32 where Newton-Schulz runs in fp32)
    opt = Muon(params, strategy=strategy, comm_dtype=torch.bfloat16)
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


# ---------------------------------------------------------------------------- checkpoint


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()  # global shape for DTensors


def bench_save_load(root: str, widths: list[int], n_layers: int = 4, repeats: int = 3) -> list[dict]:
    """Per width: bytes of parameters + optimizer tensors (global), bytes on disk, save/load seconds
    (medians of ``repeats``, barrier to barrier)."""
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    rows = []
    for width in widths:
        model, opt = build(width, n_layers)
        train_steps(model, opt, range(1))
        opt.init_state()
        param_bytes = sum(_tensor_bytes(p) for p in model.parameters())
        state_bytes = sum(_tensor_bytes(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
        save_s, load_s = [], []
        for i in range(repeats):
            path = os.path.join(root, f"w{width}_{i}")
            dist.barrier()
            t0 = time.perf_counter()
            checkpoint.save(path, model, opt, 1)
            dist.barrier()
            save_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            checkpoint.load(path, model, opt)
            dist.barrier()
            load_s.append(time.perf_counter() - t0)
        disk = 0
        path = os.path.join(root, f"w{width}_0")
        for dirpath, _, files in os.walk(path):
            disk += sum(os.path.getsize(os.path.join(dirpath, f)) for f in files)
        dist.barrier()
        if rank == 0:
            for i in range(repeats):
                shutil.rmtree(os.path.join(root, f"w{width}_{i}"), ignore_errors=True)
        rows.append(dict(width=width, n_layers=n_layers, world=world, param_bytes=param_bytes,
                         state_bytes=state_bytes, disk_bytes=disk, save_s=sorted(save_s)[repeats // 2],
                         load_s=sorted(load_s)[repeats // 2]))
    return rows
