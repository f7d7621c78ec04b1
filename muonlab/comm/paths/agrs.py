"""The ``agrs`` path: all-gather out, owner-scatter back, for a remainder batch of k < W matrices.

Out: every rank's rows of all k matrices are all-gathered (one collective that NCCL runs at ring
bandwidth; XTuner's FSDP2 Muon uses it for remainders). Each rank then holds every matrix but
orthogonalizes only its own share (matrix i on its owner; an owner may own several, as on
``all_to_all``). Back: the owners send each rank its rows of the results, as in ``all_to_all`` (a
reduce-scatter of mostly-zero buffers would move W x more).
The gather moves more bytes than ``all_to_all`` (every rank receives every matrix); the planner
weighs that against its cheaper collective.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..collectives import all_gather, pack
from .all_to_all import back_bytes, my_rows, owned_positions, owner_counts, send_back
from .base import CommPath, Itemsizes, Phases


def bytes_per_rank(rows: Sequence[int], cols: int, owners: Sequence[int], itemsize: int):
    """(sent, recv) per group rank. Out: all-gather of every rank's rows of all k matrices;
    back: as all_to_all (``owners`` may repeat)."""
    size, k = len(rows), len(owners)
    chunks = [r * cols * itemsize for r in rows]
    total = sum(chunks)
    sent = [(size - 1) * k * c for c in chunks]
    recv = [k * (total - c) for c in chunks]
    for q, (c, m) in enumerate(zip(chunks, owner_counts(owners, size))):  # the way back, as all_to_all's
        sent[q] += m * (total - c)
        recv[q] += c * (k - m)
    return sent, recv


def run(batch, inputs, ctx):
    rows, cols, me = batch.rows, batch.matrix_shape[1], ctx.group_rank
    k, mine = len(inputs), owned_positions(batch, me)
    send = pack(inputs, ctx.wire_dtype, like=inputs[0])
    sizes = [k * r * cols for r in rows]
    flat = yield all_gather(send, sizes, group=ctx.group, group_rank=me)
    mats = None
    if mine:
        # each source's rows of this rank's matrices, side by side: (m, A, B) in batch order
        blocks = [seg.view(k, r, cols)[mine] for seg, r in zip(flat.split(sizes), rows)]
        mats = torch.cat(blocks, dim=1)
    ortho = yield mats
    returned = yield send_back(batch, inputs, ortho, ctx)
    return my_rows(batch, inputs, returned, me)


def buffer_bytes(batch, sizes: Itemsizes) -> list[Phases]:
    """Per group rank: out, the packed send buffer (the input itself for one matrix already in the
    wire dtype), its copy per rank where shards are uneven (``all_gather``), every matrix
    received; then the owned blocks put together, Newton-Schulz's output and the way back's
    buffers (as all_to_all's). The outputs are views."""
    rows, (A, B), w, k = batch.rows, batch.matrix_shape, sizes.wire, len(batch.owners)
    c, uneven = sizes.ns or w, len(set(rows)) > 1
    out = []
    for r, m in zip(rows, owner_counts(batch.owners, len(rows))):
        send = 0 if k == 1 and sizes.momentum == w else k * r * B * w
        send += len(rows) * k * r * B * w if uneven else 0
        compute = m * A * B * (w + c) + back_bytes(m, A * B, r * B, k, c, w)
        out.append(Phases(send + k * A * B * w, compute, 0))
    return out


PATH = CommPath(name="agrs", collectives=2, out_share=0.5, color="#ff7f0e", run=run, buffer_bytes=buffer_bytes)
