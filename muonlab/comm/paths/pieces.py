"""The ``pieces`` path: tensors sharded on several mesh axes (tensor parallel with FSDP2), each
gathered whole on one owner rank of the flattened group and its update's pieces sent back.

Each rank of the group (the sharding axes flattened, ``muonlab.comm.specs.flattened_key``) holds a
block of each parameter, the product of index runs per dim (``MatrixSpec.pieces``: a rectangle, a
strided row set, or nothing). A batch holds same-shape parameters, parameter k owned by rank o_k
(balanced by FLOPs). Out: every rank sends its piece of each parameter to that parameter's owner,
in one all_to_all_single with uneven split sizes (no padding travels; empty pieces send nothing).
Each owner puts its parameters together, piece by piece where the pieces say, and orthogonalizes
their matrices as one stack. Back: each owner sends every rank its piece of the results, in one
more all_to_all_single.

Order on the wire: a send buffer holds the owners' parameters owner by owner, each owner's in batch
order (``all_to_all.owner_order``); a receive buffer holds the sources' pieces source by source, in
the same order, so every rank finds each piece from the plan alone.

Bytes: each parameter crosses the wire once out and once back, minus its owner's own piece: the
least owner compute can move, when each owner is its parameter's largest holder (the planner's
``cheapest_owner`` takes one unless the balance it costs is worth more than the bytes it saves).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch

from ..collectives import all_to_all, pack
from ..specs import Piece, piece_numel
from .all_to_all import owner_counts, owner_order
from .base import CommPath, Itemsizes, Phases


def bytes_per_rank(held: Sequence[Sequence[int]], owners: Sequence[int], itemsize: int):
    """(sent, recv) per group rank. ``held[k][q]``: elements rank q holds of parameter k, owned by
    ``owners[k]``. Out: q sends its piece of each parameter it does not own; back: an owner sends
    every other rank its piece. A rank receives the mirror image, so the lists are equal.

    Parameters of one placement share one ``held`` list (the same object): each is walked once
    over the ranks, with its owners counted, so a batch of a 1024-rank plan costs O(W) per kind."""
    size = len(held[0]) if held else 0
    kinds: dict[int, tuple[Sequence[int], dict[int, int]]] = {}
    for numels, o in zip(held, owners):
        counts = kinds.setdefault(id(numels), (numels, {}))[1]
        counts[o] = counts.get(o, 0) + 1
    sent = [0] * size
    for numels, counts in kinds.values():
        num_params, total = sum(counts.values()), sum(numels)
        for q in range(size):  # out: its piece of each parameter it does not own
            sent[q] += numels[q] * (num_params - counts.get(q, 0)) * itemsize
        for o, m in counts.items():  # back: every other rank's piece of each parameter it owns
            sent[o] += m * (total - numels[o]) * itemsize
    return sent, list(sent)


def _blocks(piece: Piece):
    """(slices into the piece, slices into the whole tensor) of each block of a piece: one per
    combination of its runs along each dim (one block for a rectangle)."""
    per_dim = []
    for runs in piece:
        local, items = 0, []
        for start, n in runs:
            items.append((slice(local, local + n), slice(start, start + n)))
            local += n
        per_dim.append(items)
    for combo in itertools.product(*per_dim):
        yield tuple(c[0] for c in combo), tuple(c[1] for c in combo)


def piece_shape(piece: Piece) -> tuple[int, ...]:
    """The local tensor's shape of a piece."""
    return tuple(sum(n for _, n in runs) for runs in piece)


def put(whole: torch.Tensor, piece: Piece, values: torch.Tensor) -> None:
    """Write a piece's values (flat or in its local shape) into the whole tensor."""
    values = values.view(piece_shape(piece))
    for local, glob in _blocks(piece):
        whole[glob].copy_(values[local])


def take(whole: torch.Tensor, piece: Piece) -> torch.Tensor:
    """A piece of the whole tensor in its local shape (a view where it is one block)."""
    blocks = list(_blocks(piece))
    if len(blocks) == 1:
        return whole[blocks[0][1]]
    out = whole.new_empty(piece_shape(piece))
    for local, glob in blocks:
        out[local].copy_(whole[glob])
    return out


def run(batch, inputs, ctx):
    me, pieces, owners = ctx.group_rank, batch.pieces, batch.owners
    size = len(pieces[0])
    mine = [x.numel() for x in inputs]  # this rank's piece of each parameter is its local tensor
    order = owner_order(batch)
    owned = [pos for pos, o in enumerate(owners) if o == me]
    # every rank's piece sizes of the parameters this rank owns only: O(W) per owned parameter
    numels = {pos: [piece_numel(pc) for pc in pieces[pos]] for pos in owned}
    send = pack([inputs[pos] for pos in order], ctx.wire_dtype, like=inputs[0])
    send_splits = [0] * size
    for pos, o in enumerate(owners):
        send_splits[o] += mine[pos]
    recv_splits = [sum(numels[pos][q] for pos in owned) for q in range(size)]
    flat = yield all_to_all(send, send_splits, recv_splits, group=ctx.group, group_rank=me, defer=ctx.defer)
    mats = None
    if owned:
        # one stack, each owned parameter a view of its run of it: put together in place
        shape = batch.matrix_shape
        counts = [batch.param_numels[pos] // (shape[0] * shape[1]) for pos in owned]
        mats = flat.new_empty((sum(counts), *shape))
        wholes = [part.view(batch.param_shapes[pos]) for part, pos in zip(mats.split(counts), owned)]
        offset = 0
        for q in range(size):  # source by source, each source's pieces of my parameters in batch order
            for whole, pos in zip(wholes, owned):
                n = numels[pos][q]
                if n:
                    put(whole, pieces[pos][q], flat[offset:offset + n])
                offset += n
        del flat, wholes
    ortho = yield mats
    back = []
    if owned:
        results, start = [], 0
        for pos in owned:
            count = batch.param_numels[pos] // (shape[0] * shape[1])
            results.append(ortho[start:start + count].view(batch.param_shapes[pos]))
            start += count
        back = [take(r, pieces[pos][q]) for q in range(size) for r, pos in zip(results, owned)]
    send = pack(back, ctx.wire_dtype, like=inputs[0])
    del back  # a piece of several blocks was copied out (``take``): freed once packed
    returned = yield all_to_all(send, recv_splits, send_splits, group=ctx.group, group_rank=me, defer=ctx.defer)
    slot, offset = {}, 0
    for pos in order:  # owner by owner, each owner's in batch order: this rank's piece of each
        slot[pos] = offset
        offset += mine[pos]
    return [returned[slot[pos]:slot[pos] + mine[pos]].view(x.shape) for pos, x in enumerate(inputs)]


def _sizes(batch) -> tuple[list[int], list[int]]:
    """Per group rank: elements it holds of the batch's parameters, and of the parameters it owns."""
    size = len(batch.pieces[0])
    held, owned = [0] * size, [0] * size
    for pos, (pieces, o) in enumerate(zip(batch.pieces, batch.owners)):
        for q, pc in enumerate(pieces):
            held[q] += piece_numel(pc)
        owned[o] += batch.param_numels[pos]
    return held, owned


def buffer_bytes(batch, sizes: Itemsizes) -> list[Phases]:
    """Per group rank: out, its packed pieces (the input itself for one parameter already in the
    wire dtype) and its owned parameters' pieces received; then the owned stack, Newton-Schulz's
    output, the way back's packed pieces (a view for one whole result already in the wire dtype)
    and its pieces of the results received. The outputs are views."""
    w, n, size = sizes.wire, len(batch.owners), len(batch.pieces[0])
    c = sizes.ns or w
    counts = owner_counts(batch.owners, size)
    out = []
    for held, owned, m in zip(*_sizes(batch), counts):
        send = 0 if n == 1 and sizes.momentum == w else held * w
        back = 0 if size * m == 1 and c == w else owned * w
        out.append(Phases(send + owned * w, owned * (w + c) + back + held * w, 0))
    return out


def wire_buffers(batch) -> list:
    """Per group rank ((out send, out receive), (back send, back receive)) elements."""
    return [((held, owned), (owned, held)) for held, owned in zip(*_sizes(batch))]


def least_bytes(batch, itemsize: int) -> float:
    """Each parameter gathered whole on the rank holding its largest piece and its update sent
    back: 2 (1 - largest/all) of its bytes, the bound of owner compute."""
    largest: dict[int, int] = {}  # per pieces object: parameters of one shape and placements share one
    total = 0
    for shape, pieces in zip(batch.param_shapes, batch.pieces):
        if id(pieces) not in largest:
            largest[id(pieces)] = max(piece_numel(pc) for pc in pieces)
        total += 2 * (math.prod(shape) - largest[id(pieces)]) * itemsize
    return total


PATH = CommPath(name="pieces", collectives=2, out_share=0.5, color="#c49c94", run=run, waves=True,
                least_bytes=least_bytes, buffer_bytes=buffer_bytes, wire_buffers=wire_buffers)
