"""The ``owner`` path: replicated parameters (DDP), one owner rank per parameter.

Gradients are already identical on every rank, so nothing moves on the way out: the owner (chosen by
the plan, balancing Newton-Schulz FLOPs) keeps the momentum and orthogonalizes; the other ranks
skip both (a ZeRO-1 style saving). Back: the updates are all-gathered, and EVERY rank, the owner
included, applies the wire-dtype copy, so replicas stay bit-identical.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..collectives import all_gather
from .base import CommPath, Itemsizes, Phases


def gather_bytes(payload: Sequence[int]):
    """(sent, recv) per rank of an all-gather where rank q contributes payload[q] bytes."""
    size, total = len(payload), sum(payload)
    return [(size - 1) * p for p in payload], [total - p for p in payload]


def run(batch, inputs, ctx):
    me = ctx.group_rank
    mats = [x.reshape(-1, *batch.matrix_shape) for o, x in zip(batch.owners, inputs) if o == me]
    ortho = yield mats if mats else None  # pieces: read into the workspace without a stacked copy
    sizes = [0] * len(batch.bytes_sent)
    for o, n in zip(batch.owners, batch.param_numels):
        sizes[o] += n
    # a rank that owns nothing has no input to take a device from: the context says where
    send = (torch.empty(0, dtype=ctx.wire_dtype, device=ctx.device) if ortho is None
            else ortho.to(ctx.wire_dtype).reshape(-1))
    gathered = yield all_gather(send, sizes, group=ctx.group, group_rank=me)
    segments = list(gathered.split(sizes))
    offsets = [0] * len(segments)
    out = []
    for o, n, shape in zip(batch.owners, batch.param_numels, batch.param_shapes):
        out.append(segments[o][offsets[o]:offsets[o] + n].view(shape))
        offsets[o] += n
    return out


def buffer_bytes(batch, sizes: Itemsizes) -> list[Phases]:
    """Per group rank: the owner's matrices are views of its inputs; then Newton-Schulz's output,
    its wire-dtype copy (none where it is already in it), that copy once per rank where the
    owners' shares differ (``all_gather``), and every update gathered. The outputs are views."""
    size = len(batch.bytes_sent)
    c = sizes.ns or sizes.momentum
    owned = [0] * size
    for o, numel in zip(batch.owners, batch.param_numels):
        owned[o] += numel
    total, uneven = sum(owned), len(set(owned)) > 1
    out = []
    for mine in owned:
        send = mine * sizes.wire if c != sizes.wire else 0
        send += size * mine * sizes.wire if uneven else 0
        out.append(Phases(0, mine * c + send + total * sizes.wire, 0))
    return out


def state_homes(batch, group_rank: int) -> dict[int, tuple[int, bool]]:
    """Each parameter's momentum lives on its owner alone (the ZeRO-1 style saving)."""
    return {i: (o, o == group_rank) for i, o in zip(batch.param_indices, batch.owners)}


def least_bytes(batch, itemsize: int) -> float:
    """Every update reaches the W - 1 other replicas: (W - 1) of its bytes, summed over the ranks."""
    return (batch.group.size - 1) * sum(batch.param_numels) * itemsize


PATH = CommPath(name="owner", collectives=1, out_share=0.0, color="#2ca02c", run=run, state_homes=state_homes,
                least_bytes=least_bytes, buffer_bytes=buffer_bytes)
