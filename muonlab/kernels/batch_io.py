"""Matrices in and out of a Newton-Schulz call: the batch as pieces, the output, and the
normalisation on the way in (each matrix divided by its own Frobenius norm, never the batch's).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def normalise_into(out: torch.Tensor, X: torch.Tensor, eps: float, scale: float) -> torch.Tensor:
    """``out = X / ||X||_F`` per matrix; ``out`` may be ``X`` itself (in place).

    The norm accumulates in fp32 inside the reduction either way; for bf16 it is returned in bf16,
    exactly torch.optim.Muon's ``norm()`` (asking for an fp32 result instead made an fp32 copy of
    the batch on CPU: 12 ms instead of 0.4 ms for 24 x 256 x 768). In fp32 and bf16 the sum of
    squares overflows only for entries near 1e19 (then the result is zeros, as torch.optim.Muon's):
    not guarded, since a guard costs a pass or a host sync per call. fp16: ``_normalise_half_into``.
    """
    if X.dtype == torch.float16:
        return _normalise_half_into(out, X, eps, scale)
    norms = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True)
    if scale != 1.0:  # scaled in at least fp32 (a bf16 norm times 1.02 would round), fp64 kept
        norms = norms.to(torch.promote_types(norms.dtype, torch.float32)) * scale
    return torch.div(X, norms.clamp(min=eps).to(X.dtype), out=out)


HALF_SMALLEST = 2.0**-24
"""fp16's smallest positive (subnormal) value: the divisor's floor, so an eps below it can't make 0 / 0."""


def _normalise_half_into(out: torch.Tensor, X: torch.Tensor, eps: float, scale: float) -> torch.Tensor:
    """``normalise_into`` for fp16, whose range (65504) a matrix of finite fp16 values can pass in
    norm: as an fp16 divisor that norm would be inf and zero the matrix. An fp32 norm and an fp32
    division would each make an fp32 copy of the batch (on a CPU; with them a runner call took 2.2x
    its workspace budget). So the division is split in two fp16 passes with no copy: first by the
    power of two at or above the largest |entry| (1 when that is below 1), which is exact (only
    exponents change) and leaves entries within [-1, 1], whose norm is at most sqrt(m n), in range;
    then by that norm, scaled and floored, in fp16. Against one fp32 division, the divisor's fp16
    rounding scales a matrix by up to 1e-3 (relative), which Newton-Schulz does not see."""
    peak = torch.linalg.vector_norm(X, ord=math.inf, dim=(-2, -1), keepdim=True).float()
    power = torch.exp2(torch.ceil(torch.log2(peak.clamp(min=1))))  # at most 2^16: its reciprocal is an fp16
    torch.mul(X, power.reciprocal().to(X.dtype), out=out)
    rest = torch.linalg.vector_norm(out, dim=(-2, -1), keepdim=True).float() * scale
    divisor = rest.clamp(min=(eps / power).clamp(min=HALF_SMALLEST))  # X's floor eps, at out's scale
    return out.div_(divisor.to(X.dtype))


class Overwrite(list):
    """Matrices, a list of (k_i, A, B) tensors, that their owner lets Newton-Schulz overwrite with
    the result (cast to their dtype), so that no output buffer is allocated: the local path hands
    over the step's own momentum temporaries this way (``newton_schulz`` and the runner honour it)."""


def load_pieces(stack: torch.Tensor, pieces: list[torch.Tensor]) -> None:
    """Copy (and cast) the (k_i, A, B) pieces into consecutive matrices of ``stack``, in order."""
    torch._foreach_copy_(list(stack.split([p.shape[0] for p in pieces])), pieces)


def store_pieces(stack: torch.Tensor, pieces: list[torch.Tensor]) -> None:
    """Copy (and cast) consecutive matrices of ``stack`` into the (k_i, A, B) pieces, in order."""
    torch._foreach_copy_(pieces, list(stack.split([p.shape[0] for p in pieces])))


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
    return _joined([p if p.ndim == 3 and p.numel() else _as_batch(p, writable) for p in pieces])


def _refuse_mixed(pieces: list[torch.Tensor], name: str) -> None:
    """ValueError naming the first of ``pieces`` unlike the first one (``batch_pieces``)."""
    first = pieces[0]
    for i, p in enumerate(pieces):
        if p.ndim < 2 or p.shape[-2:] != first.shape[-2:] or p.device != first.device or p.dtype != first.dtype:
            raise ValueError(f"newton_schulz's list {name} needs tensors of one device and dtype with equal last two "
                             f"dims; tensor {i} is {tuple(p.shape)} {p.dtype} on {p.device}, tensor 0 "
                             f"{tuple(first.shape)} {first.dtype} on {first.device}")


def _joined(pieces: list[torch.Tensor]) -> list[torch.Tensor]:
    """Pieces that lie back to back in one buffer (a batch's momentum inputs, see
    ``muonlab.optim.functional.muon_momentum_``) as one (k, A, B) view of it; else as they are."""
    pieces = [p for p in pieces if p.shape[0]] or pieces[:1]
    if len(pieces) == 1:
        return pieces
    first = pieces[0]
    storage, end, num = first.untyped_storage().data_ptr(), first.data_ptr(), 0
    for p in pieces:
        if not p.is_contiguous() or p.data_ptr() != end or p.untyped_storage().data_ptr() != storage:
            return pieces
        end += p.numel() * p.element_size()
        num += p.shape[0]
    rows, cols = first.shape[-2:]
    return [first.as_strided((num, rows, cols), (rows * cols, cols, 1))]


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


def load_normalised(X: torch.Tensor, pieces: list[torch.Tensor], eps: float, scale: float) -> None:
    """Fill X (a view of the workspace, the pieces' orientation) with the pieces, cast to X's dtype
    and each matrix divided by its norm. One piece already in X's dtype is read once (the division
    writes X); otherwise the pieces are copied (cast) in, then normalised in place, so the norm is
    the cast matrix's, as torch.optim.Muon's ``X = G.bfloat16(); X / X.norm()``. Into fp16 from
    another dtype (the gram form's iterates, see ``gram_work_dtype``) each piece is divided by its
    fp32 norm on the way in: a cast first would turn entries past 65504 into inf and those under
    6e-8 into zeros."""
    if len(pieces) == 1 and pieces[0].dtype == X.dtype:
        normalise_into(X, pieces[0], eps, scale)
        return
    if X.dtype == torch.float16 and any([p.dtype != torch.float16 for p in pieces]):
        for piece, dest in zip(pieces, X.split([p.shape[0] for p in pieces])):
            norms = torch.linalg.vector_norm(piece, dim=(-2, -1), keepdim=True, dtype=torch.float32) * scale
            torch.div(piece, norms.clamp(min=eps), out=dest)
        return
    load_pieces(X, pieces)
    normalise_into(X, X, eps, scale)
