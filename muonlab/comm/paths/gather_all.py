"""The ``gather_all`` path: a single-axis shard gathered whole on every rank, by a padded all-gather.

No placement takes it any more (a Shard(dim > 0) on one axis, a row-wise Linear alone, takes
``pieces``: owner compute at the byte bound). It serves the planner's "redundant" strategy, the
baseline every distributed Muon is measured against, which sends row-sharded matrices here. Every
rank pads its shard to the largest chunk, all-gathers, trims, orthogonalizes the WHOLE matrix
(redundantly), and keeps its own slice.
"""

from __future__ import annotations

import math

import torch

from ..collectives import all_gather
from ..specs import GroupKey
from .base import CommPath, Itemsizes, Phases
from .owner import gather_bytes


def bytes_per_rank(shape: tuple[int, ...], shard_dim: int, size: int, itemsize: int):
    """(sent, recv) per group rank: every rank contributes its shard padded to the largest."""
    dim_size = shape[shard_dim]
    padded = -(-dim_size // size) * (math.prod(shape) // max(dim_size, 1)) * itemsize
    return gather_bytes([padded] * size)


def run(batch, inputs, ctx):
    (x,) = inputs
    me, dim, rows = ctx.group_rank, batch.shard_dim, batch.rows
    step = max(rows)
    pad = [0, 0] * (x.ndim - 1 - dim) + [0, step - x.shape[dim]]
    padded = torch.nn.functional.pad(x.to(ctx.wire_dtype), pad)
    gathered = yield all_gather(padded.reshape(-1), [padded.numel()] * len(rows), group=ctx.group, group_rank=me)
    parts = [seg.view(padded.shape).narrow(dim, 0, r) for seg, r in zip(gathered.split(padded.numel()), rows)]
    ortho = yield torch.cat(parts, dim=dim).reshape(-1, *batch.matrix_shape)
    full = ortho.reshape(batch.param_shapes[0])
    return [full.narrow(dim, sum(rows[:me]), rows[me])]


def buffer_bytes(batch, sizes: Itemsizes) -> list[Phases]:
    """Per group rank: its padded shard, every rank's gathered, the trimmed whole matrix and
    Newton-Schulz's output. No way back: the output is a view of it."""
    shape, dim, rows, w = batch.param_shapes[0], batch.shard_dim, batch.rows, sizes.wire
    numel = math.prod(shape)
    padded = max(rows) * (numel // max(shape[dim], 1))
    phases = Phases((1 + len(rows)) * padded * w, numel * (w + (sizes.ns or w)), None)
    return [phases] * len(rows)


def plan_bucket(planner, group: GroupKey, idx: list[int]) -> None:
    """A batch per parameter of a bucket of layout "gather_all" (the "redundant" strategy's
    row-sharded matrices): every rank gathers it and computes it."""
    size = group.size
    for i in idx:
        spec = planner.specs[i]
        sent, recv = bytes_per_rank(spec.shape, spec.shard_dim, size, planner.itemsize_of(i))
        planner.batches.append(planner.make(
            "gather_all", [i], group, range(size), sent=sent, recv=recv,
            flops=[planner.flops_of(i) * spec.num_matrices] * size,
            notes=f"redundant, Shard({spec.shard_dim}): padded all-gather, every rank computes it"))


PATH = CommPath(name="gather_all", collectives=1, out_share=1.0, color="#d62728", run=run,
                plans_layout="gather_all", plan_bucket=plan_bucket, buffer_bytes=buffer_bytes)
