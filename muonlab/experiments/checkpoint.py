"""Worker functions for checkpointing and fault demos (notebook 05, bench_checkpoint.py).

They live in an importable module because :func:`muonlab.distributed.launch` cannot start
functions defined in a notebook. Each builds the small GPT from seed 0, shards it with FSDP2 over
all ranks, trains with Muon on this rank's slice of a fixed global batch (so the global batch, and
the loss, do not depend on the world size) and returns plain data.
"""

from __future__ import annotations

import os
import shutil
import time

import torch
import torch.distributed as dist

from . import checkpoint
from .models import GPT, GPTConfig
from .optim import Muon, muon_param_groups

__all__ = ["build", "global_batch", "train_steps", "train_and_save", "resume_and_train", "bench_save_load",
           "faulty_training"]

GLOBAL_BATCH = 8
CONTEXT = 32
HYPER = dict(lr=0.02, weight_decay=0.01, momentum=0.9, adamw_lr=3e-3)


def _world_rank() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def build(width: int = 32, n_layers: int = 2):
    """(model, optimizer) on this rank: GPT from seed 0, FSDP2 over all ranks when distributed."""
    from .distributed import apply_fsdp, build_mesh

    torch.manual_seed(0)
    model = GPT(GPTConfig(d_model=width, n_layers=n_layers, n_heads=4, context=CONTEXT))
    if dist.is_initialized():
        model = apply_fsdp(model, build_mesh())
    return model, Muon(muon_param_groups(model), **HYPER)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the global batch of ``step`` (random byte tokens)."""
    world, rank = _world_rank()
    if GLOBAL_BATCH % world:
        raise ValueError(f"the global batch of {GLOBAL_BATCH} does not split over {world} ranks")
    t = torch.randint(0, 256, (GLOBAL_BATCH, CONTEXT + 1), generator=torch.Generator().manual_seed(1000 + step))
    per = GLOBAL_BATCH // world
    t = t[rank * per:(rank + 1) * per]
    return t[:, :-1], t[:, 1:]


def train_steps(model, opt, steps: range) -> list[float]:
    """Train; return the global mean loss of each step."""
    losses = []
    for step in steps:
        x, y = global_batch(step)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(value)
            value /= dist.get_world_size()
        losses.append(float(value))
    return losses


def _full_params(model) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}


def train_and_save(path: str, steps: int, save_at: int, width: int = 32) -> dict:
    """A straight run of ``steps`` steps, and a run that saves at ``save_at``: losses, saved params."""
    model, opt = build(width)
    straight = train_steps(model, opt, range(steps))
    model, opt = build(width)
    before = train_steps(model, opt, range(save_at))
    checkpoint.save(path, model, opt, save_at)
    return dict(straight=straight, before=before, saved_params=_full_params(model))


def resume_and_train(path: str, steps: int, width: int = 32) -> dict:
    """Load ``path`` (saved on any world size), train to ``steps``: losses, loaded params."""
    model, opt = build(width)
    step = checkpoint.load(path, model, opt)
    loaded = _full_params(model)
    return dict(step=step, loaded_params=loaded, after=train_steps(model, opt, range(step, steps)))


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()  # global shape for DTensors


def bench_save_load(root: str, widths: list[int], n_layers: int = 4, repeats: int = 3) -> list[dict]:
    """Per width: bytes of parameters + optimizer tensors (global), bytes on disk, save/load seconds
    (medians of ``repeats``, barrier to barrier)."""
    torch.set_num_threads(1)
    world, rank = _world_rank()
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


def faulty_training(fail_rank: int, fail_step: int, steps: int = 4) -> int:
    """Train; ``fail_rank`` raises just before its optimizer step at ``fail_step`` (a demo fault)."""
    model, opt = build()
    for step in range(steps):
        x, y = global_batch(step)
        model(x, y).backward()
        if dist.get_rank() == fail_rank and step == fail_step:
            raise RuntimeError(f"injected fault on rank {fail_rank} at step {fail_step}")
        opt.step()
        opt.zero_grad()
    return dist.get_rank()
