"""The ``gather_all`` fallback: any single Shard(dim) layout, by a padded all-gather.

Used only where no other path applies (a matrix sharded on a dim other than 0). Every rank pads its
shard to the largest chunk, all-gathers, trims, orthogonalizes the WHOLE matrix (redundantly), and
keeps its own slice. The plan reports it as a fallback so it is never taken silently.
"""

from __future__ import annotations

import torch

from .base import PathRun
from .collectives import all_gather


class GatherAllRun(PathRun):
    path = "gather_all"

    def send_out(self):
        (x,) = self.inputs
        b, me = self.batch, self.ctx.group_rank
        self.dim = b.shard_dim
        self.full_shape = b.param_shapes[0]
        step = max(b.rows)
        pad = [0, 0] * (x.ndim - 1 - self.dim) + [0, step - x.shape[self.dim]]
        padded = torch.nn.functional.pad(x.to(self.ctx.wire_dtype), pad)
        self.padded_shape = padded.shape
        self._out = self._count(all_gather(padded.reshape(-1), [padded.numel()] * len(b.rows),
                                           group=self.ctx.group, group_rank=me))

    def wait_out(self):
        flat = self._out.wait()
        parts = [seg.view(self.padded_shape).narrow(self.dim, 0, r)
                 for seg, r in zip(flat.split(self.padded_shape.numel()), self.batch.rows)]
        return torch.cat(parts, dim=self.dim).reshape(-1, *self.batch.matrix_shape)

    def send_back(self, ortho):
        full = ortho.reshape(self.full_shape)
        start = sum(self.batch.rows[: self.ctx.group_rank])
        self._mine = full.narrow(self.dim, start, self.batch.rows[self.ctx.group_rank])

    def wait_back(self):
        return [self._mine]
