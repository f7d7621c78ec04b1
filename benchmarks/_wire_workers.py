"""Worker of bench_wire_parity.py (a module of its own so spawned workers import it): the plan's
bytes of a matrix set on sharded DTensors, as ``Muon.plan()`` counts them, per comm_dtype."""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist

from muonlab import Muon


def plan_bytes(shapes: list[tuple[str, tuple[int, int]]], comm_dtypes: dict) -> dict:
    """{label: (total bytes of the plan, {wire dtype: batches})} of ``Muon(..., comm_dtype=value)``
    over Shard(0) DTensors of ``shapes`` on every rank (no step: a plan is made from metadata)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    params = [(name, torch.nn.Parameter(distribute_tensor(torch.zeros(shape), mesh, [Shard(0)])))
              for name, shape in shapes]
    out = {}
    for label, value in comm_dtypes.items():
        plan = Muon(params, **({} if value is None else dict(comm_dtype=value))).plan()
        kinds = Counter(str(b.wire_dtype).removeprefix("torch.") for b in plan)
        out[label] = (sum(b.total_bytes for b in plan), dict(kinds))
    return out
