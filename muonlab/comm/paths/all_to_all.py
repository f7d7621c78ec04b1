"""The ``all_to_all`` path: row-sharded matrices, each gathered whole on one owner rank and back.

A batch holds same-shape 2-D matrices, matrix i owned by rank o_i; an owner may own several (a
"megabatch", as dion's Muon sends one all-to-all per direction per same-shape group), so a bucket
of same-shape matrices travels in one collective each way however many matrices it holds. Out:
every rank sends its rows of each matrix to that matrix's owner, in one all_to_all_single whose
split sizes follow the uneven (torch.chunk) shards, so no padding travels. Each owner stacks the
row blocks into its whole matrices and orthogonalizes them as one (m, A, B) stack. Back: each
owner sends every rank its rows of the results.

Order on the wire: a rank's send buffer holds the owners' matrices owner by owner, each owner's
in batch order (``owner_order``); an owner's matrices keep that order in its stack and on the way
back, so every rank finds each block without any index travelling with it.

Bytes: each matrix crosses the wire once out and once back, minus the owner's own rows.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from ..collectives import Pending, all_to_all, pack
from .base import CommPath, Itemsizes, Phases


def owner_counts(owners: Sequence[int], size: int) -> list[int]:
    """Matrices each group rank owns in a batch (0 for most ranks of a small batch)."""
    counts = [0] * size
    for o in owners:
        counts[o] += 1
    return counts


def bytes_per_rank(rows: Sequence[int], cols: int, owners: Sequence[int], itemsize: int):
    """(sent, recv) per group rank. Out: each rank sends its rows of matrix i to owner i; back:
    owner i returns each rank's rows. ``owners`` may repeat (an owner of several matrices).

    With chunk_q = rows[q] * cols * itemsize, T = sum of chunks, n matrices and m_q of them owned
    by rank q: rank q sends chunk_q for each of the n - m_q matrices it does not own on the way
    out, and T - chunk_q for each of its m_q on the way back; it receives as much (the mirror
    image): closed forms, so a 2048-rank batch costs O(W + n).
    """
    chunks = [r * cols * itemsize for r in rows]
    total, n = sum(chunks), len(owners)
    counts = owner_counts(owners, len(rows))
    sent = [c * (n - m) + m * (total - c) for c, m in zip(chunks, counts)]
    return sent, list(sent)


def owned_positions(batch, group_rank: int) -> list[int]:
    """Positions in the batch of the matrices this rank orthogonalizes, in batch order."""
    return [pos for pos, o in enumerate(batch.owners) if o == group_rank]


def owner_order(batch) -> list[int]:
    """The batch's positions owner by owner (each owner's in batch order): the order matrices
    take in a send buffer on the way out and in a receive buffer on the way back."""
    return sorted(range(len(batch.owners)), key=batch.owners.__getitem__)


def whole_matrices(flat: torch.Tensor, rows: Sequence[int], num_owned: int, shape) -> torch.Tensor | None:
    """An owner's (num_owned, A, B) stack from the way out's buffer, which holds each source
    rank's rows of all its matrices in turn (None for a rank that owns none)."""
    if not num_owned:
        return None
    if num_owned == 1:  # the source blocks follow one another as the matrix's rows: no copy
        return flat.view(1, *shape)
    cols = shape[1]
    segments = flat.split([num_owned * r * cols for r in rows])
    return torch.cat([seg.view(num_owned, r, cols) for seg, r in zip(segments, rows)], dim=1)


def send_back(batch, inputs, ortho, ctx) -> Pending:
    """Owners send each rank its rows of their results (this path's way back, shared by agrs).
    ``ortho``: this rank's (m, A, B) results in batch order (None: it owns none)."""
    rows, cols, me = batch.rows, batch.matrix_shape[1], ctx.group_rank
    size = len(rows)
    owned = len(ortho) if ortho is not None else 0
    if owned == 1:
        send = ortho.to(ctx.wire_dtype).reshape(-1)  # its rows already lie rank by rank
    elif owned:
        # destination-major: every rank's rows of all this owner's matrices, one rank after another
        bounds = list(itertools.accumulate(rows, initial=0))
        send = pack([ortho[:, lo:hi] for lo, hi in zip(bounds, bounds[1:])], ctx.wire_dtype, like=ortho)
    else:
        send = inputs[0].new_empty(0, dtype=ctx.wire_dtype)
    send_splits = [owned * rows[q] * cols for q in range(size)]
    counts = owner_counts(batch.owners, size)
    recv_splits = [counts[q] * rows[me] * cols for q in range(size)]
    return all_to_all(send, send_splits, recv_splits, group=ctx.group, group_rank=me, defer=ctx.defer)


def my_rows(batch, inputs, flat: torch.Tensor, group_rank: int) -> list[torch.Tensor]:
    """This rank's rows of every matrix, from the way back's buffer (``owner_order``: blocks
    arrive in source-rank order, i.e. owner by owner, each owner's in batch order)."""
    n = batch.rows[group_rank] * batch.matrix_shape[1]  # may be 0: an empty trailing shard
    slot = {pos: k for k, pos in enumerate(owner_order(batch))}
    return [flat[slot[pos] * n:(slot[pos] + 1) * n].view(x.shape) for pos, x in enumerate(inputs)]


def run(batch, inputs, ctx):
    rows, cols, me = batch.rows, batch.matrix_shape[1], ctx.group_rank
    size = len(rows)
    counts = owner_counts(batch.owners, size)
    send = pack([inputs[pos] for pos in owner_order(batch)], ctx.wire_dtype, like=inputs[0])
    send_splits = [counts[q] * rows[me] * cols for q in range(size)]
    recv_splits = [counts[me] * rows[q] * cols for q in range(size)]
    flat = yield all_to_all(send, send_splits, recv_splits, group=ctx.group, group_rank=me, defer=ctx.defer)
    ortho = yield whole_matrices(flat, rows, counts[me], batch.matrix_shape)
    returned = yield send_back(batch, inputs, ortho, ctx)
    return my_rows(batch, inputs, returned, me)


def back_bytes(owned: int, matrix: int, mine: int, n: int, c: int, w: int) -> int:
    """The way back's buffers (``send_back``) on a rank owning ``owned`` of ``n`` matrices of
    ``matrix`` elements, ``mine`` of each held here: its send buffer (a view of one result already
    in the wire dtype, a packed copy of several) and its receive buffer."""
    send = 0 if owned == 0 or (owned == 1 and c == w) else owned * matrix * w
    return send + n * mine * w


def buffer_bytes(batch, sizes: Itemsizes) -> list[Phases]:
    """Per group rank: out, the packed send buffer (the input itself for one matrix already in
    the wire dtype) and the owned matrices received; then the owned stack (a view of the receive
    buffer for one), Newton-Schulz's output and the way back's buffers. The outputs are views."""
    (A, B), w, n = batch.matrix_shape, sizes.wire, len(batch.owners)
    c = sizes.ns or w
    out = []
    for r, m in zip(batch.rows, owner_counts(batch.owners, len(batch.rows))):
        send = 0 if n == 1 and sizes.momentum == w else n * r * B * w
        compute = (m * A * B * w if m > 1 else 0) + m * A * B * c + back_bytes(m, A * B, r * B, n, c, w)
        out.append(Phases(send + m * A * B * w, compute, 0))
    return out


def wire_buffers(batch) -> list:
    """Per group rank ((out send, out receive), (back send, back receive)) elements."""
    (A, B), n = batch.matrix_shape, len(batch.owners)
    return [((n * r * B, m * A * B), (m * A * B, n * r * B))
            for r, m in zip(batch.rows, owner_counts(batch.owners, len(batch.rows)))]


PATH = CommPath(name="all_to_all", collectives=2, out_share=0.5, color="#1f77b4", run=run,
                waves=True, buffer_bytes=buffer_bytes, wire_buffers=wire_buffers)
