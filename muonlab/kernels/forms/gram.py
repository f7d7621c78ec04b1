"""The gram form: Newton-Schulz on the m x m Gram matrix R = X X^T instead of on X.

With X_k = Q_k X_0, Z_k = a I + b R_k + c R_k^2 gives Q_{k+1} = Z_k Q_k and R_{k+1} = Z_k R_k Z_k
= Z_k^2 R_k (Z_k is a polynomial in R_k, so they commute). X is touched only twice (R_0 = X_0
X_0^T and X_K = Q_K X_0), so for n >> m most of the plain form's 4 m^2 n per step disappears. In
low precision R drifts from Q R_0 Q^T, so the iteration restarts (X = Q X_0, R = X X^T afresh)
after the steps listed in ``gram_restarts`` (the restart idea is from Dao-AILab's
gram-newton-schulz). Square matrices take the plain form: there gram saves nothing and costs
about 20% more.

The gram form never iterates in bf16 (``GRAM_DTYPES``; ``work_dtype`` never returns it, and
``NSConfig`` refuses it as ``gram_dtype``): rounding R = X X^T to bf16's 8 bits gives it spurious
negative eigenvalues (about -4e-3 of the top one) where X has none, and the iteration maps a
negative eigenvalue lambda to Z(lambda)^2 lambda, growing it by a^2 (16-67) per step: near-low-rank
inputs (what momentum often is) came out with top singular values of 2 to 1e7. It iterates in
fp16 instead, whose 3 more mantissa bits keep 5 steps bounded with one restart, as Zhang, Amsel,
Chen and Dao do in "Gram Newton-Schulz" (2026); where a device has no native fp16 matmul (most
CPUs: 2.7 GFLOP/s emulated on this project's AMD EPYC against 860 in bf16) it iterates in fp32.
Normalised inputs keep every iterate within fp16's range.
"""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral

import torch

from ..precision import HALF_DTYPES
from .base import NSForm

GRAM_DTYPES = (torch.float16, torch.float32, torch.float64)
"""Dtypes the gram form may iterate in (``NSConfig.gram_dtype``): not bf16 (see the module doc)."""


def gram_iterations(X: torch.Tensor, spare: torch.Tensor, coeffs, restarts: Sequence[int],
                     squares: Sequence[torch.Tensor], kernels: str = "torch") -> torch.Tensor:
    """The gram form on the normalised batch in ``X``, in preallocated buffers: ``spare`` (like X)
    takes each restart's Q X and the final one, and the four (B, m, m) ``squares`` hold R, Z, Q and
    a product in flight, trading roles by name instead of allocating (on this project's 2-core CPU
    a fresh 1.5 MB product per operation, 25 per call, made 12 x 768 x 256 in bf16 take 11.4 ms
    against 7.1 ms in the workspace: first touches of new pages and a cold cache). Returns the
    buffer that holds the result (see ``gram_writes``). A tall batch iterates as stored, on X^T
    (R = X^T X, X Q^T for Q X): a product written into a transposed view ran 2000x slower in bf16
    on this project's CPU.

    ``kernels="triton"``: the products run on the Triton kernels (X must be wide), whose X X^T and
    b R + c R^2 compute only upper tiles (``triton_newton_schulz.gram_form_products``)."""
    tall = X.shape[-2] > X.shape[-1]
    R, Z, Q, T = squares
    if kernels == "triton":
        from ..triton_newton_schulz import gram_form_products  # optional: only where it runs

        gram, poly, product = gram_form_products(X.dtype)
    else:  # torch's own ops, called directly: a helper around each would be Python calls every step
        def gram(X, out):
            if tall:
                torch.bmm(X.mT, X, out=out)
            else:
                torch.bmm(X, X.mT, out=out)

        poly, product = None, torch.bmm

    gram(X, R)
    identity = True  # Q is the identity, kept implicit until the first iteration
    last = len(coeffs) - 1
    for k, (a, b, c) in enumerate(coeffs):
        if poly is None:                                               # Z = a I + b R + c R^2
            torch.baddbmm(R, R, R, beta=b, alpha=c, out=Z)
        else:
            poly(R, Z, b, c)
        # a rounded to the compute dtype first, as a * I held it: the bits then do not depend on
        # how a device's kernel treats a scalar (on this CPU the two agree)
        Z.diagonal(dim1=-2, dim2=-1).add_(torch.tensor(a, dtype=Z.dtype).item())
        if identity:
            Q, Z = Z, Q                                                # Q = Z: the buffers swap names
            current = Q                                                # (this step's Z is there now)
        else:
            product(Z, Q, out=T)                                       # Q = Z Q
            Q, T = T, Q
            current = Z
        identity = False
        if k == last:
            break
        if k in restarts:                                              # X = Q X_0, R afresh
            if tall:
                product(X, Q.mT, out=spare)
            else:
                product(Q, X, out=spare)
            X, spare = spare, X
            gram(X, R)
            identity = True
        else:
            product(current, R, out=T)                                 # R = Z (Z R)
            product(current, T, out=R)
    if tall:                                                           # X = Q X_0
        product(X, Q.mT, out=spare)
    else:
        product(Q, X, out=spare)
    return spare


def gram_writes(steps: int, restarts: Sequence[int]) -> int:
    """How many times ``gram_iterations`` writes an iterate buffer: once per restart before the
    last step, and the final Q X. An even count leaves the result in the input's buffer."""
    return 1 + sum(1 for k in set(restarts) if 0 <= k < steps - 1)


DEFAULT_GRAM_RESTARTS = {torch.float16: (1,), torch.float32: (2,), torch.float64: (2,)}
"""Where the gram form restarts by default, by the dtype it iterates in. Rounding gives R small
negative eigenvalues that each step multiplies by about a^2 until a restart computes R afresh from
X (see the module doc). In fp16 a restart after iteration 2 was too late for Polar Express on an
(8, 200) matrix of condition 1e6 (top singular value 25.7): after iteration 1, as Zhang et al. do,
every input of tests/kernels/test_bounded.py stays bounded. In fp32 the later restart is the more
accurate one (10 Muon steps with random gradients and Keller's coefficients, on shapes from 32 x 96
to 512 x 64, against fp64: 1.4x the plain form's error, against 3.3x after iteration 1). For 5
steps both cost the same products."""


def checked_restarts(restarts) -> tuple[int, ...]:
    """``gram_restarts`` as a tuple of ints: a sequence of whole numbers (iteration indices)."""
    if isinstance(restarts, (str, bytes)) or not isinstance(restarts, Sequence):
        raise TypeError(f"gram_restarts must be a sequence of iteration indices (ints), e.g. (2,), "
                        f"got {restarts!r}")
    bad = [k for k in restarts if isinstance(k, bool) or not isinstance(k, Integral)]
    if bad:
        raise TypeError(f"gram_restarts must hold iteration indices (ints), got {bad[0]!r} in {restarts!r}")
    return tuple(int(k) for k in restarts)


def gram_flops(m: int, n: int, cfg, symmetric: bool = False) -> int:
    """FLOPs of the gram form on one m x n matrix (m <= n); see ``gram_iterations``.
    ``symmetric``: on the Triton kernels, X X^T and R R count half (upper tiles only)."""
    gram_x = 2 * m * m * n  # one X X^T or one Q X
    mm = 2 * m**3
    sym_x, sym_mm = (gram_x // 2, mm // 2) if symmetric else (gram_x, mm)
    total = sym_x  # R_0
    restarts = set(restarts_in(cfg, None))  # a GPU's; for 5 steps every default costs the same
    q_is_identity = True
    for k in range(cfg.steps):
        total += sym_mm  # R @ R
        if not q_is_identity:
            total += mm  # Z @ Q
        q_is_identity = False
        if k == cfg.steps - 1:
            break
        if k in restarts:
            total += gram_x + sym_x  # Q X, then X X^T
            q_is_identity = True
        else:
            total += 2 * mm  # Z (Z R)
    if not q_is_identity:
        total += gram_x  # final Q X_0
    return total


def restarts_in(cfg, dtype: torch.dtype | None) -> tuple[int, ...]:
    """The restarts under ``cfg`` when iterating in ``dtype`` (None: fp16, a GPU's)."""
    if cfg.gram_restarts is not None:
        return cfg.gram_restarts
    return DEFAULT_GRAM_RESTARTS.get(dtype or torch.float16, (2,))


def default_work_dtype(dtype: torch.dtype, native_fp16: bool) -> torch.dtype:
    """The dtype the gram form iterates in by default for compute dtype ``dtype``: fp16 for a
    16-bit compute dtype where the device multiplies fp16 natively, fp32 where it doesn't; fp32
    and fp64 as they are."""
    if dtype in HALF_DTYPES:
        return torch.float16 if native_fp16 else torch.float32
    return dtype


def work_dtype(cfg, dtype: torch.dtype, native_fp16: bool) -> torch.dtype:
    """``cfg.gram_dtype`` if set, else ``default_work_dtype``."""
    return cfg.gram_dtype if cfg.gram_dtype is not None else default_work_dtype(dtype, native_fp16)


def _iterate(X, spare, squares, coeffs, cfg, dtype, kernels="torch"):
    return gram_iterations(X, spare, coeffs, restarts_in(cfg, dtype), squares, kernels=kernels)


FORM = NSForm(
    name="gram",
    squares=4,  # R, Z, Q and a product in flight
    dtypes=GRAM_DTYPES,
    square_matrices=False,
    iterate=_iterate,
    writes=lambda cfg, dtype: gram_writes(cfg.steps, restarts_in(cfg, dtype)),
    flops=lambda m, n, cfg, symmetric=False: gram_flops(m, n, cfg, symmetric),
    work_dtype=work_dtype,
    key=lambda cfg, dtype: f"gram{restarts_in(cfg, dtype)}",
)
