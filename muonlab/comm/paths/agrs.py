"""The ``agrs`` path: all-gather out, owner-scatter back, for a remainder batch of k < W matrices.

Out: every rank's rows of all k matrices are all-gathered (one collective that NCCL runs at ring
bandwidth; XTuner's FSDP2 Muon uses it for remainders). Each rank then holds every matrix but
orthogonalizes only its own share (matrix i on its owner). Back: the owner sends each rank its rows
of the result, as in ``all_to_all`` (a reduce-scatter of mostly-zero buffers would move W x more).
The gather moves more bytes than ``all_to_all`` (every rank receives every matrix); the planner
weighs that against its cheaper collective.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..collectives import all_gather, pack
from .all_to_all import my_matrix, my_rows, send_back
from .base import CommPath


def bytes_per_rank(rows: Sequence[int], cols: int, owners: Sequence[int], itemsize: int):
    """(sent, recv) per group rank. Out: all-gather of every rank's rows of all k matrices;
    back: as all_to_all."""
    size, k = len(rows), len(owners)
    owned = set(owners)
    chunks = [r * cols * itemsize for r in rows]
    total = sum(chunks)
    sent = [(size - 1) * k * c for c in chunks]
    recv = [k * (total - c) for c in chunks]
    for q, c in enumerate(chunks):  # the way back: owners return each rank its rows
        if q in owned:
            sent[q] += total - c
        recv[q] += c * (len(owned) - (q in owned))
    return sent, recv


def run(batch, inputs, ctx):
    rows, cols, me = batch.rows, batch.matrix_shape[1], ctx.group_rank
    k, mine = len(inputs), my_matrix(batch, me)
    send = pack(inputs, ctx.wire_dtype, like=inputs[0])
    sizes = [k * r * cols for r in rows]
    flat = yield all_gather(send, sizes, group=ctx.group, group_rank=me)
    mats = None
    if mine is not None:
        blocks = [seg.view(k, r, cols)[mine] for seg, r in zip(flat.split(sizes), rows)]
        mats = torch.cat(blocks).view(1, *batch.matrix_shape)
    ortho = yield mats
    returned = yield send_back(batch, inputs, ortho, ctx)
    return my_rows(batch, inputs, returned, me)


PATH = CommPath(name="agrs", collectives=2, out_share=0.5, color="#ff7f0e", run=run)
