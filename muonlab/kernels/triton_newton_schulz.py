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
``newton_schulz_triton`` checks X once and runs the iterations through unchecked internal
launchers, optionally into a caller's ``NSWorkspace`` (no allocation, no host sync: CUDA-graph
capturable after one warm-up call). Every launcher takes arbitrary strides, so transposed
(non-contiguous) views need no copy. Offsets are 64-bit.

Host cost: each distinct launch (kernel, sizes, strides, dtypes, pointer alignment, flags) is
resolved once through the autotuner and then replayed from a small cache by calling the compiled
kernel directly (see "Launch cache" below; ``launch_mode`` switches it for tests and benchmarks).

Under the Triton interpreter (``TRITON_INTERPRET=1``, set before this module is imported) each
kernel uses a single large-block configuration, and bf16 operands are cast to fp32 before
``tl.dot`` because the interpreter's bf16 dot is wrong.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

from .coefficients import coefficient_table
from .precision import TRITON_DTYPES, fp32_matmul_precision, is_number

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
    "NSWorkspace",
    "LAUNCH_MODES",
    "launch_mode",
    "launch_cache_info",
    "clear_launch_cache",
]

# Read once, like triton itself: the interpreter must be chosen before the kernels are defined.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

_SUPPORTED_DTYPES = TRITON_DTYPES  # one list for the kernels and for the dispatch that routes to them

# Tile sizes under the interpreter, whose cost grows with the number of program instances and K
# steps: output tiles of 64 rows still split the test shapes (127 rows) so the mirrored stores
# and partial tiles are exercised; long K and N blocks keep the instance count low.
INTERPRET_BLOCK_M = 64
INTERPRET_BLOCK_NK = 128


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------

if TRITON_AVAILABLE:

    # Autotune candidates: the winners measured on an H100 (bf16, triton 3.6, torch 2.11) over the
    # shapes of benchmarks/bench_newton_schulz_triton.py, out of 7 sym / 8 matmul candidates that
    # took minutes to tune on a cold cache. Re-measure before adding any: every extra config is one
    # more compile per specialization.
    _SYM_TUNED = [
        # (BLOCK_M, BLOCK_K, num_warps, num_stages)
        (64, 128, 4, 3),  # won every (M, K) measured except the two below
        (128, 128, 8, 3),  # won at (4096, 4096)
        (64, 64, 4, 4),  # won at (512, 1408); (512, 512) preferred 64/32/w4/s5 by a hair
    ]
    _MATMUL_TUNED = [
        # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages), GROUP_M = 8
        (128, 256, 64, 8, 3),  # won every (M, N, K) measured except the one below
        (128, 64, 64, 4, 4),  # won at (768, 768, 768)
    ]

    def _sym_configs():
        if INTERPRET:
            return [triton.Config({"BLOCK_M": INTERPRET_BLOCK_M, "BLOCK_K": INTERPRET_BLOCK_NK}, num_warps=4, num_stages=1)]
        # Square output tiles: the mirror of a tile must be a tile.
        return [
            triton.Config({"BLOCK_M": bm, "BLOCK_K": bk}, num_warps=w, num_stages=s) for bm, bk, w, s in _SYM_TUNED
        ]

    def _prune_sym_configs(configs, named_args, **kwargs):
        # The candidates are bf16 winners: another dtype (fp32 and fp16 run in tests and fp32
        # parity checks) takes the first one untuned, rather than compiling every candidate for a
        # ranking nobody measured. 128-row tiles won only at M = 4096; below that they leave SMs
        # idle (fewer tile pairs), so skip compiling and timing them there. Never prune to nothing.
        if named_args["X"].dtype != torch.bfloat16:
            return configs[:1]
        if named_args["M"] >= 4096:
            return configs
        small = [c for c in configs if c.kwargs["BLOCK_M"] <= 64]
        return small or configs

    def _prune_matmul_configs(configs, named_args, **kwargs):
        # as for sym_matmul: only bf16 is tuned
        return configs if named_args["P"].dtype == torch.bfloat16 else configs[:1]

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
            for bm, bn, bk, w, s in _MATMUL_TUNED
        ]

    # Keyed on the sizes (the autotuner adds the dtypes), not on batch or strides: one tuning run
    # per size pair, as the winners above were measured.
    @triton.autotune(configs=_sym_configs(), key=["M", "K"], prune_configs_by={"early_config_prune": _prune_sym_configs})
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

    @triton.autotune(configs=_matmul_configs(), key=["M", "N", "K"],
                     prune_configs_by={"early_config_prune": _prune_matmul_configs})
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


def _check_out_dtype(out_dtype: Optional[torch.dtype]) -> None:
    # The kernels cast their fp32 results into whatever the output holds: an int or bool output
    # would be truncated silently, an fp64 one is refused as an fp64 `out` tensor is.
    if out_dtype is not None and out_dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"out_dtype must be float32, float16 or bfloat16 (or None), got {out_dtype!r}")


def _overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may share memory (an expand()ed batch: stride 0). With the dims
    sorted by stride, each stride must step past every element the smaller-strided dims reach:
    False proves the elements distinct (dense, sliced and transposed views pass); True may also
    refuse an exotic interleaving whose elements happen to be distinct."""
    reach = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz > 1):
        if stride < reach:
            return True
        reach += (size - 1) * stride
    return False


def _check_out(out: torch.Tensor) -> None:
    # Every program stores its tile; if two elements of out are one location, one batch's (or
    # tile's) result silently overwrites another's, as torch.bmm(out=...) refuses too.
    if _overlaps_itself(out):
        raise ValueError(f"out of shape {tuple(out.shape)} and strides {out.stride()} has elements that share "
                         "memory (an expand()ed tensor?); pass a tensor whose elements are distinct")


def _check_no_alias(out: torch.Tensor, **inputs: Optional[torch.Tensor]) -> None:
    # Programs read tiles that other programs write, and autotuning re-runs the kernel. Byte
    # ranges, not storages, are compared: disjoint views of one buffer (an arena) are safe.
    lo, hi = _span(out)
    for name, t in inputs.items():
        if t is None:
            continue
        t_lo, t_hi = _span(t)
        if lo < t_hi and t_lo < hi:
            raise ValueError(f"out of shape {tuple(out.shape)} shares memory with {name}; pass a separate buffer")


def _dot_flags(*dtypes: torch.dtype) -> Tuple[bool, str]:
    dot_fp32 = INTERPRET and any(d == torch.bfloat16 for d in dtypes)
    # fp32 operands follow torch's own setting, so the fp32 loop compares like for like (read
    # through the helper: the legacy getter raises once torch's newer precision API was used).
    precision = fp32_matmul_precision()
    return dot_fp32, precision


# --------------------------------------------------------------------------------------------
# Launch cache
# --------------------------------------------------------------------------------------------
#
# A launch through the autotuner costs about 60 us of host time on an H100 host (key lookup,
# argument binding and specialization, Python checks) against about 14 us for torch.bmm, and below
# width 4096 a Newton-Schulz chain is host-bound. So each distinct launch is resolved once: the
# autotuner picks the config, triton compiles, and the entry keeps the compiled kernel, its grid
# and the constant arguments. Later launches with the same key call the compiled kernel's launcher
# directly, exactly as JITFunction.run does in triton 3.4-3.9:
#
#     kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata,
#                launch_metadata, enter_hook, exit_hook, *every_argument_including_constexprs)
#
# The key must hold everything triton specializes a compiled kernel on, or a cached kernel could
# be launched with arguments it was not compiled for: the dtypes, every integer argument exactly
# (triton specializes ints on == 1, on divisibility by 16 and on 32/64-bit range), whether each
# pointer is 16-byte aligned, and the constexpr flags. Floats are never specialized, so alpha and
# beta stay out of the key.
#
# The direct call is internal triton API. The first direct launch of each kernel in a process is
# checked bit for bit against the output of the normal launch that resolved it; if the call
# raises or differs, that kernel falls back to JITFunction[grid](...) with the tuned config (no
# autotuner, still correct) and a warning says so.

LAUNCH_MODES = ("direct", "jit", "autotune")
_launch_mode = "direct" if os.environ.get("MUONLAB_TRITON_FAST_LAUNCH", "1") != "0" else "jit"

_CACHE_CAPACITY = 512  # a Newton-Schulz chain needs 3-6 keys per shape; this bounds odd callers
_launch_cache: "dict[tuple, _Launch]" = {}
# Per kernel name: None (not checked yet), True (direct launches verified), False (fall back).
_direct_api_ok: dict = {}
_cache_stats = {"hits": 0, "misses": 0}


class launch_mode:
    """Context manager (or plain call) choosing how the Triton launchers launch, for tests and
    benchmarks: "direct" (default: cached compiled kernel, falling back to "jit" where the direct
    call was not verified), "jit" (cached config, launched through JITFunction[grid]) or
    "autotune" (no cache: every launch through the autotuner, as before the cache existed).
    ``MUONLAB_TRITON_FAST_LAUNCH=0`` in the environment makes "jit" the default."""

    def __init__(self, mode: str):
        if mode not in LAUNCH_MODES:
            raise ValueError(f"launch mode must be one of {LAUNCH_MODES}, got {mode!r}")
        global _launch_mode
        self._previous = _launch_mode
        _launch_mode = mode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        global _launch_mode
        _launch_mode = self._previous


def clear_launch_cache() -> None:
    """Forget every resolved launch and the direct-launch verdicts (the autotuner's own cache and
    triton's compiled kernels stay)."""
    _launch_cache.clear()
    _direct_api_ok.clear()
    _cache_stats.update(hits=0, misses=0)


def launch_cache_info() -> dict:
    """Entries, hits and misses of the launch cache, and each entry's kernel, grid, config and
    whether it launches directly (for tests and benchmarks)."""
    return {
        "entries": len(_launch_cache),
        "hits": _cache_stats["hits"],
        "misses": _cache_stats["misses"],
        "direct_api_ok": dict(_direct_api_ok),
        "launches": [
            {"kernel": e.name, "grid": e.grid, "config": dict(e.config_kwargs), "direct": e.direct is not None}
            for e in _launch_cache.values()
        ],
    }


def _runtime_knobs():
    # triton >= 3.4 keeps the launch hooks here; without it there is no known direct-call form.
    knobs = getattr(triton, "knobs", None) if TRITON_AVAILABLE else None
    return getattr(knobs, "runtime", None)


if TRITON_AVAILABLE and hasattr(torch._C, "_cuda_getCurrentRawStream"):
    _raw_stream = torch._C._cuda_getCurrentRawStream  # what triton's own driver calls
else:  # pragma: no cover - other torch builds

    def _raw_stream(device_index: int) -> int:
        return torch.cuda.current_stream(device_index).cuda_stream


def _direct_launcher(compiled, grid: Tuple[int, ...], tail: tuple):
    """A function ``launch(args, stream)`` calling ``compiled`` the way JITFunction.run does, or
    None when ``compiled`` does not look like a triton >= 3.4 CompiledKernel."""
    knobs = _runtime_knobs()
    needed = ("run", "function", "packed_metadata", "launch_metadata")
    if knobs is None or compiled is None or not all(hasattr(compiled, a) for a in needed):
        return None
    try:
        run = compiled.run  # a property: loads the module on first access
        function = compiled.function
        packed = compiled.packed_metadata
    except Exception:  # noqa: BLE001 - any failure here means: use the JIT launch
        return None
    metadata = compiled.launch_metadata
    grid = tuple(grid) + (1,) * (3 - len(grid))
    g0, g1, g2 = grid

    def launch(args: tuple, stream: int) -> None:
        full = args + tail
        # hooks read at each launch, like triton, so a profiler attached later still sees us
        run(g0, g1, g2, stream, function, packed, metadata(grid, stream, *full),
            knobs.launch_enter_hook, knobs.launch_exit_hook, *full)

    return launch


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _direct_matches(reference: torch.Tensor, run_into) -> bool:
    """Whether ``run_into(buffer)`` writes exactly ``reference`` (bit for bit, NaNs included) into
    a fresh buffer of reference's layout; False as well when it raises."""
    scratch = torch.empty_strided(reference.shape, reference.stride(), dtype=reference.dtype, device=reference.device)
    try:
        run_into(scratch)
    except Exception as err:  # noqa: BLE001 - the verdict is the point; the reason goes in a warning
        warnings.warn(f"direct Triton launch failed ({type(err).__name__}: {err}); using the JIT launcher")
        return False
    return bool(torch.equal(_bits(scratch), _bits(reference)))


class _Launch:
    """One resolved launch: tuned config, grid, and (when verified) a direct launcher."""

    __slots__ = ("name", "jit_fn", "grid", "config_kwargs", "jit_kwargs", "direct", "device_index")

    def __init__(self, name, jit_fn, grid, config_kwargs, jit_kwargs, direct, device_index):
        self.name = name
        self.jit_fn = jit_fn
        self.grid = grid
        self.config_kwargs = config_kwargs
        self.jit_kwargs = jit_kwargs
        self.direct = direct
        self.device_index = device_index

    def __call__(self, args: tuple) -> None:
        if self.direct is not None and _launch_mode == "direct":
            self.direct(args, _raw_stream(self.device_index))
        else:
            self.jit_fn[self.grid](*args, **self.jit_kwargs)


def _launch(name: str, kernel, key: tuple, args: tuple, flags: dict, grid_of, out_pos: int) -> None:
    """Launch ``kernel`` (an Autotuner) on the runtime ``args`` (in signature order, constexprs
    excluded) with the constexpr ``flags``; ``grid_of(config_kwargs)`` gives the grid and
    ``args[out_pos]`` is the output (used once, to verify the direct launch)."""
    if _launch_mode == "autotune":
        kernel[lambda meta: grid_of(meta)](*args, **flags)
        return
    entry = _launch_cache.get(key)
    if entry is not None:
        _cache_stats["hits"] += 1
        entry(args)
        return
    _cache_stats["misses"] += 1
    out = args[out_pos]
    if out.is_cuda and torch.cuda.is_current_stream_capturing():
        # Resolving autotunes (timed runs, a host sync) and verifies the direct call (another sync).
        raise RuntimeError(
            f"{name}: no resolved launch for these tensors (output shape {tuple(out.shape)}) during CUDA graph "
            "capture; run the same call once eagerly, with the same tensors, before capturing"
        )
    compiled = kernel[lambda meta: grid_of(meta)](*args, **flags)  # autotunes a new size key, launches
    config = kernel.best_config
    config_kwargs = dict(config.kwargs)
    grid = tuple(grid_of(config_kwargs))
    direct = None
    if not INTERPRET:
        jit_fn = kernel.fn
        runtime_names = list(jit_fn.arg_names[: len(args)])
        tail_names = list(jit_fn.arg_names[len(args):])
        constexprs = {**flags, **config_kwargs}
        # internal invariant: the kernels list their runtime arguments first, constexprs last
        assert sorted(tail_names) == sorted(constexprs), (runtime_names, tail_names, sorted(constexprs))
        tail = tuple(constexprs[n] for n in tail_names)
        direct = _direct_launcher(compiled, grid, tail)
        if direct is not None:
            ok = _direct_api_ok.get(name)
            if ok is None:
                stream = _raw_stream(out.device.index)
                ok = _direct_matches(
                    out, lambda buf: direct(args[:out_pos] + (buf,) + args[out_pos + 1:], stream)
                )
                _direct_api_ok[name] = ok
                if not ok:
                    warnings.warn(
                        f"triton {triton.__version__}: launching the compiled {name} directly did not reproduce "
                        "the normal launch; using JITFunction[grid] with the tuned config instead (slower host path)"
                    )
            if not ok:
                direct = None
    if len(_launch_cache) >= _CACHE_CAPACITY:
        _launch_cache.pop(next(iter(_launch_cache)))  # oldest first: callers with endless layouts
    _launch_cache[key] = _Launch(
        name, kernel.fn, grid, config_kwargs, {**flags, **config.all_kwargs()}, direct,
        out.device.index if out.is_cuda else None,
    )


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0  # triton's pointer specialization (tt.divisibility = 16)


def _sym_grid(m: int, num_batch: int):
    def grid_of(meta) -> Tuple[int, int]:
        tiles = triton.cdiv(m, meta["BLOCK_M"])
        return (tiles * (tiles + 1) // 2, num_batch)

    return grid_of


def _mm_grid(m: int, n: int, num_batch: int):
    def grid_of(meta) -> Tuple[int, int]:
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]), num_batch)

    return grid_of


def _sym_matmul_unchecked(X, C, out, alpha: float, beta: float, dot_fp32: bool, precision: str) -> None:
    """sym_matmul's launch without its checks: X (B, m, k) with k > 0, out (B, m, m) not aliasing
    X or C, C (B, m, m) or None; all on one device; alpha and beta Python floats."""
    num_batch, m, k = X.shape
    c = C if C is not None else out  # never read when HAS_C is False
    key = (
        "sym", X.device, X.dtype, c.dtype, out.dtype, num_batch, m, k,
        X.stride(), c.stride(), out.stride(), _aligned(X), _aligned(c), _aligned(out),
        C is not None, dot_fp32, precision,
    )
    args = (
        X, c, out,
        m, k,
        X.stride(0), X.stride(1), X.stride(2),
        c.stride(0), c.stride(1), c.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        alpha, beta,
    )
    flags = {"HAS_C": C is not None, "DOT_FP32": dot_fp32, "INPUT_PRECISION": precision}
    _launch("sym_matmul_kernel", sym_matmul_kernel, key, args, flags, _sym_grid(m, num_batch), out_pos=2)


def _matmul_unchecked(P, Q, R, out, alpha: float, beta: float, dot_fp32: bool, precision: str) -> None:
    """batched_matmul_add's launch without its checks: P (B, m, k), Q (B, k, n), k > 0, R (B, m, n)
    or None, out (B, m, n) not aliasing the inputs; one device; alpha and beta Python floats."""
    num_batch, m, k = P.shape
    n = Q.shape[2]
    r = R if R is not None else out
    key = (
        "mm", P.device, P.dtype, Q.dtype, r.dtype, out.dtype, num_batch, m, n, k,
        P.stride(), Q.stride(), r.stride(), out.stride(),
        _aligned(P), _aligned(Q), _aligned(r), _aligned(out),
        R is not None, dot_fp32, precision,
    )
    args = (
        P, Q, r, out,
        m, n, k,
        P.stride(0), P.stride(1), P.stride(2),
        Q.stride(0), Q.stride(1), Q.stride(2),
        r.stride(0), r.stride(1), r.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        alpha, beta,
    )
    flags = {"HAS_R": R is not None, "DOT_FP32": dot_fp32, "INPUT_PRECISION": precision}
    _launch("matmul_kernel", matmul_kernel, key, args, flags, _mm_grid(m, n, num_batch), out_pos=3)


# --------------------------------------------------------------------------------------------
# Public launchers
# --------------------------------------------------------------------------------------------


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
    _check_out_dtype(out_dtype)
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
        _check_out(out)
        _check_no_alias(out, X=X, C=C)
    if num_batch == 0 or m == 0:
        return out
    if k == 0:
        # Empty product: only the epilogue remains.
        return out.copy_(beta * C if C is not None else torch.zeros_like(out))
    _sym_matmul_unchecked(X, C, out, float(alpha), float(beta), *_dot_flags(X.dtype))
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
    _check_out_dtype(out_dtype)
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
        _check_out(out)
        _check_no_alias(out, P=P, Q=Q, R=R)
    if num_batch == 0 or m == 0 or n == 0:
        return out
    if k == 0:
        return out.copy_(beta * R if R is not None else torch.zeros_like(out))
    _matmul_unchecked(P, Q, R, out, float(alpha), float(beta), *_dot_flags(P.dtype, Q.dtype))
    return out


def gram_form_products(dtype: torch.dtype):
    """The gram form's three kinds of product on these kernels, for ``newton_schulz``'s gram
    iteration on wide (B, m, n) batches of ``dtype`` (its torch twin uses bmm / baddbmm):

    * ``gram(X, out)``: out = X X^T, upper tiles only (R_0, and R after a restart);
    * ``poly(R, out, b, c)``: out = c R R^T + b R, upper tiles only; R is symmetric, so this is
      b R + c R^2 (Z without its a I);
    * ``product(A, B, out)``: out = A B, every tile (Z Q, Z (Z R) and Q X, whose symmetry would
      need a two-input symmetric kernel).

    Launches go through the launch cache without the public launchers' checks; the caller's
    buffers are the workspace's, disjoint by construction; ``dtype`` is checked (ValueError for
    one the kernels don't take, such as fp64: they would round it and compute garbage)."""
    _require_triton()
    if dtype not in _SUPPORTED_DTYPES:  # the only check on this path: the launches skip theirs
        raise ValueError(f"the Triton gram form needs float32, float16 or bfloat16, got {dtype}; "
                         "use backend='torch' for it")
    dot_fp32, precision = _dot_flags(dtype)

    def gram(X, out):
        _sym_matmul_unchecked(X, None, out, 1.0, 1.0, dot_fp32, precision)

    def poly(R, out, b: float, c: float):
        _sym_matmul_unchecked(R, R, out, float(c), float(b), dot_fp32, precision)

    def product(A, B, out):
        _matmul_unchecked(A, B, None, out, 1.0, 1.0, dot_fp32, precision)

    return gram, poly, product


# --------------------------------------------------------------------------------------------
# Newton-Schulz
# --------------------------------------------------------------------------------------------

_WORKSPACE_FIELDS = ("gram", "poly", "ping", "pong")


@dataclass
class NSWorkspace:
    """Buffers for ``newton_schulz_triton(X, ..., workspace=...)``, reusable across calls.

    All four are contiguous, in X's dtype and on X's device, and overlap neither X nor each other,
    except that ``pong`` may be X itself (contiguous): only the first iteration reads X, so the
    second may overwrite it, and a caller that owns X saves one (B, m, n) buffer.
    Iteration i writes its result to ``ping`` (i even) or ``pong`` (i odd), and the returned
    tensor IS that buffer: consume or copy it before the next call that uses this workspace.
    """

    gram: torch.Tensor
    """(B, m, m): X X^T of the current iteration."""
    poly: torch.Tensor
    """(B, m, m): b A + c A A."""
    ping: torch.Tensor
    """(B, m, n): result of iterations 0, 2, 4, ... (and the copy of X when there are none)."""
    pong: torch.Tensor
    """(B, m, n): result of iterations 1, 3, 5, ..."""

    @classmethod
    def like(cls, X: torch.Tensor) -> "NSWorkspace":
        """Fresh buffers for inputs of X's shape, dtype and device."""
        num_batch, m, n = X.shape
        square = dict(size=(num_batch, m, m), device=X.device, dtype=X.dtype)
        wide = dict(size=(num_batch, m, n), device=X.device, dtype=X.dtype)
        return cls(torch.empty(**square), torch.empty(**square), torch.empty(**wide), torch.empty(**wide))


def _span(t: torch.Tensor) -> Tuple[int, int]:
    """Byte range [start, end) that t's elements can touch."""
    if t.numel() == 0:
        return (t.data_ptr(), t.data_ptr())
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return (t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size())


def _as_workspace(workspace, X: torch.Tensor) -> NSWorkspace:
    if isinstance(workspace, dict):
        missing = [f for f in _WORKSPACE_FIELDS if f not in workspace]
        extra = sorted(set(workspace) - set(_WORKSPACE_FIELDS))
        if missing or extra:
            raise ValueError(f"workspace dict needs exactly the keys {_WORKSPACE_FIELDS}; missing {missing}, unknown {extra}")
        workspace = NSWorkspace(**workspace)
    if not isinstance(workspace, NSWorkspace):
        raise TypeError(f"workspace must be an NSWorkspace or a dict of its fields, got {type(workspace).__name__}")
    num_batch, m, n = X.shape
    expected = {"gram": (num_batch, m, m), "poly": (num_batch, m, m), "ping": (num_batch, m, n), "pong": (num_batch, m, n)}
    spans = {"X": _span(X)}
    for name in _WORKSPACE_FIELDS:
        t = getattr(workspace, name)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"workspace.{name} must be a torch.Tensor, got {type(t).__name__}")
        where = f"workspace.{name} of shape {tuple(t.shape)}, {t.dtype} on {t.device}"
        if tuple(t.shape) != expected[name]:
            raise ValueError(f"{where}: expected shape {expected[name]} for X of shape {tuple(X.shape)}")
        if t.dtype != X.dtype:
            raise ValueError(f"{where}: expected X's dtype {X.dtype}")
        if t.device != X.device:
            raise ValueError(f"{where}: expected X's device {X.device}")
        if not t.is_contiguous():
            raise ValueError(f"{where}: must be contiguous (strides {t.stride()})")
        lo, hi = _span(t)
        if name == "pong" and t.data_ptr() == X.data_ptr() and X.is_contiguous():
            continue  # X itself: overwritten from the second iteration on (see NSWorkspace)
        for other, (olo, ohi) in spans.items():
            if lo < ohi and olo < hi:
                raise ValueError(f"{where}: overlaps {other if other == 'X' else 'workspace.' + other} in memory")
        spans[name] = (lo, hi)
    return workspace


def _coefficient_list(coefficients) -> list:
    """``coefficients`` as a list of float (a, b, c) triples, one per iteration (empty: none), checked
    by ``coefficient_table``. A preset name or one bare triple is refused: both mean "repeat for
    every step" to NSConfig, and this function has no step count; ``resolve_coefficients`` has."""
    bare = isinstance(coefficients, Sequence) and any(is_number(v) for v in coefficients)
    if isinstance(coefficients, str) or bare:
        raise ValueError(f"newton_schulz_triton needs coefficients as a list of (a, b, c) triples, one per "
                         f"iteration, got {coefficients!r}; expand a preset name or a single triple with "
                         "resolve_coefficients(coefficients, steps)")
    if isinstance(coefficients, Sequence) and len(coefficients) == 0:
        return []  # no iterations: X is copied (coefficient_table refuses an empty table)
    try:
        return list(coefficient_table(coefficients))
    except (TypeError, ValueError) as err:  # its messages name Muon's ns_coefficients: say where we are
        raise type(err)(f"newton_schulz_triton's coefficients must be a list of (a, b, c) triples: {err}") from None


def newton_schulz_triton(
    X: torch.Tensor,
    coefficients: Sequence[Tuple[float, float, float]],
    *,
    workspace: "Optional[NSWorkspace | dict]" = None,
) -> torch.Tensor:
    """Run Newton-Schulz iterations ``X <- a X + (b A + c A A) X`` with ``A = X X^T``.

    ``X`` is (B, m, n) with m <= n, already normalised (spectral norm <= 1) and transposed by the
    caller; any strides. Intermediates are kept in X's dtype (fp32 accumulation inside the
    kernels). Returns a contiguous (B, m, n) tensor of X's dtype.

    ``coefficients``: one (a, b, c) per iteration (an empty list copies X); a preset name or one
    bare triple is refused (ValueError): expand it with ``resolve_coefficients(name, steps)``.

    ``workspace`` (an ``NSWorkspace`` or a dict with its fields ``gram``, ``poly``, ``ping``,
    ``pong``): preallocated buffers, checked here (ValueError naming the buffer otherwise). With
    one, the call allocates nothing and never syncs the host, once each launch it makes has been
    resolved by an earlier call with tensors of the same layout; so warm up once, then the chain
    can be captured in a CUDA graph. The result is then ``workspace.ping`` or ``workspace.pong``
    (overwritten by the next call). Results are bit-identical with and without a workspace.

    X is checked once here; the launches skip the public launchers' checks.
    """
    _require_triton()
    _check_tensor("X", X)
    num_batch, m, n = X.shape
    if m > n:
        raise ValueError(f"X must have m <= n (transpose first), got shape {tuple(X.shape)}")
    coefficients = _coefficient_list(coefficients)
    ws = _as_workspace(workspace, X) if workspace is not None else None
    if not coefficients or X.numel() == 0:
        return ws.ping.copy_(X) if ws is not None else X.clone(memory_format=torch.contiguous_format)

    if ws is not None:
        gram, poly, buffers = ws.gram, ws.poly, (ws.ping, ws.pong)
    else:
        gram = torch.empty((num_batch, m, m), device=X.device, dtype=X.dtype)
        poly = torch.empty_like(gram)
        buffers = [torch.empty((num_batch, m, n), device=X.device, dtype=X.dtype) for _ in range(min(2, len(coefficients)))]
    dot_fp32, precision = _dot_flags(X.dtype)
    current = X
    for step, (a, b, c) in enumerate(coefficients):
        _sym_matmul_unchecked(current, None, gram, 1.0, 1.0, dot_fp32, precision)
        _sym_matmul_unchecked(gram, gram, poly, c, b, dot_fp32, precision)
        nxt = buffers[step % 2]
        _matmul_unchecked(poly, current, current, nxt, 1.0, a, dot_fp32, precision)
        current = nxt
    return current
