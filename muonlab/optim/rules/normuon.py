"""NorMuon: per-neuron second moments normalise the orthogonalized update, which is then rescaled
to a set Frobenius norm (Z. Li et al., NorMuon: Making Muon more efficient and scalable, arXiv
2510.05491).

Per matrix O (the orthogonalized momentum, m x n) and its row second moments v (m x 1, fp32):

    v <- beta2 v + (1 - beta2) mean_cols(O * O)
    O_hat = O / (sqrt(v) + eps)
    update = O_hat * N / (||O_hat||_F + eps)

and the update then goes through Muon's lr ratio and weight decay as any other. ``eps`` is 1e-10,
as in the paper's code. The paper's Algorithm 1 and the authors' code (normuon.py of
github.com/zichongli5/NorMuon) differ in N, the final rescale, which the group setting
``normuon_scale`` picks:

- "code" (the default): N = ||O||_F, the norm Newton-Schulz left (the code's ``vnorm``), so the
  step is as large as Muon's; the code then scales by Keller Jordan's sqrt(max(1, m/n)), Muon's
  ``adjust_lr="original"``. The default: it is the authors' published implementation, and it keeps
  Muon's step size, so NorMuon is a change of rule at Muon's lr.
- "paper": N = sqrt(min(m, n)), the norm of an exactly orthogonal m x n matrix. Algorithm 1 steps by
  eta_hat O_hat with eta_hat = 0.2 eta sqrt(mn) / ||O_hat||_F, which is this N times Moonlight's
  ratio 0.2 sqrt(max(m, n)) (``adjust_lr="match_rms_adamw"``): with that ratio, ``nesterov=False``
  (Algorithm 1 orthogonalizes M_t itself) and ``momentum_form="ema"``, a step is Algorithm 1's.

At one lr ratio, "paper" steps are sqrt(min(m, n)) / ||O||_F times "code"'s: larger, as Newton-Schulz
leaves the singular values near 1 but mostly below, and a low-rank momentum's small ones far below
(the quick start's GPT, fp32: 1.16 to 1.9 times in its first steps, 1.05 to 1.28 after 60).

A weight stored (in, out) (view "transpose", transformers' Conv1D) has its neurons in its stored
columns: ``v`` is (1, out) and its columns are normalised instead of its rows. Where its rows are
sharded, each column's sum of squares spans the ranks: the out sums travel (one all-reduce with
the batch's other sums), and ``v``, replicated over the ranks holding the rows, is updated alike on
each of them from the summed values.

Rows are whole on every layout Muon steps (FSDP2 shards rows; a bank's or a fused bank's matrices
are whole or row blocks), so ``v`` lives with the rows: each rank updates the rows it holds. The
two Frobenius norms of a matrix whose rows lie on several ranks are the one thing summed across
them: one all-reduce of two numbers per matrix per batch, over the batch's group (both forms send
both). Exact on every layout (microsoft/dion's distributed NorMuon normalises each shard by its own
norm instead).

A tensor-parallel piece (layout "pieces") may hold part of a row's columns, so there every row's
sum of squares travels (one number per row, added over the group), and ``v``, replicated, holds
every row on each rank, updated alike from the summed values: the columns' way, for rows.
"""

from __future__ import annotations

import math

import torch

from .base import RowsHeld, UpdateRule

EPS = 1e-10
SCALES = ("code", "paper")
"""``normuon_scale``'s values: the norm the normalised update is rescaled to (see the module doc)."""


def _check(values: dict, where: str) -> None:
    beta2 = values.get("normuon_beta2")
    if isinstance(beta2, bool) or not isinstance(beta2, (int, float)):
        raise TypeError(f"normuon_beta2 must be a number, got {beta2!r}{where}")
    if not 0 <= beta2 < 1:
        raise ValueError(f"normuon_beta2 must be in [0, 1), got {beta2}{where}")
    scale = values.get("normuon_scale")
    if not isinstance(scale, str) or scale not in SCALES:
        raise ValueError(f"normuon_scale must be one of {SCALES}, got {scale!r}{where}")


def _kept_norm(group: dict, norm_of_o: torch.Tensor, h: RowsHeld):
    """N, the Frobenius norm the normalised update is rescaled to: ||O||_F ("code") or an exactly
    orthogonal matrix's, sqrt(min(m, n)) ("paper")."""
    if group["normuon_scale"] == "code":
        return norm_of_o
    return math.sqrt(min(h.matrix_rows, h.cols))


def _refusal(spec) -> str | None:
    if spec.shard_dim != 0:
        return f"it is sharded on dim {spec.shard_dim}, which splits its rows across ranks"
    return None


def _state_shape(shape: tuple[int, ...], view: str) -> tuple[int, ...]:
    """One entry per neuron: per row, the column dims of the parameter become 1 (a flattened
    kernel's all but dim 0, else the last); a weight stored (in, out), per column: (1, out)."""
    if view == "transpose":
        return (1, shape[-1])
    if view == "flatten":
        return (shape[0],) + (1,) * (len(shape) - 1)
    return tuple(shape[:-1]) + (1,)


def normalize(updates: list[torch.Tensor], states: list[list[torch.Tensor]], held: list[RowsHeld],
              settings: list[dict]):
    """NorMuon's step on this rank's rows of a batch's updates, as a generator: it yields once the
    sums of the parameters whose matrices span ranks (one flat fp32 tensor), to be sent back summed
    over those ranks, and returns per parameter its update as it is with the fp32 scale of each of
    its neurons (1 / (sqrt(v) + eps) times its matrix's norm ratio), which the update applies as
    it adds them (no scaled copy of the update is made).

    Rows: each rank's rows' second moments are its own, updated before the yield; what travels is
    two norms per matrix. Stored columns (view "transpose"): each column's sum of squares is over
    every rank's rows, so those travel, and the (1, out) second moments, alike on every rank, are
    updated after."""
    parts = []  # per parameter: (its rows' inverse scales and matrix of each row, or None for columns; its sums)
    for o, (v,), h, group in zip(updates, states, held, settings):
        if h.rows is not None:
            parts.append(_piece_sums(o, h))
            continue
        x = o.reshape(-1, h.cols)
        if h.columns:
            parts.append((None, torch.linalg.vector_norm(x, dim=0, dtype=torch.float32).square_()))
            continue
        sq = torch.linalg.vector_norm(x, dim=1, dtype=torch.float32).square_()  # per row: sum of O * O
        vr = v.view(-1)
        vr.lerp_(sq / h.cols, 1 - group["normuon_beta2"])
        inv = vr.sqrt().add_(EPS).reciprocal_()
        matrix = torch.arange(h.first_row, h.first_row + x.shape[0], device=x.device) // h.matrix_rows
        sums = torch.zeros(2, h.num_matrices, dtype=torch.float32, device=x.device)
        sums[0].index_add_(0, matrix, sq)  # ||O||_F^2, this rank's rows
        sums[1].index_add_(0, matrix, sq * inv.square())  # ||O_hat||_F^2
        parts.append(((inv, matrix), sums))
    shared = [i for i, h in enumerate(held) if h.spans_ranks]
    if shared:
        flat = yield torch.cat([parts[i][1].view(-1) for i in shared])
        for i, part in zip(shared, flat.split([parts[i][1].numel() for i in shared])):
            parts[i] = (parts[i][0], part.view_as(parts[i][1]))
    out = []
    for (per_row, sums), o, (v,), h, group in zip(parts, updates, states, held, settings):
        if isinstance(per_row, _Piece):
            out.append((o, _piece_scales(per_row, sums, v, h, group)))
            continue
        if per_row is None:  # the matrix's column sums of squares: its neurons' second moments
            vc = v.view(-1)
            vc.lerp_(sums / h.matrix_rows, 1 - group["normuon_beta2"])
            inv = vc.sqrt().add_(EPS).reciprocal_()
            scale = _kept_norm(group, sums.sum().sqrt(), h) / (sums * inv.square()).sum().sqrt().add_(EPS)
            out.append((o, inv.mul_(scale).view(1, -1)))
            continue
        inv, matrix = per_row
        scale = _kept_norm(group, sums[0].sqrt(), h) / sums[1].sqrt().add_(EPS)
        out.append((o, inv.mul_(scale[matrix])))
    return out


class _Piece:
    """A tensor-parallel piece's rows (``RowsHeld.rows``) as an index tensor."""

    def __init__(self, index: torch.Tensor):
        self.index = index


def _piece_sums(o: torch.Tensor, h: RowsHeld) -> tuple[_Piece, torch.Tensor]:
    """A tensor-parallel piece (layout "pieces"): its rows' sums of squares, partial where other
    ranks hold other columns of them, added at their global rows of a vector of every row of the
    parameter (columns for a stored (in, out) weight), which travels whole: summed over the group,
    it holds every row's full sum on each rank."""
    index = torch.tensor(h.rows, dtype=torch.long, device=o.device)
    held = len(h.rows)
    other = o.numel() // held if held else 0
    x = o.reshape(other, held) if h.columns else o.reshape(held, other)
    sq = torch.linalg.vector_norm(x, dim=0 if h.columns else 1, dtype=torch.float32).square_()
    total = h.cols if h.columns else h.num_matrices * h.matrix_rows
    return _Piece(index), torch.zeros(total, dtype=torch.float32, device=o.device).index_add_(0, index, sq)


def _piece_scales(piece: _Piece, sums: torch.Tensor, v: torch.Tensor, h: RowsHeld, group: dict) -> torch.Tensor:
    """The scales of a piece's rows (columns) from every row's summed squares: the second moments
    of every row, kept alike on each rank (``v`` holds them all), updated as on one process; the
    norms of each matrix from every row; the piece's rows' entries of the result."""
    vf = v.view(-1)
    vf.lerp_(sums / (h.matrix_rows if h.columns else h.cols), 1 - group["normuon_beta2"])
    inv = vf.sqrt().add_(EPS).reciprocal_()
    rows = h.cols if h.columns else h.matrix_rows  # a stored (in, out) weight is one matrix
    matrix = torch.arange(sums.numel(), device=sums.device) // rows
    norms = torch.zeros(2, h.num_matrices, dtype=torch.float32, device=sums.device)
    norms[0].index_add_(0, matrix, sums)
    norms[1].index_add_(0, matrix, sums * inv.square())
    scale = _kept_norm(group, norms[0].sqrt(), h) / norms[1].sqrt().add_(EPS)
    mine = inv[piece.index] * scale[matrix[piece.index]]
    return mine.view(1, -1) if h.columns else mine


def _sums(spec) -> int:
    """The numbers ``normalize`` sends for a matrix whose rows lie on several ranks: two norms per
    matrix, or a stored (in, out) matrix's out column sums; for a tensor-parallel piece, every
    row's sum (column's, for a stored (in, out) one)."""
    if spec.layout == "pieces" and spec.view != "transpose":
        return spec.num_matrices * spec.matrix_shape[0]
    return spec.num_matrices * (spec.matrix_shape[1] if spec.view == "transpose" else 2)


RULE = UpdateRule(
    name="normuon",
    summary="per-row second moments normalise the orthogonalized update, keeping its Frobenius norm",
    source="Z. Li et al., NorMuon: Making Muon more efficient and scalable, arXiv 2510.05491 (2025)",
    settings={"normuon_beta2": 0.95, "normuon_scale": "code"},
    state_keys=("row_variance",),
    check_settings=_check,
    refusal=_refusal,
    state_shape=_state_shape,
    sums=_sums,
    transform=normalize,
)
