"""The ``rebalance`` path: whole matrices orthogonalized where they lie, except a few moved.

When a layout leaves whole matrices unevenly spread (experts sharded on their expert dim over more
ranks than experts, or a bank that doesn't divide), the plan moves some matrices from overloaded
ranks to idle ones (``BatchPlan.moves``). Out: one all_to_all_single carries each moved matrix to
its owner; every rank orthogonalizes what it kept plus what it received, in one batched chain.
Back: the results return to the rank that holds the parameter.
"""

from __future__ import annotations

import torch

from .collectives import all_to_all
from .local import LocalRun


class RebalanceRun(LocalRun):
    path = "rebalance"

    def _setup(self):
        b = self.batch
        self.me = self.ctx.group_rank
        self.size = len(b.bytes_sent)
        self.numel = b.matrix_shape[0] * b.matrix_shape[1]
        self.local = [x.reshape(-1, *b.matrix_shape) for x in self.inputs]
        # slot of each matrix held here: its position among this rank's matrices of that parameter
        self.slot = {(pos, j): k for pos, src in enumerate(b.sources)
                     for k, j in enumerate(j for j, s in enumerate(src) if s == self.me)}
        # moves in plan order, split by direction; the order is the same on sender and receiver
        self.outgoing = sorted((m for m in b.moves if m[2] == self.me), key=lambda m: m[3])
        self.incoming = sorted((m for m in b.moves if m[3] == self.me), key=lambda m: m[2])
        self.moved_out = {(pos, j) for pos, j, _, _ in self.outgoing}
        self.held = [[j for j, s in enumerate(src) if s == self.me] for src in b.sources]

    def _splits(self, moves, rank_of):
        counts = [0] * self.size
        for m in moves:
            counts[rank_of(m)] += self.numel
        return counts

    def send_out(self):
        self._setup()
        wire = self.ctx.wire_dtype
        parts = [self.local[pos][self.slot[(pos, j)]].reshape(-1).to(wire) for pos, j, _, _ in self.outgoing]
        send = torch.cat(parts) if parts else self.inputs[0].new_empty(0, dtype=wire)
        self._out = self._count(all_to_all(send, self._splits(self.outgoing, lambda m: m[3]),
                                           self._splits(self.incoming, lambda m: m[2]),
                                           group=self.ctx.group, group_rank=self.me))

    def wait_out(self):
        received = self._out.wait().view(-1, *self.batch.matrix_shape)
        kept = [self.local[pos][k] for pos, held in enumerate(self.held) for k, j in enumerate(held)
                if (pos, j) not in self.moved_out]
        self.num_kept = len(kept)
        mats = kept + [received[k].to(self.local[0].dtype) for k in range(received.shape[0])]
        return torch.stack(mats) if mats else None

    def send_back(self, ortho):
        wire = self.ctx.wire_dtype
        self._kept = ortho[: self.num_kept] if ortho is not None else None
        theirs = ortho[self.num_kept:] if ortho is not None else None
        send = theirs.reshape(-1).to(wire) if theirs is not None and theirs.numel() else \
            self.inputs[0].new_empty(0, dtype=wire)
        self._back = self._count(all_to_all(send, self._splits(self.incoming, lambda m: m[2]),
                                            self._splits(self.outgoing, lambda m: m[3]),
                                            group=self.ctx.group, group_rank=self.me))

    def wait_back(self):
        returned = self._back.wait().view(-1, *self.batch.matrix_shape)
        from_owner = {(pos, j): returned[k] for k, (pos, j, _, _) in enumerate(self.outgoing)}
        out, kept = [], 0
        for pos, (x, held) in enumerate(zip(self.inputs, self.held)):
            result = []
            for j in held:
                key = (pos, j)
                if key in from_owner:
                    result.append(from_owner[key])
                else:
                    result.append(self._kept[kept])
                    kept += 1
            dtype = result[0].dtype if result else x.dtype
            out.append(torch.stack([r.to(dtype) for r in result]).view(x.shape) if result else x.new_zeros(x.shape))
        return out
