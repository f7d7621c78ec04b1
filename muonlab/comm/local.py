"""The ``local`` path: every matrix is whole on this rank, so nothing moves.

Matrices are grouped by (Newton-Schulz settings, matrix shape) and each group runs as one batched
Newton-Schulz chain: stacking turns many small matmuls into a few large batched ones.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch

from ..kernels.newton_schulz import newton_schulz


def batch_by_shape(tensors: Sequence[torch.Tensor], keys: Sequence[Hashable]) -> dict[tuple, list[int]]:
    """Indices of ``tensors`` grouped by (key, last-two-dims shape), in first-seen order."""
    batches: dict[tuple, list[int]] = {}
    for i, (t, key) in enumerate(zip(tensors, keys)):
        batches.setdefault((key, tuple(t.shape[-2:])), []).append(i)
    return batches


def orthogonalize_local(
    tensors: Sequence[torch.Tensor],
    keys: Sequence[Hashable],
    ns_kwargs: Callable[[Hashable], dict],
) -> list[torch.Tensor]:
    """Newton-Schulz of each tensor's trailing matrices; tensors with equal (key, shape) batched."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    for (key, (rows, cols)), idx in batch_by_shape(tensors, keys).items():
        stacked = torch.cat([tensors[i].reshape(-1, rows, cols) for i in idx])
        ortho = newton_schulz(stacked, **ns_kwargs(key))
        offset = 0
        for i in idx:
            n = tensors[i].numel() // (rows * cols)
            out[i] = ortho[offset : offset + n].reshape(tensors[i].shape)
            offset += n
    return out
