"""The ``all_to_all`` path: row-sharded matrices, each gathered whole on one owner rank and back.

Batch of k <= W same-shape 2-D matrices, matrix i owned by rank o_i (distinct). Out: every rank
sends its rows of matrix i to o_i, in one all_to_all_single whose split sizes follow the uneven
(torch.chunk) shards, so no padding travels. The owner stacks the row blocks into the whole
matrix and orthogonalizes it. Back: the owner sends each rank its rows of the result.
Bytes: each matrix crosses the wire once out and once back, minus the owner's own rows.
"""

from __future__ import annotations

import torch

from .base import PathRun
from .collectives import all_to_all


class AllToAllRun(PathRun):
    path = "all_to_all"

    def _setup(self):
        b = self.batch
        self.rows = b.rows
        self.cols = b.matrix_shape[1]
        self.me = self.ctx.group_rank
        # which matrix of the batch this rank owns (at most one), by position
        self.mine = b.owners.index(self.me) if self.me in b.owners else None

    def send_out(self):
        self._setup()
        size, me, cols = len(self.rows), self.me, self.cols
        by_owner = dict(zip(self.batch.owners, self.inputs))
        send = torch.cat([by_owner[q].reshape(-1).to(self.ctx.wire_dtype) for q in range(size) if q in by_owner])
        send_splits = [self.rows[me] * cols if q in by_owner else 0 for q in range(size)]
        recv_splits = [self.rows[q] * cols if self.mine is not None else 0 for q in range(size)]
        self._out = self._count(all_to_all(send, send_splits, recv_splits, group=self.ctx.group, group_rank=me))

    def wait_out(self):
        flat = self._out.wait()
        if self.mine is None:
            return None
        return flat.view(1, *self.batch.matrix_shape)

    def send_back(self, ortho):
        size, me, cols = len(self.rows), self.me, self.cols
        if self.mine is not None:
            send = ortho.to(self.ctx.wire_dtype).reshape(-1)
            send_splits = [self.rows[q] * cols for q in range(size)]
        else:
            send = self.inputs[0].new_empty(0, dtype=self.ctx.wire_dtype)
            send_splits = [0] * size
        owners = set(self.batch.owners)
        recv_splits = [self.rows[me] * cols if q in owners else 0 for q in range(size)]
        self._back = self._count(all_to_all(send, send_splits, recv_splits, group=self.ctx.group, group_rank=me))

    def wait_back(self):
        flat = self._back.wait()
        # received blocks arrive in source-rank order, i.e. in owner-rank order
        n = self.rows[self.me] * self.cols  # may be 0: an empty trailing shard
        per_owner = {o: flat[k * n:(k + 1) * n] for k, o in enumerate(sorted(set(self.batch.owners)))}
        return [per_owner[o].view(x.shape) for o, x in zip(self.batch.owners, self.inputs)]
