"""The ``owner`` path: replicated parameters (DDP), one owner rank per parameter.

Gradients are already identical on every rank, so nothing moves on the way out: the owner (chosen by
the plan, balancing Newton-Schulz FLOPs) keeps the momentum and orthogonalizes; the other ranks
skip both (a ZeRO-1 style saving). Back: the updates are all-gathered, and EVERY rank, the owner
included, applies the wire-dtype copy, so replicas stay bit-identical.
"""

from __future__ import annotations

import torch

from .base import PathRun
from .collectives import all_gather


class OwnerRun(PathRun):
    path = "owner"

    def wait_out(self):
        me = self.ctx.group_rank
        mats = [x.reshape(-1, *self.batch.matrix_shape) for o, x in zip(self.batch.owners, self.inputs) if o == me]
        return torch.cat(mats) if mats else None

    def send_back(self, ortho):
        b, me = self.batch, self.ctx.group_rank
        self.numels = b.param_numels
        sizes = [0] * len(b.bytes_sent)
        for o, n in zip(b.owners, self.numels):
            sizes[o] += n
        if ortho is None:
            send = torch.empty(0, dtype=self.ctx.wire_dtype)
        else:
            send = ortho.to(self.ctx.wire_dtype).reshape(-1)
        self._sizes = sizes
        self._back = self._count(all_gather(send, sizes, group=self.ctx.group, group_rank=me))

    def wait_back(self):
        flat = self._back.wait()
        segments = list(flat.split(self._sizes))
        offsets = [0] * len(segments)
        out = []
        for o, n, shape in zip(self.batch.owners, self.numels, self.batch.param_shapes):
            out.append(segments[o][offsets[o]:offsets[o] + n].view(shape))
            offsets[o] += n
        return out
