"""The ``all_to_all`` path: row-sharded matrices, each gathered whole on one owner rank and back.

Batch of k <= W same-shape 2-D matrices, matrix i owned by rank o_i (distinct). Out: every rank
sends its rows of matrix i to o_i, in one all_to_all_single whose split sizes follow the uneven
(torch.chunk) shards, so no padding travels. The owner stacks the row blocks into the whole
matrix and orthogonalizes it. Back: the owner sends each rank its rows of the result.
Bytes: each matrix crosses the wire once out and once back, minus the owner's own rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..collectives import Pending, all_to_all, pack
from .base import CommPath


def bytes_per_rank(rows: Sequence[int], cols: int, owners: Sequence[int], itemsize: int):
    """(sent, recv) per group rank. Out: each rank sends its rows of matrix i to owner i; back:
    owner i returns each rank's rows.

    With chunk_q = rows[q] * cols * itemsize, T = sum of chunks and K distinct owners, rank q sends
    chunk_q to every owner but itself on the way out, and an owner sends T - chunk_o back (and
    receives as much on the way out): closed forms, so a 2048-rank batch costs O(W).
    """
    owned = set(owners)
    chunks = [r * cols * itemsize for r in rows]
    total, k = sum(chunks), len(owned)
    sent = [c * (k - (q in owned)) + ((total - c) if q in owned else 0) for q, c in enumerate(chunks)]
    return sent, list(sent)


def my_matrix(batch, group_rank: int) -> int | None:
    """Which matrix of the batch this rank owns (at most one), by position."""
    return batch.owners.index(group_rank) if group_rank in batch.owners else None


def send_back(batch, inputs, ortho, ctx) -> Pending:
    """Owners send each rank its rows of the result (this path's way back, shared by agrs)."""
    rows, cols, me = batch.rows, batch.matrix_shape[1], ctx.group_rank
    size = len(rows)
    if ortho is not None:
        send = ortho.to(ctx.wire_dtype).reshape(-1)
        send_splits = [rows[q] * cols for q in range(size)]
    else:
        send = inputs[0].new_empty(0, dtype=ctx.wire_dtype)
        send_splits = [0] * size
    owners = set(batch.owners)
    recv_splits = [rows[me] * cols if q in owners else 0 for q in range(size)]
    return all_to_all(send, send_splits, recv_splits, group=ctx.group, group_rank=me)


def my_rows(batch, inputs, flat: torch.Tensor, group_rank: int) -> list[torch.Tensor]:
    """This rank's rows of every matrix, from the way back's buffer."""
    # received blocks arrive in source-rank order, i.e. in owner-rank order
    n = batch.rows[group_rank] * batch.matrix_shape[1]  # may be 0: an empty trailing shard
    per_owner = {o: flat[k * n:(k + 1) * n] for k, o in enumerate(sorted(set(batch.owners)))}
    return [per_owner[o].view(x.shape) for o, x in zip(batch.owners, inputs)]


def run(batch, inputs, ctx):
    rows, cols, me = batch.rows, batch.matrix_shape[1], ctx.group_rank
    size, mine = len(rows), my_matrix(batch, me)
    by_owner = dict(zip(batch.owners, inputs))
    send = pack([by_owner[q] for q in range(size) if q in by_owner], ctx.wire_dtype, like=inputs[0])
    send_splits = [rows[me] * cols if q in by_owner else 0 for q in range(size)]
    recv_splits = [rows[q] * cols if mine is not None else 0 for q in range(size)]
    flat = yield all_to_all(send, send_splits, recv_splits, group=ctx.group, group_rank=me)
    ortho = yield flat.view(1, *batch.matrix_shape) if mine is not None else None
    returned = yield send_back(batch, inputs, ortho, ctx)
    return my_rows(batch, inputs, returned, me)


PATH = CommPath(name="all_to_all", collectives=2, out_share=0.5, color="#1f77b4", run=run)
