"""The ``rebalance`` path: whole matrices orthogonalized where they lie, except a few moved.

When a layout leaves whole matrices unevenly spread (experts sharded on their expert dim over more
ranks than experts, or a bank that doesn't divide), the plan moves some matrices from overloaded
ranks to idle ones (``BatchPlan.moves``). Out: one all_to_all_single carries each moved matrix to
its owner; every rank orthogonalizes what it kept plus what it received, in one batched chain.
Back: the results return to the rank that holds the parameter.
"""

from __future__ import annotations

import torch

from ..collectives import all_to_all, pack
from .base import CommPath, Itemsizes, Phases


def bytes_per_rank(moves, size: int, matrix_bytes: int):
    """(sent, recv) per group rank: each moved matrix goes source -> owner and back."""
    sent, recv = [0] * size, [0] * size
    for _, _, src, owner in moves:
        for a, b in ((src, owner), (owner, src)):
            sent[a] += matrix_bytes
            recv[b] += matrix_bytes
    return sent, recv


def _splits(moves, size: int, numel: int, rank_of) -> list[int]:
    counts = [0] * size
    for m in moves:
        counts[rank_of(m)] += numel
    return counts


def run(batch, inputs, ctx):
    me, size, shape = ctx.group_rank, len(batch.bytes_sent), batch.matrix_shape
    numel, wire = shape[0] * shape[1], ctx.wire_dtype
    local = [x.reshape(-1, *shape) for x in inputs]
    # the matrices of each parameter held here, and each one's slot among them
    held = [[j for j, s in enumerate(src) if s == me] for src in batch.sources]
    slot = {(pos, j): k for pos, js in enumerate(held) for k, j in enumerate(js)}
    # moves in plan order, split by direction; the order is the same on sender and receiver
    outgoing = sorted((m for m in batch.moves if m[2] == me), key=lambda m: m[3])
    incoming = sorted((m for m in batch.moves if m[3] == me), key=lambda m: m[2])
    to_owner, from_source = (lambda m: m[3]), (lambda m: m[2])
    send = pack([local[pos][slot[(pos, j)]] for pos, j, _, _ in outgoing], wire, like=inputs[0])
    received = yield all_to_all(send, _splits(outgoing, size, numel, to_owner),
                                _splits(incoming, size, numel, from_source), group=ctx.group, group_rank=me)
    received = received.view(-1, *shape)
    moved_out = {(pos, j) for pos, j, _, _ in outgoing}
    kept = [local[pos][k] for pos, js in enumerate(held) for k, j in enumerate(js) if (pos, j) not in moved_out]
    mats = _stack(kept + list(received), local[0].dtype)
    ortho = yield mats
    theirs = ortho[len(kept):] if ortho is not None else None
    send = theirs.reshape(-1).to(wire) if theirs is not None and theirs.numel() else inputs[0].new_empty(0, dtype=wire)
    returned = yield all_to_all(send, _splits(incoming, size, numel, from_source),
                                _splits(outgoing, size, numel, to_owner), group=ctx.group, group_rank=me)
    returned = returned.view(-1, *shape)
    from_owner = {(pos, j): returned[k] for k, (pos, j, _, _) in enumerate(outgoing)}
    # one dtype for all of a rank's results, the Newton-Schulz output's where it ran any: cast to the
    # first result's, a kept matrix was rounded to the wire dtype whenever a neighbour had moved
    out_dtype = ortho.dtype if ortho is not None else wire
    out, num_kept = [], 0
    for pos, (x, js) in enumerate(zip(inputs, held)):
        result = []
        for j in js:
            if (pos, j) in from_owner:
                result.append(from_owner[(pos, j)])
            else:
                result.append(ortho[num_kept])
                num_kept += 1
        out.append(_stack(result, out_dtype).view(x.shape) if result else x.new_zeros(x.shape))
    return out


def _stack(mats: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor | None:
    """``mats`` stacked in ``dtype``, each cast and copied once into its slot (None for none); one
    matrix already in ``dtype`` and contiguous is a view of itself."""
    if not mats:
        return None
    if len(mats) == 1 and mats[0].dtype == dtype and mats[0].is_contiguous():
        return mats[0].unsqueeze(0)
    out = mats[0].new_empty((len(mats), *mats[0].shape), dtype=dtype)
    for slot, m in zip(out, mats):
        slot.copy_(m)
    return out


def buffer_bytes(batch, sizes: Itemsizes) -> list[Phases]:
    """Per group rank: out, the matrices it sends packed (the input's matrix itself for one in the
    wire dtype) and those it receives; then its kept and received matrices stacked in the
    momentum's dtype (a view for one such matrix), Newton-Schulz's output, the received ones'
    results cast to the wire dtype (a view already in it) and its moved matrices' results
    received; after it, each parameter's results joined (a view for one in the output dtype)."""
    size, (A, B) = len(batch.bytes_sent), batch.matrix_shape
    mat, w, mi = A * B, sizes.wire, sizes.momentum
    c = sizes.ns or mi
    outgoing, incoming = [0] * size, [0] * size
    moved = {}  # (position, matrix) -> source rank
    for pos, j, src, owner in batch.moves:
        outgoing[src] += 1
        incoming[owner] += 1
        moved[(pos, j)] = src
    held = [[0] * len(batch.sources) for _ in range(size)]
    singles = [[None] * len(batch.sources) for _ in range(size)]  # a lone matrix: moved away?
    for pos, src in enumerate(batch.sources):
        for j, s in enumerate(src):
            held[s][pos] += 1
            singles[s][pos] = (pos, j) in moved
    out = []
    for r in range(size):
        o, i = outgoing[r], incoming[r]
        send = 0 if o == 1 and mi == w else o * mat * w
        total = sum(held[r]) - o + i  # matrices orthogonalized here
        one_received = total == 1 and i == 1
        stack = 0 if total == 0 or (total == 1 and (not one_received or w == mi)) else total * mat * mi
        back = 0 if i == 0 or c == w else i * mat * w
        out_item = c if total else w
        finish = 0
        for h, away in zip(held[r], singles[r]):
            if h > 1:
                finish += h * mat * out_item
            elif h == 1 and (w if away else c) != out_item:
                finish += mat * out_item
        out.append(Phases(send + i * mat * w, stack + total * mat * c + back + o * mat * w, finish))
    return out


PATH = CommPath(name="rebalance", collectives=2, out_share=0.5, color="#17becf", run=run,
                buffer_bytes=buffer_bytes)
