"""Run one batch of Newton-Schulz whose every choice is made: the form, the backend, the dtype
it iterates in. ``resolve`` turns those choices into a ``ResolvedRun``, which ``run_resolved``
runs on any number of batches: the runner resolves once per batch key and runs each chunk of
every step with no choice left to make. ``newton_schulz`` (and the "auto" timing,
``backend_choice``, which times each backend on a fixed choice) resolve per call through ``run``.

The executor also moves the matrices: into the workspace (cast, each divided by its own Frobenius
norm, never the batch's) and out to the targets, so a chunk's run is one call here and the form's
iteration. Its workspace buffers are carved once per chunk shape (``Workspace.carved``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .backends import BACKENDS, NSBackend
from .coefficients import Coefficients, norm_scale
from .config import NSConfig
from .forms import FORMS, NSForm
from .workspace import Workspace


@dataclass(frozen=True, eq=False)
class ResolvedRun:
    """What ``run_resolved`` needs of a config and its choices, computed once."""

    cfg: NSConfig
    """The config: the forms read their own settings (steps, restarts) from it."""
    form: str
    backend: NSBackend
    """The backend's record: how the executor hands it the batch (``wide``), and the kernels the
    form's products run on."""
    dtype: torch.dtype
    """The dtype the iterates are in."""
    unit: NSForm
    coefficients: Coefficients
    scale: float
    """The factor on each matrix's norm the coefficients assume (``norm_scale``)."""
    result_in_input: bool
    """Whether the torch path's last write lands in the buffer the input was loaded into."""


def resolve(cfg: NSConfig, *, form: str, backend: str, dtype: torch.dtype) -> ResolvedRun:
    """``cfg`` with ``form`` on ``backend`` iterating in ``dtype``, resolved; ValueError where the
    form may not iterate in ``dtype``."""
    unit = FORMS[form]
    if dtype not in unit.dtypes:  # the form's own guarantee (the gram form never iterates in bf16)
        raise ValueError(f"the {form!r} Newton-Schulz form may not iterate in {dtype}; it takes {list(unit.dtypes)}")
    return ResolvedRun(cfg=cfg, form=form, backend=BACKENDS[backend], dtype=dtype, unit=unit,
                       coefficients=cfg.resolved_coefficients(), scale=norm_scale(cfg.coefficients),
                       result_in_input=unit.writes(cfg, dtype) % 2 == 0)


def run(pieces: list[torch.Tensor], targets: list[torch.Tensor], cfg: NSConfig, *, form: str, backend: str,
        dtype: torch.dtype, workspace: Workspace | None = None) -> None:
    """Orthogonalize ``pieces`` ((k, A, B) each, checked, no dim zero) into ``targets`` (as many
    matrices, any float dtype) under ``cfg``, with ``form`` on ``backend`` (a registered one),
    iterating in ``dtype``; buffers from ``workspace`` (None: a new one)."""
    run_resolved(pieces, targets, resolve(cfg, form=form, backend=backend, dtype=dtype), workspace)


def _carved(workspace: Workspace, device: torch.device, specs: list) -> list[torch.Tensor]:
    """``workspace.take(device, specs)``, kept in ``workspace.carved``: a plan's chunks have the same
    shapes every step, and carving views is several calls per buffer (dropped when the arena grows)."""
    key = (device, *specs)
    bufs = workspace.carved.get(key)
    if bufs is None:
        bufs = workspace.carved[key] = workspace.take(device, specs)
    return bufs


def run_resolved(pieces: list[torch.Tensor], targets: list[torch.Tensor], resolved: ResolvedRun,
                 workspace: Workspace | None = None) -> None:
    """``run`` with its choices already resolved (``resolve``)."""
    cfg, unit, dtype = resolved.cfg, resolved.unit, resolved.dtype
    first = pieces[0]
    device = first.device
    rows, cols = first.shape[-2:]
    num = sum([p.shape[0] for p in pieces])  # a list: a generator would be one Python call per piece
    m, n = sorted((rows, cols))
    tall = rows > cols
    # one contiguous tensor in the iterates' dtype: the iterations write it directly, no copy
    direct = targets[0] if len(targets) == 1 and targets[0].dtype == dtype and targets[0].is_contiguous() else None
    if workspace is None:
        workspace = Workspace()
    # The torch path iterates on the matrices as stored (tall ones too, see plain_iterations);
    # the Triton kernels want them wide, so a tall batch is transposed on its way in.
    stored, square, wide = ((num, rows, cols), dtype), ((num, m, m), dtype), ((num, m, n), dtype)
    squares = [square] * unit.squares
    backend = resolved.backend
    if backend.wide:
        X, spare, *products = _carved(workspace, device, [wide, wide, *squares])
        load_normalised(X.mT if tall else X, pieces, cfg.eps, resolved.scale)
        result = unit.iterate(X, spare, products, resolved.coefficients, cfg, dtype, kernels=backend.kernels)
        store_pieces(result.mT if tall else result, targets)
        return
    # Two iterate buffers take turns (and the form's m x m products come from the workspace too).
    # A contiguous output in the iterates' dtype is one of the two (its bytes are dead until the
    # result): the input goes into the one that makes the last write land in it. The output may
    # be the input itself: then the input is normalised in place or read first.
    if direct is not None:
        S, *products = _carved(workspace, device, [stored, *squares])
        first_buffer, second = (direct, S) if resolved.result_in_input else (S, direct)
    else:
        first_buffer, second, *products = _carved(workspace, device, [stored, stored, *squares])
    load_normalised(first_buffer, pieces, cfg.eps, resolved.scale)
    result = unit.iterate(first_buffer, second, products, resolved.coefficients, cfg, dtype, kernels=backend.kernels)
    if direct is None:
        store_pieces(result, targets)


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


def load_pieces(stack: torch.Tensor, pieces: list[torch.Tensor]) -> None:
    """Copy (and cast) the (k_i, A, B) pieces into consecutive matrices of ``stack``, in order."""
    torch._foreach_copy_(list(stack.split([p.shape[0] for p in pieces])), pieces)


def store_pieces(stack: torch.Tensor, pieces: list[torch.Tensor]) -> None:
    """Copy (and cast) consecutive matrices of ``stack`` into the (k_i, A, B) pieces, in order."""
    torch._foreach_copy_(pieces, list(stack.split([p.shape[0] for p in pieces])))


def joined(pieces: list[torch.Tensor]) -> list[torch.Tensor]:
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
