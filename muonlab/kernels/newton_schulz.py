"""Newton-Schulz orthogonalization: presets, the torch path, backend dispatch, FLOP counts.

Muon replaces a matrix update G = U S V^T by (approximately) U V^T. A few iterations of the odd
polynomial X <- a X + b (X X^T) X + c (X X^T)^2 X push every singular value of a normalised X
towards 1 without an SVD (Keller Jordan, "Muon: An optimizer for hidden layers", 2024).

Two algebraically equal forms are offered:

* ``form="plain"``: the iteration above, 4 m^2 n + 2 m^3 FLOPs per step for an m x n matrix
  (m <= n: a tall matrix iterates on its transpose, algebraically, without a copy).
* ``form="gram"``: iterate on the m x m Gram matrix R = X X^T instead of on X. With X_k = Q_k X_0,
  Z_k = a I + b R_k + c R_k^2 gives Q_{k+1} = Z_k Q_k and R_{k+1} = Z_k R_k Z_k = Z_k^2 R_k
  (Z_k is a polynomial in R_k, so they commute). X is touched only twice (R_0 = X_0 X_0^T and
  X_K = Q_K X_0), so for n >> m most of the 4 m^2 n per step disappears. In low precision R drifts
  from Q R_0 Q^T, so the iteration restarts (X = Q X_0, R = X X^T afresh) after the steps listed in
  ``gram_restarts`` (the restart idea is from Dao-AILab's gram-newton-schulz).
  The gram form never iterates in bf16: rounding R = X X^T to bf16's 8 bits gives it spurious
  negative eigenvalues (about -4e-3 of the top one) where X has none, and the iteration maps a
  negative eigenvalue lambda to Z(lambda)^2 lambda, growing it by a^2 (16-67) per step: near-low-rank
  inputs (what momentum often is) came out with top singular values of 2 to 1e7. It iterates in
  fp16 instead (``gram_work_dtype``), whose 3 more mantissa bits keep 5 steps bounded with one
  restart, as Zhang, Amsel, Chen and Dao do in "Gram Newton-Schulz" (2026); where a device has no
  native fp16 matmul (most CPUs: 2.7 GFLOP/s emulated on this project's AMD EPYC against 860 in
  bf16) it iterates in fp32. Normalised inputs keep every iterate within fp16's range.

Both work on any leading batch dims (one matrix per expert); each matrix is normalised by its own
Frobenius norm, never across the batch.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from numbers import Integral, Real

import torch

Coefficients = list[tuple[float, float, float]]

# Per-iteration (a, b, c). A preset shorter than the requested steps repeats its last entry.
PRESETS: dict[str, Coefficients] = {
    # Keller Jordan's Muon: one quintic, repeated.
    "keller": [(3.4445, -4.7750, 2.0315)],
    # XTuner's / Moonlight-era tuned per-step coefficients.
    "xtuner": [
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ],
    # Polar Express (Amsel et al., 2025), with the input scaled by 1 / (1.02 ||X||_F).
    "polar_express": [
        (8.1566, -22.4833, 15.8788),
        (4.0429, -2.8089, 0.5000),
        (3.8917, -2.7725, 0.5061),
        (3.2858, -2.3681, 0.4645),
        (2.3465, -1.7098, 0.4232),
    ],
}

# Extra safety factor on the normaliser: Polar Express's coefficients assume sigma_max < 1/1.02.
NORM_SCALE = {"keller": 1.0, "xtuner": 1.0, "polar_express": 1.02}

BACKENDS = ("auto", "torch", "triton")
FORMS = ("plain", "gram")


NS_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""Compute dtypes Newton-Schulz accepts (None keeps the input's): integer or boolean matmuls turn
the normalised matrix into zeros or NaN, and float8 has no matmul here."""


TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""Compute dtypes the Triton kernels take: they accumulate ``tl.dot`` in fp32, so fp64 operands
would be rounded (the gram form returned garbage); fp64 runs on the torch backend only."""


GRAM_DTYPES = (torch.float16, torch.float32, torch.float64)
"""Dtypes the gram form may iterate in (``NSConfig.gram_dtype``): not bf16 (see the module doc)."""

HALF_DTYPES = (torch.float16, torch.bfloat16)


def fp32_matmul_precision() -> str:
    """"ieee" or "tf32": how torch runs fp32 CUDA matmuls now, which the Triton kernels follow and
    the "auto" timings key on. Read from ``torch.backends.cuda.matmul.fp32_precision`` ("none"
    there defers to ``torch.backends.fp32_precision``), because once either is set,
    ``torch.get_float32_matmul_precision()`` raises (it refuses to read a mix of the old and new
    APIs). The legacy getter remains the answer where the new attributes don't exist (older
    torch) or say "none"; anything that can't be read counts as torch's default, "ieee"."""
    matmul = getattr(getattr(torch.backends, "cuda", None), "matmul", None)
    precision = None
    try:
        precision = getattr(matmul, "fp32_precision", None)
        if precision == "none":
            precision = getattr(torch.backends, "fp32_precision", None)
    except RuntimeError:  # a torch whose getter exists but can't answer: try the legacy one
        precision = None
    if precision == "ieee":
        return "ieee"
    if isinstance(precision, str) and precision != "none":
        return "tf32"  # "tf32" (or a reduced precision newer than this code, as legacy "medium")
    try:
        legacy = torch.get_float32_matmul_precision()
    except RuntimeError:  # mixed legacy and new settings that resolved to "none" above
        return "ieee"
    return "ieee" if legacy == "highest" else "tf32"


def is_number(value) -> bool:
    """A real number, not a bool: bool is an int to Python, but True as a coefficient, an eps or
    a learning rate is a mistake, not a number."""
    return isinstance(value, Real) and not isinstance(value, bool)


def _triple(abc, coefficients) -> tuple[float, float, float]:
    if isinstance(abc, (str, bytes)) or not isinstance(abc, Sequence):
        raise TypeError(f"ns_coefficients entries must be (a, b, c) sequences of numbers, got {abc!r} "
                        f"in {coefficients!r}")
    if not all(is_number(v) for v in abc):
        raise TypeError(f"ns_coefficients entries must hold numbers, got {abc!r} in {coefficients!r}")
    if len(abc) != 3:
        raise ValueError(f"ns_coefficients must be a preset name, one (a, b, c) or a non-empty list of (a, b, c), "
                         f"got an entry of length {len(abc)}: {coefficients!r}")
    if not all(math.isfinite(v) for v in abc):
        raise ValueError(f"ns_coefficients must be finite, got {abc!r}")
    return tuple(float(v) for v in abc)


def coefficient_table(coefficients: str | Sequence) -> str | tuple[tuple[float, float, float], ...]:
    """A preset name as is, or explicit coefficients as a tuple of float (a, b, c) triples.

    One bare triple ``(a, b, c)`` (torch.optim.Muon's format) is a table of one entry, which
    ``resolve_coefficients`` repeats for every step, as torch does.
    """
    if isinstance(coefficients, str):
        if coefficients not in PRESETS:
            raise ValueError(
                f"unknown Newton-Schulz preset {coefficients!r}; choose one of {sorted(PRESETS)} "
                "or pass ns_coefficients as (a, b, c) or a list of (a, b, c) tuples"
            )
        return coefficients
    if isinstance(coefficients, bytes) or not isinstance(coefficients, Sequence):
        raise TypeError(f"ns_coefficients must be a preset name, one (a, b, c) or a list of (a, b, c), "
                        f"got {type(coefficients).__name__} {coefficients!r}")
    if not coefficients:
        raise ValueError(f"ns_coefficients must be a preset name or a non-empty list of (a, b, c), "
                         f"got {coefficients!r}")
    if any(is_number(v) for v in coefficients):  # numbers at the top level: one bare triple
        return (_triple(coefficients, coefficients),)
    return tuple(_triple(abc, coefficients) for abc in coefficients)


def resolve_coefficients(coefficients: str | Sequence, steps: int) -> Coefficients:
    """Return exactly ``steps`` (a, b, c) tuples for a preset name, one (a, b, c) or a list of them;
    a table shorter than ``steps`` repeats its last entry."""
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"ns_steps must be a positive integer, got {steps!r}")
    table = coefficient_table(coefficients)
    if isinstance(table, str):
        table = PRESETS[table]
    return [table[min(i, len(table) - 1)] for i in range(steps)]


def norm_scale(coefficients: str | Sequence) -> float:
    return NORM_SCALE.get(coefficients, 1.0) if isinstance(coefficients, str) else 1.0


def _normalise_into(out: torch.Tensor, X: torch.Tensor, eps: float, scale: float) -> torch.Tensor:
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
    """``_normalise_into`` for fp16, whose range (65504) a matrix of finite fp16 values can pass in
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


def _plain_iterations(X: torch.Tensor, spare: torch.Tensor, coeffs: Coefficients, gram: torch.Tensor,
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


def _gram_iterations(X: torch.Tensor, spare: torch.Tensor, coeffs: Coefficients, restarts: Sequence[int],
                     squares: Sequence[torch.Tensor], kernels: str = "torch") -> torch.Tensor:
    """The gram form on the normalised batch in ``X``, in preallocated buffers: ``spare`` (like X)
    takes each restart's Q X and the final one, and the four (B, m, m) ``squares`` hold R, Z, Q and
    a product in flight, trading roles by name instead of allocating (on this project's 2-core CPU
    a fresh 1.5 MB product per operation, 25 per call, made 12 x 768 x 256 in bf16 take 11.4 ms
    against 7.1 ms in the workspace: first touches of new pages and a cold cache). Returns the
    buffer that holds the result (see ``_gram_writes``). A tall batch iterates as stored, on X^T
    (R = X^T X, X Q^T for Q X): a product written into a transposed view ran 2000x slower in bf16
    on this project's CPU.

    ``kernels="triton"``: the products run on the Triton kernels (X must be wide), whose X X^T and
    b R + c R^2 compute only upper tiles (``triton_newton_schulz.gram_form_products``)."""
    tall = X.shape[-2] > X.shape[-1]
    R, Z, Q, T = squares
    if kernels == "triton":
        from .triton_newton_schulz import gram_form_products

        gram, poly, product = gram_form_products(X.dtype)
    else:
        def gram(X, out):
            if tall:
                torch.bmm(X.mT, X, out=out)
            else:
                torch.bmm(X, X.mT, out=out)

        def poly(R, out, b, c):
            torch.baddbmm(R, R, R, beta=b, alpha=c, out=out)

        def product(A, B, out):
            torch.bmm(A, B, out=out)

    def times_q(Q, X, out):
        if tall:
            product(X, Q.mT, out)
        else:
            product(Q, X, out)

    gram(X, R)
    identity = True  # Q is the identity, kept implicit until the first iteration
    last = len(coeffs) - 1
    for k, (a, b, c) in enumerate(coeffs):
        poly(R, Z, b, c)                                               # Z = a I + b R + c R^2
        # a rounded to the compute dtype first, as a * I held it: the bits then do not depend on
        # how a device's kernel treats a scalar (on this CPU the two agree)
        Z.diagonal(dim1=-2, dim2=-1).add_(torch.tensor(a, dtype=Z.dtype).item())
        if identity:
            Q, Z = Z, Q                                                # Q = Z: the buffers swap names
            current = Q                                                # (this step's Z is there now)
        else:
            product(Z, Q, T)                                           # Q = Z Q
            Q, T = T, Q
            current = Z
        identity = False
        if k == last:
            break
        if k in restarts:
            times_q(Q, X, spare)                                       # X = Q X_0, R afresh
            X, spare = spare, X
            gram(X, R)
            identity = True
        else:
            product(current, R, T)                                     # R = Z (Z R)
            product(current, T, R)
    times_q(Q, X, spare)
    return spare


def _gram_writes(steps: int, restarts: Sequence[int]) -> int:
    """How many times ``_gram_iterations`` writes an iterate buffer: once per restart before the
    last step, and the final Q X. An even count leaves the result in the input's buffer."""
    return 1 + sum(1 for k in set(restarts) if 0 <= k < steps - 1)


@dataclass(frozen=True, kw_only=True)
class NSConfig:
    """The Newton-Schulz settings a batch of matrices shares; hashable, so it keys plan batches."""

    steps: int = 5
    """Number of iterations."""
    coefficients: str | tuple[tuple[float, float, float], ...] = "keller"
    """A preset name ("keller", "xtuner", "polar_express"), per-iteration (a, b, c) tuples, or one
    (a, b, c) used at every step (torch.optim.Muon's format); stored as a tuple of triples."""
    eps: float = 1e-7
    """Floor on each matrix's norm, so an all-zero matrix maps to zero instead of NaN."""
    dtype: torch.dtype | str | None = "auto"
    """Compute dtype: "auto" (bf16 on CUDA, like torch.optim.Muon; on a CPU bf16 only where it has
    native bf16 matmul, else fp32, see ``resolve_dtype``), a torch dtype, or None (the input's)."""
    form: str = "plain"
    """"plain" or "gram" (fewer FLOPs on rectangular matrices; see the module doc). Square matrices
    always take the plain form: there gram saves nothing and costs about 20% more."""
    backend: str = "auto"
    """"torch", "triton" (CUDA + triton required; fp32, fp16 or bf16 only, ``TRITON_DTYPES``) or "auto":
    per shape, whichever of the two was measured faster on this device (muonlab.kernels.backend_choice);
    torch off CUDA, under the Triton interpreter, and for other dtypes (fp64)."""
    gram_restarts: tuple[int, ...] | None = None
    """Iterations after which the gram form recomputes R from X. None: ``DEFAULT_GRAM_RESTARTS``
    for the dtype it iterates in (``restarts_in``)."""
    gram_min_saving: float | None = None
    """With form "gram": take it only on shapes where it saves at least this share of the plain
    form's FLOPs, the plain form elsewhere (None: on every rectangular shape). Muon's
    ``ns_form="auto"`` sets it (see ``resolve_form``)."""
    gram_dtype: torch.dtype | None = None
    """The dtype the gram form iterates in: None picks it from the compute dtype and the device
    (``gram_work_dtype``: fp16 for a 16-bit compute dtype where the device multiplies fp16
    natively, else fp32; fp32 and fp64 as they are); or fp16, fp32, fp64. Never bf16, in which the
    gram form diverges (see the module doc)."""

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown Newton-Schulz backend {self.backend!r} (Muon's ns_backend); "
                             f"choose one of {BACKENDS}")
        if self.form not in FORMS:
            raise ValueError(f"unknown Newton-Schulz form {self.form!r} (Muon's ns_form); choose one of {FORMS}")
        if self.dtype is not None and self.dtype != "auto" and not isinstance(self.dtype, torch.dtype):
            raise TypeError(f'Newton-Schulz dtype must be a torch.dtype, "auto" or None (Muon\'s ns_dtype), '
                            f"got {self.dtype!r}")
        if isinstance(self.dtype, torch.dtype) and self.dtype not in NS_DTYPES:
            raise ValueError(f"Newton-Schulz dtype (Muon's ns_dtype) must be one of {list(NS_DTYPES)} or None, "
                             f"got {self.dtype}")
        if self.backend == "triton" and isinstance(self.dtype, torch.dtype) and self.dtype not in TRITON_DTYPES:
            raise ValueError(_triton_dtype_message(self.dtype))
        if not is_number(self.eps):
            raise TypeError(f"Newton-Schulz eps must be a number, got {self.eps!r}")
        if not self.eps > 0:  # a zero floor divides an all-zero matrix by zero
            raise ValueError(f"Newton-Schulz eps must be > 0, got {self.eps!r}")
        resolve_coefficients(self.coefficients, self.steps)  # raises on bad steps or coefficients
        # explicit coefficients become a tuple of triples: the config stays hashable, and one bare
        # triple equals the same triple in a list (one batch key)
        object.__setattr__(self, "coefficients", coefficient_table(self.coefficients))
        if self.gram_restarts is not None:
            object.__setattr__(self, "gram_restarts", _checked_restarts(self.gram_restarts))
        if self.gram_dtype is not None and self.gram_dtype not in GRAM_DTYPES:
            raise ValueError(f"gram_dtype must be None or one of {list(GRAM_DTYPES)}, got {self.gram_dtype!r}: "
                             "the gram form diverges in bf16 on near-low-rank matrices (use form='plain' "
                             "for bf16 iterates)")
        if self.gram_min_saving is not None and not (is_number(self.gram_min_saving)
                                                     and 0 <= self.gram_min_saving < 1):
            raise ValueError(f"gram_min_saving must be None or a share in [0, 1), got {self.gram_min_saving!r}")

    def resolved_coefficients(self) -> Coefficients:
        return resolve_coefficients(self.coefficients, self.steps)

    def restarts_in(self, dtype: torch.dtype | None) -> tuple[int, ...]:
        """The gram form's restarts when it iterates in ``dtype`` (None: fp16, a GPU's)."""
        if self.gram_restarts is not None:
            return self.gram_restarts
        return DEFAULT_GRAM_RESTARTS.get(dtype or torch.float16, (2,))


DEFAULT_GRAM_RESTARTS = {torch.float16: (1,), torch.float32: (2,), torch.float64: (2,)}
"""Where the gram form restarts by default, by the dtype it iterates in. Rounding gives R small
negative eigenvalues that each step multiplies by about a^2 until a restart computes R afresh from
X (see the module doc). In fp16 a restart after iteration 2 was too late for Polar Express on an
(8, 200) matrix of condition 1e6 (top singular value 25.7): after iteration 1, as Zhang et al. do,
every input of tests/kernels/test_bounded.py stays bounded. In fp32 the later restart is the more
accurate one (10 Muon steps with random gradients and Keller's coefficients, on shapes from 32 x 96
to 512 x 64, against fp64: 1.4x the plain form's error, against 3.3x after iteration 1). For 5
steps both cost the same products."""


def _checked_restarts(restarts) -> tuple[int, ...]:
    """``gram_restarts`` as a tuple of ints: a sequence of whole numbers (iteration indices)."""
    if isinstance(restarts, (str, bytes)) or not isinstance(restarts, Sequence):
        raise TypeError(f"gram_restarts must be a sequence of iteration indices (ints), e.g. (2,), "
                        f"got {restarts!r}")
    bad = [k for k in restarts if isinstance(k, bool) or not isinstance(k, Integral)]
    if bad:
        raise TypeError(f"gram_restarts must hold iteration indices (ints), got {bad[0]!r} in {restarts!r}")
    return tuple(int(k) for k in restarts)


def _config(config: NSConfig | None, settings: dict) -> NSConfig:
    """``config`` with keyword overrides (the fields of NSConfig), or a new one from them."""
    unknown = sorted(set(settings) - {f.name for f in fields(NSConfig)})
    if unknown:
        raise TypeError(f"unknown Newton-Schulz setting(s) {unknown}; NSConfig has {[f.name for f in fields(NSConfig)]}")
    if config is None:
        return NSConfig(**settings)
    if not isinstance(config, NSConfig):
        raise TypeError(f"config must be an NSConfig, got {type(config).__name__} (pass steps=... by keyword)")
    return replace(config, **settings) if settings else config


@torch.no_grad()  # an optimizer's transform, written in place: no autograd graph, a Parameter reads as data
def newton_schulz(G: torch.Tensor | Sequence[torch.Tensor], config: NSConfig | None = None, *, workspace=None,
                  out: torch.Tensor | Sequence[torch.Tensor] | None = None, **settings):
    """Approximately orthogonalize the last two dims of ``G`` (batched over leading dims).

    Args:
        G: tensor with at least 2 dims; leading dims are a batch of independent matrices. Or a
            list of such tensors with equal last two dims, taken as their concatenation along the
            batch: a plan batch's matrices are read straight into the workspace, never stacked
            into a copy of their own first.
        config: the settings (``NSConfig``); keyword ``settings`` (its field names: steps,
            coefficients, eps, dtype, form, backend, gram_restarts) override or replace it.
        workspace: a ``muonlab.kernels.workspace.Workspace`` whose buffers hold the iterates, so
            repeated calls reuse memory instead of allocating; None allocates per call.
        out: where to write the result: a tensor or a list of tensors holding as many matrices as
            G (any float dtype: the result is cast into it). It may be G itself: G is read before
            anything is written. A contiguous tensor in the compute dtype serves as one of the two
            iterate buffers (the plain torch form), so the result needs no copy. None: G itself
            when G is an ``Overwrite`` list, else a new tensor.

    Returns:
        ``out``, or a new contiguous tensor of G's shape ((total, A, B) for a list) in the
        config's dtype (G's dtype when dtype is None). G is not modified unless it is ``out``.
    """
    pieces = batch_pieces(G)
    cfg = _config(config, settings)
    device = pieces[0].device
    dtype = resolve_dtype(cfg.dtype, device, pieces[0].shape) or pieces[0].dtype
    if dtype not in NS_DTYPES:  # dtype=None computes in G's dtype
        raise TypeError(f"G has dtype {pieces[0].dtype}; with dtype=None Newton-Schulz computes in G's dtype, "
                        f"which must be one of {list(NS_DTYPES)} (or pass dtype=)")
    rows, cols = pieces[0].shape[-2:]
    num = sum(p.shape[0] for p in pieces)
    if out is None:
        out = G if isinstance(G, Overwrite) else torch.empty(
            G.shape if isinstance(G, torch.Tensor) else (num, rows, cols), dtype=dtype, device=device)
    targets = batch_pieces(out, "out", writable=True)
    if sum(t.shape[0] for t in targets) != num or targets[0].shape[-2:] != pieces[0].shape[-2:] \
            or targets[0].device != device or not targets[0].is_floating_point():
        raise ValueError(f"out must hold {num} matrices of shape {(rows, cols)} on {device} in a float dtype, "
                         f"like G; got {[tuple(t.shape) for t in targets]} of {targets[0].dtype} on {targets[0].device}")
    if num == 0 or rows == 0 or cols == 0:
        return out
    m, n = sorted((rows, cols))
    tall = rows > cols
    form = _form(cfg, m, n)
    use = pick_backend(cfg.backend, device, (num, m, n), dtype, cfg)
    if form == "gram":  # its own iterate dtype (never bf16: see the module doc)
        dtype = gram_work_dtype(cfg, dtype, device)
    # one contiguous tensor in the iterates' dtype: the iterations write it directly, no copy
    direct = targets[0] if len(targets) == 1 and targets[0].dtype == dtype and targets[0].is_contiguous() else None
    if workspace is None:
        from .workspace import Workspace

        workspace = Workspace()
    # The torch path iterates on the matrices as stored (tall ones too, see _plain_iterations);
    # the Triton kernels want them wide, so a tall batch is transposed on its way in.
    stored, square, wide = ((num, rows, cols), dtype), ((num, m, m), dtype), ((num, m, n), dtype)
    scale = norm_scale(cfg.coefficients)
    coeffs = cfg.resolved_coefficients()
    if use == "triton":
        from .triton_newton_schulz import NSWorkspace, newton_schulz_triton

        if form == "plain":  # the input's buffer is the second iterate (pong): two (B, m, n), as on torch
            X, gram, poly, ping = workspace.take(device, [wide, square, square, wide])
            _load_normalised(X.mT if tall else X, pieces, cfg.eps, scale)
            result = newton_schulz_triton(X, coeffs, workspace=NSWorkspace(gram, poly, ping, pong=X))
        else:
            X, spare, *squares = workspace.take(device, [wide, wide, square, square, square, square])
            _load_normalised(X.mT if tall else X, pieces, cfg.eps, scale)
            result = _gram_iterations(X, spare, coeffs, cfg.restarts_in(dtype), squares, kernels="triton")
        store_pieces(result.mT if tall else result, targets)
    else:
        # Two iterate buffers take turns (and the m x m products, two for the plain form and four
        # for the gram form, come from the workspace too). A contiguous ``out`` in the compute dtype is
        # one of the two (its bytes are dead until the result): the input goes into the one that
        # makes the last write land in ``out``. ``out`` may be G itself: then G is normalised in
        # place or read first.
        writes = cfg.steps if form == "plain" else _gram_writes(cfg.steps, cfg.restarts_in(dtype))
        products = [square] * (2 if form == "plain" else 4)
        if direct is not None:
            S, *products = workspace.take(device, [stored, *products])
            first, second = (direct, S) if writes % 2 == 0 else (S, direct)
        else:
            first, second, *products = workspace.take(device, [stored, stored, *products])
        _load_normalised(first, pieces, cfg.eps, scale)
        if form == "plain":
            result = _plain_iterations(first, second, coeffs, *products)
        else:
            result = _gram_iterations(first, second, coeffs, cfg.restarts_in(dtype), products)
        if direct is None:
            store_pieces(result, targets)
    return out


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
    are views: a reshape that had to copy would take the result away."""
    if isinstance(G, torch.Tensor):
        if G.ndim < 2:
            raise ValueError(f"newton_schulz needs {name} with at least 2 dims, got shape {tuple(G.shape)}")
        return [_as_batch(G, writable)]
    pieces = list(G) if isinstance(G, Sequence) else None
    if not pieces or not all(isinstance(p, torch.Tensor) for p in pieces):
        raise TypeError(f"newton_schulz needs {name} as a tensor or a non-empty list of tensors, got {type(G).__name__}")
    first = pieces[0]
    for i, p in enumerate(pieces):
        if p.ndim < 2 or p.shape[-2:] != first.shape[-2:] or p.device != first.device or p.dtype != first.dtype:
            raise ValueError(f"newton_schulz's list {name} needs tensors of one device and dtype with equal last two "
                             f"dims; tensor {i} is {tuple(p.shape)} {p.dtype} on {p.device}, tensor 0 "
                             f"{tuple(first.shape)} {first.dtype} on {first.device}")
    return _joined([_as_batch(p, writable) for p in pieces])


def _joined(pieces: list[torch.Tensor]) -> list[torch.Tensor]:
    """Pieces that lie back to back in one buffer (a batch's momentum inputs, see
    ``muonlab.optim.functional.muon_momentum_``) as one (k, A, B) view of it; else as they are."""
    pieces = [p for p in pieces if p.shape[0]] or pieces[:1]
    first = pieces[0]
    if len(pieces) == 1 or not all(p.is_contiguous() for p in pieces):
        return pieces
    storage, end = first.untyped_storage().data_ptr(), first.data_ptr()
    for p in pieces:
        if p.data_ptr() != end or p.untyped_storage().data_ptr() != storage:
            return pieces
        end += p.numel() * p.element_size()
    rows, cols = first.shape[-2:]
    return [first.as_strided((sum(p.shape[0] for p in pieces), rows, cols), (rows * cols, cols, 1))]


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


def _load_normalised(X: torch.Tensor, pieces: list[torch.Tensor], eps: float, scale: float) -> None:
    """Fill X (a view of the workspace, the pieces' orientation) with the pieces, cast to X's dtype
    and each matrix divided by its norm. One piece already in X's dtype is read once (the division
    writes X); otherwise the pieces are copied (cast) in, then normalised in place, so the norm is
    the cast matrix's, as torch.optim.Muon's ``X = G.bfloat16(); X / X.norm()``. Into fp16 from
    another dtype (the gram form's iterates, see ``gram_work_dtype``) each piece is divided by its
    fp32 norm on the way in: a cast first would turn entries past 65504 into inf and those under
    6e-8 into zeros."""
    if len(pieces) == 1 and pieces[0].dtype == X.dtype:
        _normalise_into(X, pieces[0], eps, scale)
        return
    if X.dtype == torch.float16 and any(p.dtype != torch.float16 for p in pieces):
        for piece, dest in zip(pieces, X.split([p.shape[0] for p in pieces])):
            norms = torch.linalg.vector_norm(piece, dim=(-2, -1), keepdim=True, dtype=torch.float32) * scale
            torch.div(piece, norms.clamp(min=eps), out=dest)
        return
    load_pieces(X, pieces)
    _normalise_into(X, X, eps, scale)


def _form(cfg: NSConfig, m: int, n: int) -> str:
    """The form that runs on m x n matrices (m <= n): gram only on rectangular ones (see
    NSConfig.form), and with ``gram_min_saving`` only where it saves that share of the FLOPs."""
    if cfg.form == "plain" or m == n:
        return "plain"
    if cfg.gram_min_saving is not None and \
            _gram_flops(m, n, cfg) > (1 - cfg.gram_min_saving) * cfg.steps * plain_flops_per_iter(m, n):
        return "plain"
    return "gram"


def form_for(cfg: NSConfig, shape: Sequence[int]) -> str:
    """The form ``newton_schulz`` runs under ``cfg`` on matrices of ``shape`` (its last two dims)."""
    m, n = sorted(int(d) for d in shape[-2:])
    return _form(cfg, m, n)


AUTO_GRAM_SAVING = 0.2
"""Where ``ns_form="auto"`` takes the gram form: shapes on which it saves at least 20% of the plain
form's FLOPs, and only where its iterates (``gram_work_dtype``) are no wider than the compute
dtype (see ``resolve_form``).

Time. On an H100 (benchmarks/results/gpu_step.md, bf16 compute, torch backend, measured while the
gram form still iterated in bf16; fp16 runs at the same tensor-core rate) the gram form ran the 1B
set (2048 x 6144 and 2048 x 8192: 26% and 33% fewer FLOPs) 1.29x faster than the plain form, the
GPT-2 set 1.17x and the (128, 768, 2048) bank (22% fewer) 1.18x; the (64, 1408, 2048) bank, where
it saves nothing (-1%), 5% slower. On CPUs the gram form in fp32 made a whole fp32 Muon step
1.27-1.28x faster (benchmarks/results/optimizer_step.md, gpu_step_cpu_proxy.md); a 16-bit step on
a CPU without fp16 matmul keeps the plain form.

Accuracy. Ten Muon steps on (64, 64), (32, 96), (96, 32), (48, 80), (64, 512) and (512, 64)
against an fp64 run (tests/unit/test_ns_accuracy.py, every schedule, random and near-rank-2
gradients): the default's worst relative error is 0.83-1.00x the plain form's in bf16 (the gram
form in fp16 under the GPU rule) and 0.73-1.25x in fp32; the test holds it within 1.5x. The gram
form in bf16, as it was until 2026-11-26, was 3.6x as far (random gradients, Keller) and 2,200x
(Polar Express, near-rank-2 gradients: it diverged).

Bits. The plain form computes torch.optim.Muon's iteration; one matrix at a time (a batch of one)
it gives torch's bits. Batched, the CPU's batched products may round differently from one matrix's
(bf16, four 16 x 32 matrices: one draw in 50 differed in the last bits), and over a run the
differences grow (2.3e-3 off torch.optim.Muon after 30 steps in one measured case)."""

FORM_CHOICES = ("auto", *FORMS)


def resolve_form(form: str, dtype: torch.dtype | str | None = "auto", device: torch.device | str | None = None) -> dict:
    """NSConfig settings for Muon's ``ns_form``: "plain" and "gram" as they are; "auto" the gram
    form on shapes where it saves ``AUTO_GRAM_SAVING`` of the FLOPs, the plain form elsewhere. And
    the plain form everywhere where the gram form would iterate in a wider dtype than the compute
    dtype ``dtype`` resolves to on ``device`` (a 16-bit dtype on a CPU without native fp16 matmul:
    ``default_gram_dtype``), which would make it slower, not faster. Without a device (a plan made
    from shapes, ``muonlab.simulate``), the GPU rule."""
    if form not in FORM_CHOICES:
        raise ValueError(f"unknown Newton-Schulz form {form!r} (Muon's ns_form); choose one of {FORM_CHOICES}")
    if form != "auto":
        return dict(form=form)
    compute = resolve_dtype(dtype, device) if device is not None else None
    if compute is not None and default_gram_dtype(compute, device).itemsize > compute.itemsize:
        return dict(form="plain")
    return dict(form="gram", gram_min_saving=AUTO_GRAM_SAVING)


def triton_usable(device: torch.device) -> bool:
    """Triton kernels can run on ``device``: triton imports and it is CUDA (or the interpreter is on)."""
    try:
        from .triton_newton_schulz import INTERPRET, TRITON_AVAILABLE
    except ImportError:  # the kernel module itself failed to import
        return False
    return TRITON_AVAILABLE and (device.type == "cuda" or (INTERPRET and device.type == "cpu"))


def _triton_dtype_message(dtype: torch.dtype) -> str:
    return (f"Newton-Schulz dtype {dtype} (Muon's ns_dtype, or the input's dtype with ns_dtype=None) is not "
            f"supported by backend='triton' (Muon's ns_backend): its kernels take {list(TRITON_DTYPES)}; "
            "use backend='torch' or 'auto' for it")


def possible_backends(backend: str, device: torch.device | str, dtype: torch.dtype | None = None) -> tuple[str, ...]:
    """The backends ``backend`` may run a batch on ``device`` on, whatever the batch's shape: one,
    or for "auto" where compiled Triton kernels can run both (its pick then depends on the batch's
    shape, see ``pick_backend``). ``dtype``, the compute dtype, if known: "auto" offers Triton only
    for ``TRITON_DTYPES``. ValueError for a name not in ``BACKENDS``, and for "triton" where Triton
    can't run or can't take ``dtype``."""
    if backend not in BACKENDS:  # a typo must not silently become "auto"
        raise ValueError(f"unknown Newton-Schulz backend {backend!r} (Muon's ns_backend); choose one of {BACKENDS}")
    device = torch.device(device)
    triton_dtype = dtype is None or dtype in TRITON_DTYPES
    if backend == "triton" and not triton_dtype:
        raise ValueError(_triton_dtype_message(dtype))
    if backend == "torch" or (backend == "auto" and (device.type != "cuda" or not triton_dtype)):
        return ("torch",)  # "auto" off CUDA: not even importing triton (its import alone costs ~80 MB)
    usable = triton_usable(device)
    if backend == "triton":
        if not usable:
            raise ValueError(
                "backend='triton' needs triton installed and a CUDA tensor (or TRITON_INTERPRET=1 "
                f"set before muonlab is imported, for CPU tests); got device {device}. "
                "backend='auto' falls back to torch"
            )
        return ("triton",)
    # auto: the interpreter is for correctness tests only, never picked automatically, not even
    # on CUDA (TRITON_INTERPRET=1 left set while debugging a kernel: timing it would take hours)
    if not usable:
        return ("torch",)
    from .triton_newton_schulz import INTERPRET

    return ("torch",) if INTERPRET else ("torch", "triton")


def pick_backend(backend: str, device: torch.device | str, batch_shape: tuple[int, int, int], dtype: torch.dtype,
                 cfg: NSConfig) -> str:
    """"torch" or "triton": which path ``backend`` runs a (B, m, n) batch of ``dtype`` on ``device``;
    ValueError as ``possible_backends`` (an unknown name, "triton" where Triton can't run or can't
    take ``dtype``)."""
    possible = possible_backends(backend, device, dtype)
    if len(possible) == 1:
        return possible[0]
    from .backend_choice import faster_backend

    return faster_backend(batch_shape, dtype, cfg, torch.device(device))


CPU_FP32_MAX_WORK = 2**17
"""On a CPU with native bf16 matmul, "auto" still computes a matrix in fp32 when its m^2 n (m its
smaller side, n its larger: one product's multiply-adds) is at most this: there a bf16 product's
fixed cost (oneDNN's, per call) outweighs its arithmetic. Measured on an AVX512-BF16 CPU, batches
of 12 (benchmarks/results/cpu_dtype.md): fp32 faster up to it, bf16 from the next size measured on.
"""


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device,
                  matrix_shape: Sequence[int] | None = None) -> torch.dtype | None:
    """The compute dtype "auto" means on ``device`` (for a matrix of ``matrix_shape``, when given):
    bf16 on CUDA (tensor cores, as torch.optim.Muon uses); on a CPU bf16 only where it lists
    native bf16 matmul (AVX512_BF16 or AMX-BF16), and there only for matrices larger than
    ``CPU_FP32_MAX_WORK``: without native bf16, matmul is emulated at about a third of fp32's
    rate, and small products are faster in fp32 either way, so fp32 is both faster and more
    accurate there. Other values pass through."""
    if dtype != "auto":
        return dtype
    if torch.device(device).type == "cpu":
        if not cpu_has_native_bf16():
            return torch.float32
        if matrix_shape is not None:
            m, n = sorted(int(d) for d in matrix_shape[-2:])
            if m * m * n <= CPU_FP32_MAX_WORK:
                return torch.float32
        return torch.bfloat16
    return torch.bfloat16


BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
FP16_CPU_FLAGS = ("avx512_fp16", "amx_fp16")


def native_fp16_matmul(device: torch.device | str | None) -> bool:
    """Whether ``device`` multiplies fp16 matrices natively: CUDA, and CPUs listing
    ``FP16_CPU_FLAGS``. None (a plan made without a device, ``muonlab.simulate``): as on a GPU."""
    if device is None or torch.device(device).type != "cpu":
        return True
    return bool(cpu_flags(FP16_CPU_FLAGS))


def default_gram_dtype(dtype: torch.dtype, device: torch.device | str | None) -> torch.dtype:
    """The dtype the gram form iterates in by default for compute dtype ``dtype`` on ``device``
    (None: the GPU rule): fp16 for a 16-bit compute dtype where the device multiplies fp16
    natively, fp32 where it doesn't; fp32 and fp64 as they are."""
    if dtype in HALF_DTYPES:
        return torch.float16 if native_fp16_matmul(device) else torch.float32
    return dtype


def gram_work_dtype(cfg: NSConfig, dtype: torch.dtype, device: torch.device | str | None) -> torch.dtype:
    """The dtype the gram form iterates in under ``cfg``: its ``gram_dtype`` if set, else
    ``default_gram_dtype``."""
    return cfg.gram_dtype if cfg.gram_dtype is not None else default_gram_dtype(dtype, device)


@functools.cache
def cpu_flags(wanted: tuple[str, ...]) -> tuple[str, ...] | None:
    """Which of ``wanted`` /proc/cpuinfo lists; None where it can't be read or lists no flags."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split() for line in f if line.startswith("flags")), None)
    except OSError:
        return None
    return None if flags is None else tuple(f for f in wanted if f in flags)


def cpu_bf16_flags() -> tuple[str, ...] | None:
    """Which of ``BF16_CPU_FLAGS`` (native bf16 matmul) /proc/cpuinfo lists (None: unreadable)."""
    return cpu_flags(BF16_CPU_FLAGS)


def cpu_has_native_bf16() -> bool:
    return bool(cpu_bf16_flags())


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


def ns_flops(shape: Sequence[int], config: NSConfig | None = None, **settings) -> int:
    """FLOPs (multiply-adds count 2) of ``newton_schulz`` on a tensor of ``shape`` under a config.

    Plain: ``plain_flops_per_iter`` per iteration with m = min, n = max of the last two dims;
    backend "triton": ``symmetric_flops_per_iter``; "auto" counts as torch (it picks Triton only on
    CUDA, which a plan made from shapes cannot know). Gram: see ``_gram_iterations`` (restarts
    re-pay the X products; on "triton", X X^T and R R count half).
    """
    cfg = _config(config, settings)
    if len(shape) < 2:
        raise ValueError(f"ns_flops needs a shape with at least 2 dims, got {tuple(shape)}")
    batch = 1
    for d in shape[:-2]:
        batch *= int(d)
    m, n = sorted((int(shape[-2]), int(shape[-1])))
    steps = cfg.steps
    if _form(cfg, m, n) == "plain":
        per_iter = symmetric_flops_per_iter(m, n) if cfg.backend == "triton" else plain_flops_per_iter(m, n)
        return batch * steps * per_iter
    return batch * _gram_flops(m, n, cfg, symmetric=cfg.backend == "triton")


def _gram_flops(m: int, n: int, cfg: NSConfig, symmetric: bool = False) -> int:
    """FLOPs of the gram form on one m x n matrix (m <= n); see ``_gram_iterations``.
    ``symmetric``: on the Triton kernels, X X^T and R R count half (upper tiles only)."""
    gram_x = 2 * m * m * n  # one X X^T or one Q X
    mm = 2 * m**3
    sym_x, sym_mm = (gram_x // 2, mm // 2) if symmetric else (gram_x, mm)
    total = sym_x  # R_0
    restarts = set(cfg.restarts_in(None))  # a GPU's; for 5 steps every default costs the same
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
