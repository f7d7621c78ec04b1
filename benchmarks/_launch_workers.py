"""The worker bench_launch.py launches: a researcher's small run (an nn.Sequential MLP under DDP over
the launched process group, AdamW, a step reported per step), in an importable module as launch()
needs."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from muonlab.launcher import report_progress


def train_mlp(steps: int, width: int = 64, seed: int = 0) -> float:
    torch.manual_seed(seed)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(seed + dist.get_rank())
    loss = torch.zeros(())
    for step in range(1, steps + 1):
        x = torch.randn(32, width, generator=gen)
        loss = (model(x) - x.sum(1, keepdim=True).sin()).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        report_progress(step=step, loss=loss.detach(), total=steps)
    return float(loss)
