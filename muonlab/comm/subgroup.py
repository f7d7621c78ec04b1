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

import torch
import torch.distributed as dist

from .base import PathRun
from .collectives import all_gather
from .layout import GroupKey

_SUBGROUPS: dict[tuple, dict[int, tuple[object, int]]] = {}


def _axis_slices(group: GroupKey) -> list[list[int]]:
    """Global ranks of every slice of the group's axis, each in axis order, slices in mesh order."""
    slices: dict[tuple, list[tuple[int, int]]] = {}
    for flat, g in enumerate(group.mesh_ranks):
        coords, rest = [], flat
        for d in reversed(group.mesh_shape):
            coords.append(rest % d)
            rest //= d
        coords.reverse()
        other = tuple(c for a, c in enumerate(coords) if a != group.axis)
        slices.setdefault(other, []).append((coords[group.axis], g))
    return [[g for _, g in sorted(members)] for _, members in sorted(slices.items())]


def subgroups_for(group: GroupKey, k: int) -> dict[int, tuple[object, int]]:
    """{global rank: (its sub-group's ProcessGroup, its index there)} for sub-groups of k ranks."""
    key = (group.mesh_ranks, group.mesh_shape, group.axis, k)
    if key not in _SUBGROUPS:
        mapping = {}
        for members in _axis_slices(group):
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


class SubgroupRun(PathRun):
    path = "subgroup"

    def send_out(self):
        self.k = ranks_per_expert(self.batch)
        self.pg, self.index = subgroups_for(self.batch.group, self.k)[dist.get_rank()]
        send = torch.cat([x.reshape(-1).to(self.ctx.wire_dtype) for x in self.inputs])
        self._out = self._count(all_gather(send, [send.numel()] * self.k, group=self.pg, group_rank=self.index))

    def wait_out(self):
        M, N = self.batch.matrix_shape
        flat = self._out.wait().view(self.k, len(self.inputs), M // self.k, N)
        return flat.permute(1, 0, 2, 3).reshape(len(self.inputs), M, N)

    def send_back(self, ortho):
        self._ortho = ortho

    def wait_back(self):
        M = self.batch.matrix_shape[0]
        rows = M // self.k
        return [self._ortho[p, self.index * rows:(self.index + 1) * rows].reshape(x.shape)
                for p, x in enumerate(self.inputs)]
