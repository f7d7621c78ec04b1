"""The plain form: X <- a X + (b A + c A^2) X with A = X X^T, on X itself (Keller Jordan's Muon).

4 m^2 n + 2 m^3 FLOPs per step for an m x n matrix (m <= n: a tall matrix iterates on its
transpose, algebraically, without a copy). It iterates in the compute dtype, whatever it is.
"""

from __future__ import annotations

import torch

from ..precision import NS_DTYPES
from .base import NSForm


def plain_iterations(X: torch.Tensor, spare: torch.Tensor, coeffs, gram: torch.Tensor,
                     poly: torch.Tensor) -> torch.Tensor:
    """The plain iteration on a batch X, in preallocated buffers: ``gram`` and ``poly`` (B, m, m),
    ``spare`` like X. X and ``spare`` take turns holding the iterate (X is overwritten); the last
    iterate lands in X after an even number of steps, in ``spare`` after an odd one, and is returned.

    X may be wide (B, m, n) or tall (B, n, m), as the matrices are stored: a tall X iterates as
    X' = a X + X (b A + c A^2) with A = X^T X, the transpose of the wide iteration on X^T, so a
    tall matrix is never transposed in memory (on a CPU a transposing copy of the batch costs
    about as much as one whole iteration)."""
    tall = X.shape[-2] > X.shape[-1]
    for a, b, c in coeffs:
        if tall:
            torch.bmm(X.mT, X, out=gram)                                # A = X^T X
        else:
            torch.bmm(X, X.mT, out=gram)                                # A = X X^T
        torch.baddbmm(gram, gram, gram, beta=b, alpha=c, out=poly)      # B = b A + c A A
        if tall:
            torch.baddbmm(X, X, poly, beta=a, out=spare)                # X' = a X + X B (B is symmetric)
        else:
            torch.baddbmm(X, poly, X, beta=a, out=spare)                # X' = a X + B X
        X, spare = spare, X
    return X


def _iterate(X, spare, squares, coeffs, cfg, dtype, kernels="torch"):
    if kernels == "triton":  # optional: triton is imported only where it runs
        from ..triton_newton_schulz import NSWorkspace, newton_schulz_triton

        gram, poly = squares  # the input's buffer is the second iterate (pong), as on torch
        return newton_schulz_triton(X, coeffs, workspace=NSWorkspace(gram, poly, spare, pong=X))
    return plain_iterations(X, spare, coeffs, *squares)


def plain_flops_per_iter(m: int, n: int) -> int:
    """One plain iteration on an m x n matrix (m <= n): 2m^2n (X X^T) + 2m^3 (A A) + 2m^2n (B X)."""
    return 4 * m * m * n + 2 * m**3


def symmetric_flops_per_iter(m: int, n: int, block: int | None = None) -> int:
    """One iteration of the Triton backend, whose X X^T and A A compute only upper tiles.

    m^2 n for the symmetric X X^T, m^3 for the symmetric A A, 2 m^2 n for B X: 3 m^2 n + m^3 (0.67
    of the plain count for a square matrix). With ``block``, what the kernels execute at tile
    granularity: whole diagonal tiles and the padding of partial tiles (masked lanes still go
    through ``tl.dot``).
    """
    if m > n:
        raise ValueError(f"symmetric_flops_per_iter expects m <= n, got m={m}, n={n}")
    if block is None:
        return 3 * m * m * n + m**3
    num_blocks = -(-m // block)
    num_pairs = num_blocks * (num_blocks + 1) // 2
    padded_m = num_blocks * block
    padded_n = -(-n // block) * block
    sym_xxt = num_pairs * 2 * block * block * padded_n
    sym_aa = num_pairs * 2 * block * block * padded_m
    bx = 2 * padded_m * padded_n * padded_m
    return sym_xxt + sym_aa + bx


def _flops(m, n, cfg, symmetric=False):
    return cfg.steps * (symmetric_flops_per_iter(m, n) if symmetric else plain_flops_per_iter(m, n))


FORM = NSForm(
    name="plain",
    squares=2,  # A and B
    dtypes=NS_DTYPES,
    square_matrices=True,
    iterate=_iterate,
    writes=lambda cfg, dtype: cfg.steps,
    flops=_flops,
    work_dtype=lambda cfg, dtype, native_fp16: dtype,
    key=lambda cfg, dtype: "plain",
)
