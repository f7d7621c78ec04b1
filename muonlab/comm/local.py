"""The ``local`` path: every matrix this rank needs is already whole here, so nothing moves.

Used for a single process and for layouts whose shards are whole matrices (experts on dim 0).
Each batch is one batched Newton-Schulz chain over all its parameters' matrices.
"""

from __future__ import annotations

import torch

from .base import PathRun


class LocalRun(PathRun):
    path = "local"

    def wait_out(self):
        shape = self.batch.matrix_shape
        mats = [x.reshape(-1, *shape) for x in self.inputs]
        stacked = torch.cat(mats) if mats else None
        return stacked if stacked is not None and stacked.shape[0] else None

    def send_back(self, ortho):
        self._ortho = ortho

    def wait_back(self):
        out, offset = [], 0
        for x in self.inputs:
            n = x.numel() // (self.batch.matrix_shape[0] * self.batch.matrix_shape[1]) if x.numel() else 0
            out.append(self._ortho[offset:offset + n].reshape(x.shape) if n else x.new_zeros(x.shape))
            offset += n
        return out
