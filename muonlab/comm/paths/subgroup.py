"""The ``subgroup`` path: a fused expert bank whose experts each span a sub-group of ranks.

A bank (E*M, N) row-sharded over W ranks with W % E == 0 puts expert e's M rows on the k = W/E
ranks of sub-group e. Each sub-group all-gathers its expert (one collective, no way back), every
rank of it orthogonalizes the whole expert, and each keeps its own rows: k-fold redundant compute
traded for one collective instead of two.

The sub-groups are torch process groups, created once, collectively (every rank creates every
sub-group, in the same order), and cached under a key made of the mesh's ranks, shape and axis:
never an object's id(), so equal meshes share them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..collectives import all_gather
from ..specs import GroupKey
from .base import CommPath, Itemsizes, Phases

_SUBGROUPS: dict[tuple, dict[int, tuple[object, int]]] = {}


def subgroups_for(group: GroupKey, k: int) -> dict[int, tuple[object, int]]:
    """{global rank: (its sub-group's ProcessGroup, its index there)} for sub-groups of k ranks.

    Collective on first use: call it on every rank at the same point (the optimizer does, when it
    plans), never mid-step."""
    key = (group.mesh_ranks, group.mesh_shape, group.axis_index, k)
    if key not in _SUBGROUPS:
        mapping = {}
        for members in group.axis_slices():
            for start in range(0, len(members), k):
                ranks = members[start:start + k]
                pg = dist.new_group(ranks)  # every rank enters every new_group call
                for i, g in enumerate(ranks):
                    mapping[g] = (pg, i)
        _SUBGROUPS[key] = mapping
    return _SUBGROUPS[key]


def ranks_per_expert(batch) -> int:
    experts = batch.num_matrices // len(batch.param_indices)
    return batch.group.size // experts


def bytes_per_rank(rows: Sequence[int], cols: int, k: int, num_params: int, itemsize: int):
    """(sent, recv) per group rank: each rank sends its rows to the k - 1 others of its sub-group
    and receives as much, once per parameter of the batch."""
    per_rank = [(k - 1) * r * cols * itemsize * num_params for r in rows]
    return per_rank, list(per_rank)


def run(batch, inputs, ctx):
    k = ranks_per_expert(batch)
    pg, index = subgroups_for(batch.group, k)[dist.get_rank()]
    send = torch.cat([x.reshape(-1).to(ctx.wire_dtype) for x in inputs])
    gathered = yield all_gather(send, [send.numel()] * k, group=pg, group_rank=index)
    M, N = batch.matrix_shape
    flat = gathered.view(k, len(inputs), M // k, N)
    ortho = yield flat.permute(1, 0, 2, 3).reshape(len(inputs), M, N)
    rows = M // k
    return [ortho[p, index * rows:(index + 1) * rows].reshape(x.shape) for p, x in enumerate(inputs)]


def plan_bucket(planner, group: GroupKey, idx: list[int]) -> None:
    """One batch of a bucket of banks of layout "subgroup": each of the E experts spans k = W / E
    ranks; every rank all-gathers its expert within its sub-group and orthogonalizes it (the k
    ranks of a sub-group compute the same one)."""
    size, first = group.size, planner.specs[idx[0]]
    k = size // first.num_fused
    sent, recv = bytes_per_rank(first.rows, first.matrix_shape[1], k, len(idx), planner.itemsize_of(idx[0]))
    flops = [planner.flops_of(idx[0]) * len(idx)] * size
    load = planner.loads.view(group)
    for r in range(size):
        load.add(r, flops[r])
    planner.batches.append(planner.make("subgroup", idx, group, range(size), sent=sent, recv=recv, flops=flops,
                                        notes=f"sub-groups of {k} ranks rebuild one expert each"))


def prepare_groups(batch) -> None:
    subgroups_for(batch.group, ranks_per_expert(batch))


def ranks_reached(batch) -> int:
    return max(1, ranks_per_expert(batch))  # a sub-group of no rank (more experts than ranks) is no peer set


def buffer_bytes(batch, sizes: Itemsizes) -> list[Phases]:
    """Per group rank: its rows of every bank, cast and joined; its sub-group's experts gathered;
    them reordered expert by expert (a view for one bank or a sub-group of one rank);
    Newton-Schulz's output. No way back: the outputs are views of it."""
    k, n, (M, N), w = ranks_per_expert(batch), len(batch.param_indices), batch.matrix_shape, sizes.wire
    stack = n * M * N * w if n > 1 and k > 1 else 0
    ns = n * M * N * (sizes.ns or w)
    return [Phases(n * r * N * w * (1 + k), stack + ns, None) for r in batch.rows]


PATH = CommPath(name="subgroup", collectives=1, out_share=1.0, color="#aec7e8", run=run, plans_layout="subgroup",
                plan_bucket=plan_bucket, prepare_groups=prepare_groups, ranks_reached=ranks_reached,
                buffer_bytes=buffer_bytes)
