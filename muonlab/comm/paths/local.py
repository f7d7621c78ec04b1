"""The ``local`` path: every matrix this rank needs is already whole here, so nothing moves.

Used for a single process and for layouts whose shards are whole matrices (experts on dim 0).
Each batch is one batched Newton-Schulz chain over all its parameters' matrices, read straight
from the momentum inputs into the Newton-Schulz workspace (no stacked copy of the batch), whose
result is written back over those inputs (temporaries of this step; no output buffer either).
"""

from __future__ import annotations

from ...kernels.batch_io import Overwrite
from .base import CommPath, Phases


def run(batch, inputs, ctx):
    shape = batch.matrix_shape
    mats = [x.view(-1, *shape) for x in inputs if x.numel()]
    yield Overwrite(mats) if mats else None  # then the inputs hold their orthogonalized matrices
    return inputs


def buffer_bytes(batch, sizes) -> list[Phases]:
    """Nothing: the matrices are views of the inputs and the results overwrite them."""
    return [Phases(0, 0, None)] * max(1, len(batch.flops))


PATH = CommPath(name="local", collectives=0, out_share=0.0, color="#7f7f7f", run=run, buffer_bytes=buffer_bytes)
