"""Worker for the matrix-view test: a CNN-like model under FSDP2 whose conv kernels go to Muon
(conv="muon", view "flatten") beside a transformers-style Conv1D (view "transpose").

Importable by spawned children; the parent builds the same model for the single-process run.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from muonlab import Muon, muon_param_groups
from muonlab.comm.records import bytes_for_rank

from ._common import full

HYPER = dict(lr=0.05, weight_decay=0.01, momentum=0.9, ns_dtype=torch.float32, comm_dtype=torch.float32)
STEPS = 3


class Conv1D(nn.Module):
    """transformers.pytorch_utils.Conv1D's layout: weight stored (in, out) = (nx, nf)."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.1)


def build_model() -> nn.Module:
    """Conv kernels of 6, 5 and 1 filters (rows 3,3; 3,2; 1,0 on 2 ranks), a Conv1D, a hidden
    Linear and the head; seeded so every process builds the same one (only shapes matter)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(4, 6, 3, bias=False), nn.Conv2d(6, 5, 3, bias=False), Conv1D(12, 5),
                         nn.Linear(12, 7, bias=False), nn.Linear(7, 3, bias=False), nn.Conv2d(5, 1, 1, bias=False))


def grad_for(shape, index: int, step: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 * index + step))


def train(model: nn.Module, opt: Muon, layout=None) -> None:
    """STEPS steps on generated full gradients (sharded like their parameter under ``layout``)."""
    from torch.distributed.tensor import distribute_tensor

    for step in range(STEPS):
        for i, p in enumerate(model.parameters()):
            g = grad_for(p.shape, i, step)
            p.grad = g if layout is None else distribute_tensor(g, p.device_mesh, p.placements)
        opt.step()


def single_process() -> dict[str, torch.Tensor]:
    model = build_model()
    train(model, Muon(muon_param_groups(model, conv="muon"), **HYPER))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def fsdp_views() -> dict:
    from torch.distributed.fsdp import fully_shard

    from muonlab.distributed import build_mesh

    model = build_model()
    fully_shard(model, mesh=build_mesh())
    opt = Muon(muon_param_groups(model, conv="muon"), **HYPER)
    train(model, opt, layout="fsdp")
    stats = opt.last_step_stats()
    sent, recv = bytes_for_rank(opt.plan(), dist.get_rank())
    return dict(params={n: full(p) for n, p in model.named_parameters()},
                plan=[(b.path, b.names, b.owners, b.bytes_sent, b.flops) for b in opt.plan()],
                shapes={b.names: (b.matrix_shape, b.num_matrices) for b in opt.plan()},
                sent=stats["bytes_sent"], recv=stats["bytes_recv"], plan_sent=sent, plan_recv=recv)
