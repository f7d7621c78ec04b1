"""Triton kernels for Newton-Schulz orthogonalisation that exploit symmetry.

One Newton-Schulz iteration on X (m x n, m <= n) with coefficients (a, b, c) is

    A = X @ X^T                 (m x m, symmetric)
    B = b * A + c * A @ A       (A symmetric, so A @ A = A @ A^T: symmetric as well)
    X = a * X + B @ X

Both A and B are symmetric, so only the blocks on or above the diagonal need computing; each
computed block is also written to its mirror position. That turns 2 m^2 n + 2 m^3 of the
4 m^2 n + 2 m^3 FLOPs of a plain iteration into m^2 n + m^3, the idea behind the symmetric
kernels in Dion's Newton-Schulz implementation (microsoft/dion, ``newton_schulz_triton.py``)
and in the "flash-muon" project. The code here is written from the Triton matmul tutorial's
structure (block pointers, masked loads, a K loop with fp32 accumulation, an epilogue).

Kernels (tutorial shape: ``*_kernel(ptrs, sizes, strides, ..., BLOCKS: tl.constexpr)``):

- ``sym_matmul_kernel``: ``out = alpha * X @ X^T + beta * C`` for a batch of X (B, M, K),
  upper-triangular block grid, mirrored stores.
- ``matmul_kernel``: ``out = alpha * P @ Q + beta * R`` for a batch of P (B, M, K), Q (B, K, N).

Launchers ``sym_matmul`` and ``batched_matmul_add`` check their inputs and allocate the output;
``newton_schulz_triton`` runs the iterations. Every launcher takes arbitrary strides, so
transposed (non-contiguous) views need no copy. Offsets are 64-bit.

Under the Triton interpreter (``TRITON_INTERPRET=1``, set before this module is imported) each
kernel uses a single large-block configuration, and bf16 operands are cast to fp32 before
``tl.dot`` because the interpreter's bf16 dot is wrong.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence, Tuple

import torch

try:
    import triton
    import triton.language as tl

    TRITON_AVAILABLE = True
except ImportError:  # CPU-only installs, macOS, or a torch build without triton
    triton = None
    tl = None
    TRITON_AVAILABLE = False

__all__ = [
    "TRITON_AVAILABLE",
    "INTERPRET",
    "sym_matmul",
    "batched_matmul_add",
    "newton_schulz_triton",
]

# Read once, like triton itself: the interpreter must be chosen before the kernels are defined.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Tile sizes under the interpreter, whose cost grows with the number of program instances and K
# steps: output tiles of 64 rows still split the test shapes (127 rows) so the mirrored stores
# and partial tiles are exercised; long K and N blocks keep the instance count low.
INTERPRET_BLOCK_M = 64
INTERPRET_BLOCK_NK = 128


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------

if TRITON_AVAILABLE:

    def _sym_configs():
        if INTERPRET:
            return [triton.Config({"BLOCK_M": INTERPRET_BLOCK_M, "BLOCK_K": INTERPRET_BLOCK_NK}, num_warps=4, num_stages=1)]
        # Square output tiles (the mirror of a tile must be a tile). Candidates in the range that
        # does well for bf16 on Hopper/Ampere; autotune picks per (M, K).
        return [
            triton.Config({"BLOCK_M": bm, "BLOCK_K": bk}, num_warps=w, num_stages=s)
            for bm, bk, w, s in [
                (128, 64, 8, 3),
                (128, 64, 8, 4),
                (128, 32, 4, 4),
                (128, 128, 8, 3),
                (64, 64, 4, 4),
                (64, 128, 4, 3),
                (64, 32, 4, 5),
            ]
        ]

    def _matmul_configs():
        if INTERPRET:
            return [
                triton.Config(
                    {
                        "BLOCK_M": INTERPRET_BLOCK_M,
                        "BLOCK_N": INTERPRET_BLOCK_NK,
                        "BLOCK_K": INTERPRET_BLOCK_NK,
                        "GROUP_M": 8,
                    },
                    num_warps=4,
                    num_stages=1,
                )
            ]
        return [
            triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=w, num_stages=s)
            for bm, bn, bk, w, s in [
                (128, 256, 64, 8, 3),
                (256, 128, 64, 8, 3),
                (128, 128, 64, 8, 4),
                (128, 128, 32, 4, 4),
                (128, 64, 64, 4, 4),
                (64, 128, 64, 4, 4),
                (64, 64, 64, 4, 4),
                (64, 64, 32, 4, 5),
            ]
        ]

    @triton.autotune(configs=_sym_configs(), key=["M", "K"])
    @triton.jit
    def sym_matmul_kernel(
        X, C, Out,
        M, K,
        stride_xb, stride_xm, stride_xk,
        stride_cb, stride_cm, stride_cn,
        stride_ob, stride_om, stride_on,
        alpha, beta,
        HAS_C: tl.constexpr,
        DOT_FP32: tl.constexpr,
        INPUT_PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """Out[b] = alpha * X[b] @ X[b]^T + beta * C[b] on the tile pairs (i, j) with i <= j."""
        pid = tl.program_id(0)
        batch = tl.program_id(1).to(tl.int64)

        # pid enumerates the pairs row by row of the lower triangle: pid = j (j + 1) / 2 + i with
        # 0 <= i <= j. Invert with a float sqrt, then correct a possible off-by-one from rounding.
        j = ((tl.sqrt(8.0 * pid.to(tl.float32) + 1.0) - 1.0) * 0.5).to(tl.int32)
        j = tl.where(j * (j + 1) // 2 > pid, j - 1, j)
        j = tl.where((j + 1) * (j + 2) // 2 <= pid, j + 1, j)
        i = pid - j * (j + 1) // 2

        offs_i = i.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_j = j.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        offs_k64 = offs_k.to(tl.int64)
        mask_i = offs_i < M
        mask_j = offs_j < M

        x_batch = X + batch * stride_xb
        xi_ptrs = x_batch + offs_i[:, None] * stride_xm + offs_k64[None, :] * stride_xk
        xj_ptrs = x_batch + offs_j[:, None] * stride_xm + offs_k64[None, :] * stride_xk
        # A 64-bit scalar step: BLOCK_K * stride could pass 2**31 for widely strided views.
        k_step = tl.cast(BLOCK_K, tl.int64) * stride_xk
        acc = tl.zeros((BLOCK_M, BLOCK_M), dtype=tl.float32)
        for k_start in range(0, K, BLOCK_K):
            mask_k = offs_k < K - k_start
            xi = tl.load(xi_ptrs, mask=mask_i[:, None] & mask_k[None, :], other=0.0)
            xj = tl.load(xj_ptrs, mask=mask_j[:, None] & mask_k[None, :], other=0.0)
            if DOT_FP32:
                xi = xi.to(tl.float32)
                xj = xj.to(tl.float32)
            acc = tl.dot(xi, tl.trans(xj), acc, input_precision=INPUT_PRECISION)
            xi_ptrs += k_step
            xj_ptrs += k_step

        acc = acc * alpha
        mask_ij = mask_i[:, None] & mask_j[None, :]
        # Tile (i, j), then the same values to tile (j, i) by swapping the row/column strides of
        # the pointers: element [r, s] of the tile lands at (offs_j[s], offs_i[r]).
        c_ij = C + batch * stride_cb + offs_i[:, None] * stride_cm + offs_j[None, :] * stride_cn
        o_ij = Out + batch * stride_ob + offs_i[:, None] * stride_om + offs_j[None, :] * stride_on
        res = acc
        if HAS_C:
            res = res + beta * tl.load(c_ij, mask=mask_ij, other=0.0).to(tl.float32)
        tl.store(o_ij, res.to(Out.dtype.element_ty), mask=mask_ij)

        if i != j:
            c_ji = C + batch * stride_cb + offs_i[:, None] * stride_cn + offs_j[None, :] * stride_cm
            o_ji = Out + batch * stride_ob + offs_i[:, None] * stride_on + offs_j[None, :] * stride_om
            res_t = acc
            if HAS_C:
                res_t = res_t + beta * tl.load(c_ji, mask=mask_ij, other=0.0).to(tl.float32)
            tl.store(o_ji, res_t.to(Out.dtype.element_ty), mask=mask_ij)

    @triton.autotune(configs=_matmul_configs(), key=["M", "N", "K"])
    @triton.jit
    def matmul_kernel(
        P, Q, R, Out,
        M, N, K,
        stride_pb, stride_pm, stride_pk,
        stride_qb, stride_qk, stride_qn,
        stride_rb, stride_rm, stride_rn,
        stride_ob, stride_om, stride_on,
        alpha, beta,
        HAS_R: tl.constexpr,
        DOT_FP32: tl.constexpr,
        INPUT_PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
    ):
        """Out[b] = alpha * P[b] @ Q[b] + beta * R[b]."""
        pid = tl.program_id(0)
        batch = tl.program_id(1).to(tl.int64)

        # Walk the output tiles in column-major groups of GROUP_M tile rows so that consecutive
        # programs share rows of P and columns of Q in L2.
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        pids_per_group = GROUP_M * num_pid_n
        first_m = (pid // pids_per_group) * GROUP_M
        rows_in_group = tl.minimum(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (pid % pids_per_group) % rows_in_group
        pid_n = (pid % pids_per_group) // rows_in_group

        offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        offs_k64 = offs_k.to(tl.int64)
        mask_m = offs_m < M
        mask_n = offs_n < N

        p_ptrs = P + batch * stride_pb + offs_m[:, None] * stride_pm + offs_k64[None, :] * stride_pk
        q_ptrs = Q + batch * stride_qb + offs_k64[:, None] * stride_qk + offs_n[None, :] * stride_qn
        p_step = tl.cast(BLOCK_K, tl.int64) * stride_pk
        q_step = tl.cast(BLOCK_K, tl.int64) * stride_qk
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k_start in range(0, K, BLOCK_K):
            mask_k = offs_k < K - k_start
            p = tl.load(p_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            q = tl.load(q_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            if DOT_FP32:
                p = p.to(tl.float32)
                q = q.to(tl.float32)
            acc = tl.dot(p, q, acc, input_precision=INPUT_PRECISION)
            p_ptrs += p_step
            q_ptrs += q_step

        res = acc * alpha
        mask_mn = mask_m[:, None] & mask_n[None, :]
        if HAS_R:
            r = tl.load(
                R + batch * stride_rb + offs_m[:, None] * stride_rm + offs_n[None, :] * stride_rn,
                mask=mask_mn,
                other=0.0,
            )
            res = res + beta * r.to(tl.float32)
        o = Out + batch * stride_ob + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
        tl.store(o, res.to(Out.dtype.element_ty), mask=mask_mn)


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------


def _require_triton() -> None:
    if not TRITON_AVAILABLE:
        raise RuntimeError("triton is not installed; use newton_schulz(..., backend='torch')")


def _check_tensor(name: str, t: torch.Tensor, ndim: int = 3) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D (batch, rows, cols), got shape {tuple(t.shape)}")
    if t.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {t.dtype} (shape {tuple(t.shape)})")
    if t.device.type != "cuda" and not (INTERPRET and t.device.type == "cpu"):
        raise ValueError(
            f"{name} of shape {tuple(t.shape)} is on {t.device}: Triton kernels need a CUDA tensor "
            "(or TRITON_INTERPRET=1 set before importing this module, for CPU tensors)"
        )


def _check_same_device(ref_name: str, ref: torch.Tensor, name: str, t: torch.Tensor) -> None:
    if t.device != ref.device:
        raise ValueError(
            f"{name} of shape {tuple(t.shape)} is on {t.device} but {ref_name} of shape "
            f"{tuple(ref.shape)} is on {ref.device}"
        )


def _check_no_alias(out: torch.Tensor, **inputs: Optional[torch.Tensor]) -> None:
    # Programs read tiles that other programs write, and autotuning re-runs the kernel.
    ptr = out.untyped_storage().data_ptr()
    for name, t in inputs.items():
        if t is not None and t.untyped_storage().data_ptr() == ptr:
            raise ValueError(f"out of shape {tuple(out.shape)} shares memory with {name}; pass a separate buffer")


def _dot_flags(*dtypes: torch.dtype) -> Tuple[bool, str]:
    dot_fp32 = INTERPRET and any(d == torch.bfloat16 for d in dtypes)
    # fp32 operands follow torch's own setting, so the fp32 loop compares like for like.
    precision = "ieee" if torch.get_float32_matmul_precision() == "highest" else "tf32"
    return dot_fp32, precision


def sym_matmul(
    X: torch.Tensor,
    out: Optional[torch.Tensor] = None,
    *,
    C: Optional[torch.Tensor] = None,
    alpha: float = 1.0,
    beta: float = 1.0,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """``alpha * X @ X^T (+ beta * C)`` for X of shape (B, m, k), computing only upper tiles.

    Returns (B, m, m) in ``out_dtype`` (default: X's dtype), written into ``out`` when given.
    ``C`` (B, m, m), if given, is added with weight ``beta``; any strides are accepted.
    """
    _require_triton()
    _check_tensor("X", X)
    num_batch, m, k = X.shape
    dtype = out_dtype if out_dtype is not None else X.dtype
    if C is not None:
        _check_tensor("C", C)
        _check_same_device("X", X, "C", C)
        if tuple(C.shape) != (num_batch, m, m):
            raise ValueError(f"C must have shape {(num_batch, m, m)} for X of shape {tuple(X.shape)}, got {tuple(C.shape)}")
    if out is None:
        out = torch.empty((num_batch, m, m), device=X.device, dtype=dtype)
    else:
        _check_tensor("out", out)
        _check_same_device("X", X, "out", out)
        if tuple(out.shape) != (num_batch, m, m):
            raise ValueError(f"out must have shape {(num_batch, m, m)} for X of shape {tuple(X.shape)}, got {tuple(out.shape)}")
        if out_dtype is not None and out.dtype != out_dtype:
            raise ValueError(f"out of shape {tuple(out.shape)} has dtype {out.dtype}, expected {out_dtype}")
        _check_no_alias(out, X=X, C=C)
    if num_batch == 0 or m == 0:
        return out
    if k == 0:
        # Empty product: only the epilogue remains.
        return out.copy_(beta * C if C is not None else torch.zeros_like(out))

    dot_fp32, precision = _dot_flags(X.dtype)
    c = C if C is not None else out  # never read when HAS_C is False
    grid = lambda meta: (  # noqa: E731
        triton.cdiv(m, meta["BLOCK_M"]) * (triton.cdiv(m, meta["BLOCK_M"]) + 1) // 2,
        num_batch,
    )
    sym_matmul_kernel[grid](
        X, c, out,
        m, k,
        X.stride(0), X.stride(1), X.stride(2),
        c.stride(0), c.stride(1), c.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        float(alpha), float(beta),
        HAS_C=C is not None,
        DOT_FP32=dot_fp32,
        INPUT_PRECISION=precision,
    )
    return out


def batched_matmul_add(
    P: torch.Tensor,
    Q: torch.Tensor,
    R: Optional[torch.Tensor] = None,
    alpha: float = 1.0,
    beta: float = 1.0,
    *,
    out: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """``alpha * P @ Q (+ beta * R)`` for P (B, M, K), Q (B, K, N), R (B, M, N); any strides."""
    _require_triton()
    _check_tensor("P", P)
    _check_tensor("Q", Q)
    _check_same_device("P", P, "Q", Q)
    if P.dtype != Q.dtype:
        raise ValueError(f"P of shape {tuple(P.shape)} is {P.dtype} but Q of shape {tuple(Q.shape)} is {Q.dtype}")
    num_batch, m, k = P.shape
    if Q.shape[0] != num_batch or Q.shape[1] != k:
        raise ValueError(f"Q of shape {tuple(Q.shape)} does not match P of shape {tuple(P.shape)} (need (B, K, N))")
    n = Q.shape[2]
    if R is not None:
        _check_tensor("R", R)
        _check_same_device("P", P, "R", R)
        if tuple(R.shape) != (num_batch, m, n):
            raise ValueError(f"R must have shape {(num_batch, m, n)}, got {tuple(R.shape)}")
    dtype = out_dtype if out_dtype is not None else P.dtype
    if out is None:
        out = torch.empty((num_batch, m, n), device=P.device, dtype=dtype)
    else:
        _check_tensor("out", out)
        _check_same_device("P", P, "out", out)
        if tuple(out.shape) != (num_batch, m, n):
            raise ValueError(f"out must have shape {(num_batch, m, n)}, got {tuple(out.shape)}")
        if out_dtype is not None and out.dtype != out_dtype:
            raise ValueError(f"out of shape {tuple(out.shape)} has dtype {out.dtype}, expected {out_dtype}")
        _check_no_alias(out, P=P, Q=Q, R=R)
    if num_batch == 0 or m == 0 or n == 0:
        return out
    if k == 0:
        return out.copy_(beta * R if R is not None else torch.zeros_like(out))

    dot_fp32, precision = _dot_flags(P.dtype, Q.dtype)
    r = R if R is not None else out
    grid = lambda meta: (  # noqa: E731
        triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),
        num_batch,
    )
    matmul_kernel[grid](
        P, Q, r, out,
        m, n, k,
        P.stride(0), P.stride(1), P.stride(2),
        Q.stride(0), Q.stride(1), Q.stride(2),
        r.stride(0), r.stride(1), r.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        float(alpha), float(beta),
        HAS_R=R is not None,
        DOT_FP32=dot_fp32,
        INPUT_PRECISION=precision,
    )
    return out


def newton_schulz_triton(X: torch.Tensor, coefficients: Sequence[Tuple[float, float, float]]) -> torch.Tensor:
    """Run Newton-Schulz iterations ``X <- a X + (b A + c A A) X`` with ``A = X X^T``.

    ``X`` is (B, m, n) with m <= n, already normalised (spectral norm <= 1) and transposed by the
    caller; any strides. Intermediates are kept in X's dtype (fp32 accumulation inside the
    kernels). Returns a new contiguous (B, m, n) tensor of X's dtype.
    """
    _require_triton()
    _check_tensor("X", X)
    num_batch, m, n = X.shape
    if m > n:
        raise ValueError(f"X must have m <= n (transpose first), got shape {tuple(X.shape)}")
    coefficients = [tuple(float(v) for v in abc) for abc in coefficients]
    for abc in coefficients:
        if len(abc) != 3:
            raise ValueError(f"each coefficient must be an (a, b, c) triple, got {abc}")
    if not coefficients:
        return X.clone(memory_format=torch.contiguous_format)

    gram = torch.empty((num_batch, m, m), device=X.device, dtype=X.dtype)
    poly = torch.empty_like(gram)
    buffers = [torch.empty((num_batch, m, n), device=X.device, dtype=X.dtype) for _ in range(min(2, len(coefficients)))]
    current = X
    for step, (a, b, c) in enumerate(coefficients):
        sym_matmul(current, out=gram)
        sym_matmul(gram, out=poly, C=gram, alpha=c, beta=b)
        nxt = buffers[step % len(buffers)]
        batched_matmul_add(poly, current, current, alpha=1.0, beta=a, out=nxt)
        current = nxt
    return current
