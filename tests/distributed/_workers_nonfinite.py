"""Worker for test_nonfinite_distributed.py: muonlab.optim.nonfinite on DTensor grads."""

from __future__ import annotations

import torch
import torch.distributed as dist

from muonlab.optim import nonfinite


def check_dtensor_grads():
    """DTensor grads (Shard(0), uneven and empty shards, fp32 and bf16): the last rank plants a
    non-finite value in one grad's shard; every rank learns the rank, only that rank the name."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    shapes = [(10, 4), (2, 3), (world * 2 + 1, 5), (7, 7)]
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        fulls = [torch.randn(s, generator=torch.Generator().manual_seed(i)).to(dtype) for i, s in enumerate(shapes)]
        grads = [distribute_tensor(f, mesh, [Shard(0)]) for f in fulls]
        names = [f"g{i}" for i in range(len(grads))]
        out[f"clean_{dtype}"] = nonfinite.start(grads, dist.group.WORLD, names.__getitem__).result()
        if rank == world - 1:
            grads[2].to_local().view(-1)[-1] = float("nan")
        out[f"nan_{dtype}"] = nonfinite.start(grads, dist.group.WORLD, names.__getitem__).result()
    # a subgroup of the first and last ranks: ranks come back as global ranks
    sub = dist.new_group([0, world - 1])
    if rank in (0, world - 1):
        g = torch.ones(3)
        if rank == world - 1:
            g[1] = float("-inf")
        out["subgroup"] = nonfinite.start([g], sub).result()
    return out
