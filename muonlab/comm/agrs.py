"""The ``agrs`` path: all-gather out, owner-scatter back, for a remainder batch of k < W matrices.

Out: every rank's rows of all k matrices are all-gathered (one collective that NCCL runs at ring
bandwidth; XTuner's FSDP2 Muon uses it for remainders). Each rank then holds every matrix but
orthogonalizes only its own share (matrix i on its owner). Back: the owner sends each rank its rows
of the result, as in ``all_to_all`` (a reduce-scatter of mostly-zero buffers would move W x more).
The gather moves more bytes than ``all_to_all`` (every rank receives every matrix); the planner
weighs that against its cheaper collective.
"""

from __future__ import annotations

import torch

from .all_to_all import AllToAllRun
from .collectives import all_gather


class AgrsRun(AllToAllRun):
    path = "agrs"

    def send_out(self):
        self._setup()
        k, cols = len(self.inputs), self.cols
        send = torch.cat([x.reshape(-1).to(self.ctx.wire_dtype) for x in self.inputs])
        sizes = [k * r * cols for r in self.rows]
        self._out = self._count(all_gather(send, sizes, group=self.ctx.group, group_rank=self.me))

    def wait_out(self):
        flat = self._out.wait()
        if self.mine is None:
            return None
        k, cols = len(self.inputs), self.cols
        segments = flat.split([k * r * cols for r in self.rows])
        blocks = [seg.view(k, r, cols)[self.mine] for seg, r in zip(segments, self.rows)]
        return torch.cat(blocks).view(1, *self.batch.matrix_shape)
