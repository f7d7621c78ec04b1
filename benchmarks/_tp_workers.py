"""Worker of bench_tensor_parallel.py (importable by spawned children): one steady Muon step of a
GPT-like MLP stack under FSDP2 x TP, and under plain FSDP2 on the flattened world, timed and counted."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from muonlab import Muon, muon_param_groups
from muonlab.comm.records import bytes_for_rank


class Block(nn.Module):
    """A transformer's MLP: ``fc`` column-wise and ``out`` row-wise under muonlab's default TP plan."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.fc = nn.Linear(width, hidden, bias=False)
        self.out = nn.Linear(hidden, width, bias=False)

    def forward(self, x):
        return x + self.out(torch.relu(self.fc(x)))


class MLPStack(nn.Module):
    def __init__(self, width: int, hidden: int, layers: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width, hidden) for _ in range(layers))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


CASES = {  # name -> (parallelize mode, Muon strategy)
    "fsdp x tp (2 x 2)": ("fsdp+tp", "muonlab"),
    "fsdp on 4": ("fsdp", "muonlab"),
    "fsdp on 4, redundant": ("fsdp", "redundant"),
}


def steady_steps(width: int, hidden: int, layers: int, warmup: int, steps: int) -> dict:
    """{case: this rank's median step seconds and phase seconds, bytes sent per path and planned,
    plan paths} for each case; the
    gradients of one backward, stepped ``warmup + steps`` times (a steady step re-plans nothing)."""
    from torch.distributed.device_mesh import init_device_mesh

    from muonlab.distributed import parallelize

    torch.set_num_threads(1)
    out = {}
    for name, (mode, strategy) in CASES.items():
        torch.manual_seed(0)
        model = MLPStack(width, hidden, layers)
        if mode == "fsdp+tp":
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            model, inner, _ = parallelize(model, mode, mesh, tp_axis="tp")
            x = torch.randn(8, width, generator=torch.Generator().manual_seed(dist.get_rank() // 2))
        else:
            model, inner, _ = parallelize(model, mode)
            x = torch.randn(4, width, generator=torch.Generator().manual_seed(dist.get_rank()))
        model(x).square().mean().backward()
        opt = Muon(muon_param_groups(inner), lr=0.01, strategy=strategy)
        seconds, phases = [], []
        for step in range(warmup + steps):
            dist.barrier()  # every rank starts the step together: the time is the step's, not a wait's
            start = time.perf_counter()
            opt.step()
            seconds.append(time.perf_counter() - start)
            phases.append(opt.last_step_stats()["seconds"])  # read after the timed step
        stats = opt.last_step_stats()
        out[name] = dict(seconds=statistics.median(seconds[warmup:]), sent=dict(stats["bytes_sent"]),
                         phases={k: statistics.median(ph.get(k, 0.0) for ph in phases[warmup:]) for k in phases[-1]},
                         paths=sorted({b.path for b in opt.plan()}),
                         planned=sum(bytes_for_rank(opt.plan(), dist.get_rank())[0].values()))
        del opt, model, inner
    return out
