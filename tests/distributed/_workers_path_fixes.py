"""Workers for test_path_fixes.py: the rebalance path's results on ranks where some matrices moved."""

from __future__ import annotations

import torch
import torch.distributed as dist

from muonlab import Muon

from ._common import full

BANKS = [("ba", (9, 24, 32)), ("bb", (6, 24, 32))]
"""Shard(0) over 4 ranks: 3, 3, 3, 0 and 2, 2, 2, 0 experts; the planner moves some to rank 3."""
SETTINGS = dict(lr=0.02, momentum=0.9, ns_dtype=torch.float32, ns_form="plain")


def _start(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _grad(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 + seed))


def rebalanced_banks_against_one_process() -> dict:
    """One step with bf16 on the wire; per bank, which matrices moved and which differ from the
    step of whole banks (fp32 throughout)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    params = [(n, torch.nn.Parameter(distribute_tensor(_start(s, i), mesh, [Shard(0)])))
              for i, (n, s) in enumerate(BANKS)]
    opt = Muon(params, comm_dtype=torch.bfloat16, **SETTINGS)
    for i, (n, p) in enumerate(params):
        p.grad = distribute_tensor(_grad(p.shape, i), mesh, [Shard(0)])
    opt.step()
    moved = {n: set() for n, _ in BANKS}
    for b in opt.plan():
        for pos, k, _, _ in b.moves:
            moved[b.names[pos]].add(k)
    after = {n: full(p) for n, p in params}
    # the reference: whole banks on every rank (in a process group plain tensors are replicas; an
    # fp32 wire leaves their updates exact), so it steps as one process does
    alone = [(n, torch.nn.Parameter(_start(s, i))) for i, (n, s) in enumerate(BANKS)]
    ref = Muon(alone, comm_dtype=torch.float32, **SETTINGS)
    for i, (n, p) in enumerate(alone):
        p.grad = _grad(p.shape, i)
    ref.step()
    differ = {n: sorted(int(k) for k in ((after[n] - p.detach()).abs().amax(dim=(1, 2)) > 0).nonzero().flatten())
              for n, p in alone}
    return dict(paths=[b.path for b in opt.plan()], moved={n: sorted(v) for n, v in moved.items()}, differ=differ)
