"""The batch a Newton-Schulz call is handed, checked: as pieces (``batch_pieces``), and the
pieces a caller lets it overwrite (``Overwrite``). Copying them in and out of the workspace, with
the normalisation on the way in, is the executor's (muonlab.kernels.execute), which does it per
chunk."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .execute import joined


class Overwrite(list):
    """Matrices, a list of (k_i, A, B) tensors, that their owner lets Newton-Schulz overwrite with
    the result (cast to their dtype), so that no output buffer is allocated: the local path hands
    over the step's own momentum temporaries this way (``newton_schulz`` and the runner honour it)."""


def batch_pieces(G, name: str = "G", writable: bool = False) -> list[torch.Tensor]:
    """``G`` as a list of (k, A, B) tensors, checked: one device and dtype, equal last two dims;
    empty pieces dropped, pieces back to back in one buffer joined. ``writable`` pieces (``out``)
    are views: a reshape that had to copy would take the result away.

    A runner call takes this on every plan batch of every step: its checks cost a constant number
    of Python calls whatever the number of pieces (comprehensions, no generators, no call per piece)."""
    if isinstance(G, torch.Tensor):
        if G.ndim < 2:
            raise ValueError(f"newton_schulz needs {name} with at least 2 dims, got shape {tuple(G.shape)}")
        return [_as_batch(G, writable)]
    # lists and tuples first: the abstract Sequence check is a Python call of its own
    pieces = list(G) if isinstance(G, (list, tuple)) or isinstance(G, Sequence) else None
    if not pieces or not all([isinstance(p, torch.Tensor) for p in pieces]):
        raise TypeError(f"newton_schulz needs {name} as a tensor or a non-empty list of tensors, got {type(G).__name__}")
    kinds = {(p.shape[-2:], p.device, p.dtype) if p.ndim >= 2 else None for p in pieces}
    if len(kinds) > 1 or None in kinds:
        _refuse_mixed(pieces, name)
    # (k, A, B) pieces with matrices are taken as they are; others are reshaped (or, writable, viewed)
    return joined([p if p.ndim == 3 and p.numel() else _as_batch(p, writable) for p in pieces])


def _refuse_mixed(pieces: list[torch.Tensor], name: str) -> None:
    """ValueError naming the first of ``pieces`` unlike the first one (``batch_pieces``)."""
    first = pieces[0]
    for i, p in enumerate(pieces):
        if p.ndim < 2 or p.shape[-2:] != first.shape[-2:] or p.device != first.device or p.dtype != first.dtype:
            raise ValueError(f"newton_schulz's list {name} needs tensors of one device and dtype with equal last two "
                             f"dims; tensor {i} is {tuple(p.shape)} {p.dtype} on {p.device}, tensor 0 "
                             f"{tuple(first.shape)} {first.dtype} on {first.device}")


def _as_batch(t: torch.Tensor, writable: bool) -> torch.Tensor:
    """``t`` as (k, A, B): a view if ``writable``, else a view where possible; empty as (0, A, B)."""
    if not t.numel():
        return t.new_empty((0, *t.shape[-2:]))
    if not writable:
        return t.reshape(-1, *t.shape[-2:])
    try:
        return t.view(-1, *t.shape[-2:])
    except RuntimeError:
        raise ValueError(f"newton_schulz's out of shape {tuple(t.shape)} and strides {t.stride()} can't be "
                         "viewed as a batch of matrices; pass a contiguous tensor") from None
