"""The one readable Newton-Schulz loop: the specification the fast paths are tested against.

``newton_schulz`` (batched, gram form, Triton) must agree with this; tests, notebook 04 and the
benchmarks use it as their reference. It runs in whatever dtype it is given, float64 included.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .coefficients import norm_scale, resolve_coefficients


def plain_iterations(X: torch.Tensor, coefficients: Sequence[tuple[float, float, float]]) -> torch.Tensor:
    """X <- a X + (b A + c A^2) X with A = X X^T, once per (a, b, c); X is (..., m, n), m <= n,
    already normalised. This is what the Triton kernels compute."""
    for a, b, c in coefficients:
        A = X @ X.mT
        X = a * X + (b * A + c * (A @ A)) @ X
    return X


def reference_newton_schulz(M: torch.Tensor, steps: int = 5, coefficients="keller", eps: float = 1e-7,
                            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Orthogonalize ONE 2-D matrix, written out: transpose if tall, normalise, iterate."""
    if M.ndim != 2:
        raise ValueError(f"reference_newton_schulz takes one 2-D matrix, got shape {tuple(M.shape)}")
    X = M.to(dtype)
    transposed = X.shape[0] > X.shape[1]
    if transposed:
        X = X.T
    wide = X.to(torch.promote_types(dtype, torch.float32))  # the norm in fp32, or fp64 for fp64
    norm = (wide.norm() * norm_scale(coefficients)).clamp(min=eps)
    # fp16 divides in fp32: a finite fp16 matrix's norm can pass fp16's range (65504)
    X = (wide / norm).to(dtype) if dtype == torch.float16 else X / norm.to(dtype)
    X = plain_iterations(X, resolve_coefficients(coefficients, steps))
    return X.T if transposed else X
