"""The ``blocks`` path: a fused bank whose matrices straddle the row shards.

A 2-D parameter (E*M, N) declared as E blocks of M rows (``Muon(fused_banks=...)``: experts fused
on dim 0, a fused QKV projection, one block per attention head) and row-sharded by FSDP2 as
``torch.chunk`` splits it can have blocks cut by shard boundaries: a (3C, C) QKV of 2 heads on 2
ranks holds 18 of its 36 rows on each, so the second of its six (6, 24) blocks is cut in half.
When every block lies on one rank (layout "whole") or each spans an equal sub-group ("subgroup")
another path applies; this one takes every other row split.

Each block is orthogonalized on ONE owner: the rank holding most of its rows (a block wholly on
one rank stays there). Out: every rank sends its pieces of the blocks others own to their owners,
in one all_to_all_single with uneven splits (no padding); each owner puts its blocks together,
pieces in rank order, and orthogonalizes them as one (k, M, N) stack. Back: each owner sends
every rank its rows of the results, in one more all_to_all_single.

Bytes: a block of pieces p_1..p_h (rows) moves 2 (M - max p) rows, out and back: the least any
plan moves for it (``muonlab.simulate.lower_bound_bytes``; gathering it on every rank holding a
piece would move h - 1 blocks, never less). The padded gather this replaces (``gather_all``) moved
the whole parameter to every rank and orthogonalized every block everywhere.

Order on the wire: in each buffer a rank's blocks go parameter by parameter, block by block
(``BatchPlan.owners`` holds one owner per block in that order), so every rank finds each piece
from the plan alone, with no index travelling with it.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence

import torch

from ..collectives import all_to_all, pack
from ..specs import GroupKey
from .base import CommPath, Itemsizes, Phases

Piece = tuple[int, int, int]
"""(group rank, first row of the piece in that rank's shard, rows)."""


def block_pieces(rows: Sequence[int], num_blocks: int) -> list[list[Piece]]:
    """For each of the ``num_blocks`` blocks of a parameter whose dim 0 is split ``rows`` per rank,
    its pieces in rank order: (rank, first row in that rank's shard, rows), empty pieces left out."""
    total = sum(rows)
    M = total // num_blocks
    starts = list(itertools.accumulate(rows, initial=0))
    out = []
    for e in range(num_blocks):
        lo, hi = e * M, (e + 1) * M
        out.append([(q, max(lo, starts[q]) - starts[q], min(hi, starts[q + 1]) - max(lo, starts[q]))
                    for q in range(len(rows)) if min(hi, starts[q + 1]) > max(lo, starts[q])])
    return out


def largest_holders(pieces: list[Piece]) -> list[int]:
    """The ranks holding the most rows of a block (an owner among them moves the fewest bytes)."""
    most = max(n for _, _, n in pieces)
    return [q for q, _, n in pieces if n == most]


def bytes_per_rank(rows: Sequence[int], cols: int, num_blocks: int, owners: Sequence[int], itemsize: int):
    """(sent, recv) per group rank for a batch whose parameters (``len(owners) // num_blocks`` of
    them) share ``rows``: a rank sends its piece of each block another rank owns, and the owner of
    a block sends every other holder its piece back; it receives the mirror image, so the two
    lists are equal."""
    pieces = block_pieces(rows, num_blocks)
    sent = [0] * len(rows)
    for k, owner in enumerate(owners):
        for q, _, n in pieces[k % num_blocks]:
            if q != owner:
                sent[q] += n * cols * itemsize  # out: q's piece to the owner
                sent[owner] += n * cols * itemsize  # back: the owner returns it
    return sent, list(sent)


def run(batch, inputs, ctx):
    rows, N, me = batch.rows, batch.matrix_shape[1], ctx.group_rank
    size, E = len(rows), batch.num_matrices // len(inputs)
    pieces = block_pieces(rows, E)
    blocks = [(p, e, batch.owners[p * E + e]) for p in range(len(inputs)) for e in range(E)]
    mine = {e: (lo, n) for e, ps in enumerate(pieces) for q, lo, n in ps if q == me}
    # out: to each owner, my pieces of its blocks, in block order
    to_owner: list[list[torch.Tensor]] = [[] for _ in range(size)]
    for p, e, o in blocks:
        if e in mine:
            lo, n = mine[e]
            to_owner[o].append(inputs[p][lo:lo + n])
    owned = [(p, e) for p, e, o in blocks if o == me]
    recv_splits = [sum(n for p, e in owned for q, _, n in pieces[e] if q == src) * N for src in range(size)]
    send = pack([t for ts in to_owner for t in ts], ctx.wire_dtype, like=inputs[0])
    flat = yield all_to_all(send, [sum(t.numel() for t in ts) for ts in to_owner], recv_splits,
                            group=ctx.group, group_rank=me)
    # the buffer holds, source rank by source rank, its pieces of my blocks in block order
    parts: dict[tuple[int, int], list[torch.Tensor]] = {b: [] for b in owned}
    offset = 0
    for src in range(size):
        for p, e in owned:
            for q, _, n in pieces[e]:
                if q == src:
                    parts[(p, e)].append(flat[offset:offset + n * N].view(n, N))
                    offset += n * N
    stack = torch.stack([torch.cat(parts[b]) for b in owned]) if owned else None
    del parts, flat
    ortho = yield stack
    # back: to each holder, its rows of my results, in block order
    to_holder: list[list[torch.Tensor]] = [[] for _ in range(size)]
    for k, (p, e) in enumerate(owned):
        start = 0
        for q, _, n in pieces[e]:
            to_holder[q].append(ortho[k, start:start + n])
            start += n
    back_splits = [sum(mine[e][1] for _, e, o in blocks if o == src and e in mine) * N for src in range(size)]
    send = pack([t for ts in to_holder for t in ts], ctx.wire_dtype, like=inputs[0])
    returned = yield all_to_all(send, [sum(t.numel() for t in ts) for ts in to_holder], back_splits,
                                group=ctx.group, group_rank=me)
    # owner by owner, each owner's blocks in block order: my piece of each
    got: dict[tuple[int, int], torch.Tensor] = {}
    offset = 0
    for src in range(size):
        for p, e, o in blocks:
            if o == src and e in mine:
                n = mine[e][1]
                got[(p, e)] = returned[offset:offset + n * N].view(n, N)
                offset += n * N
    outputs = []
    for p, x in enumerate(inputs):
        mine_p = [got[(p, e)] for e in sorted(mine)]
        outputs.append(torch.cat(mine_p).view(x.shape) if mine_p else returned.new_empty(x.shape))
    return outputs


def buffer_bytes(batch, sizes: Itemsizes) -> list[Phases]:
    """Per group rank: out, its packed pieces (the input's rows themselves where it holds one piece
    of one parameter in the wire dtype) and its owned blocks' pieces received; then those blocks
    stacked, Newton-Schulz's output, the way back's packed pieces (a view for one piece of one
    result in the wire dtype) and its rows received; after it, each parameter's rows joined."""
    rows, (M, N), w, n = batch.rows, batch.matrix_shape, sizes.wire, len(batch.param_indices)
    E, c = batch.num_matrices // n, sizes.ns or w
    pieces = block_pieces(rows, E)
    held = [0] * len(rows)  # pieces a rank holds of one parameter
    for ps in pieces:
        for q, _, _ in ps:
            held[q] += 1
    owned, back_pieces = [0] * len(rows), [0] * len(rows)
    for k, o in enumerate(batch.owners):
        owned[o] += 1
        back_pieces[o] += len(pieces[k % E])
    out = []
    for r, h, o, b in zip(rows, held, owned, back_pieces):
        send = 0 if n * h == 1 and sizes.momentum == w else n * r * N * w
        back = 0 if b == 1 and c == w else o * M * N * w
        out.append(Phases(send + o * M * N * w, o * M * N * (w + c) + back + n * r * N * w, n * r * N * w))
    return out


def plan_bucket(planner, group: GroupKey, idx: list[int]) -> None:
    """The batches of a bucket of layout "blocks": each block on the rank holding most of its rows,
    the fewest bytes it can move (ties: the least loaded rank so far), the bucket as one batch, cut
    where an owner's blocks would exceed the workspace budget (``planner.max_local_matrices``)."""
    size, first = group.size, planner.specs[idx[0]]
    E, shape = first.num_fused, first.matrix_shape
    pieces = block_pieces(first.rows, E)
    f, load = planner.flops_of(idx[0]), planner.loads.view(group)
    owners: dict[int, list[int]] = {}
    for i in idx:
        owners[i] = []
        for ps in pieces:
            o = min(largest_holders(ps), key=lambda r: (load[r], r))
            owners[i].append(o)
            load.add(o, f)
    runs = [idx]
    if planner.max_local_matrices is not None:
        limit = max(1, planner.max_local_matrices(shape, planner.configs[idx[0]]))
        runs, held = [[]], Counter()
        for i in idx:
            mine = Counter(owners[i])
            if runs[-1] and any(held[o] + n > limit for o, n in mine.items()):
                runs.append([])
                held = Counter()
            runs[-1].append(i)
            held.update(mine)
    for run in runs:
        own = [o for i in run for o in owners[i]]
        flops = [0] * size
        for o in own:
            flops[o] += f
        sent, recv = bytes_per_rank(first.rows, shape[1], E, own, planner.itemsize_of(idx[0]))
        planner.batches.append(planner.make("blocks", run, group, range(size), own, sent, recv, flops,
                                            notes=f"{E} blocks of {shape[0]} rows each, cut by the shards"))


PATH = CommPath(name="blocks", collectives=2, out_share=0.5, color="#98df8a", run=run, plans_layout="blocks",
                plan_bucket=plan_bucket, buffer_bytes=buffer_bytes)
