"""The ``local`` path: every matrix this rank needs is already whole here, so nothing moves.

Used for a single process and for layouts whose shards are whole matrices (experts on dim 0).
Each batch is one batched Newton-Schulz chain over all its parameters' matrices.
"""

from __future__ import annotations

import torch

from .base import CommPath


def split_like(ortho: torch.Tensor | None, inputs: list[torch.Tensor], shape: tuple[int, int]) -> list[torch.Tensor]:
    """Cut a stack of orthogonalized matrices back into the inputs' shapes, in order (an input
    holding no matrix, an empty shard, gets zeros)."""
    out, offset = [], 0
    for x in inputs:
        n = x.numel() // (shape[0] * shape[1]) if x.numel() else 0
        out.append(ortho[offset:offset + n].reshape(x.shape) if n else x.new_zeros(x.shape))
        offset += n
    return out


def run(batch, inputs, ctx):
    shape = batch.matrix_shape
    mats = [x.reshape(-1, *shape) for x in inputs]
    # one parameter needs no stacking copy (Newton-Schulz reads its input without changing it)
    stacked = (mats[0] if len(mats) == 1 else torch.cat(mats)) if mats else None
    ortho = yield stacked if stacked is not None and stacked.shape[0] else None
    return split_like(ortho, inputs, shape)


PATH = CommPath(name="local", collectives=0, out_share=0.0, color="#7f7f7f", run=run)
