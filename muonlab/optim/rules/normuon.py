"""NorMuon: per-neuron second moments normalise the orthogonalized update, which then keeps its
Frobenius norm (Z. Li et al., NorMuon: Making Muon more efficient and scalable, arXiv 2510.05491,
Algorithm 1).

Per matrix O (the orthogonalized momentum, m x n) and its row second moments v (m x 1, fp32):

    v <- beta2 v + (1 - beta2) mean_cols(O * O)
    O_hat = O / (sqrt(v) + eps)
    update = O_hat * ||O||_F / (||O_hat||_F + eps)

and the update then goes through Muon's lr ratio and weight decay as any other. ``eps`` is 1e-10,
as in the paper's code.

A weight stored (in, out) (view "transpose", transformers' Conv1D) has its neurons in its stored
columns: ``v`` is (1, out), and where the matrix is whole (one process, DDP replicas) its columns
are normalised instead of its rows. Sharded by rows it is refused: each column's sum would span
the ranks (a (1, out) state replicated over them, and an all-reduce of out numbers, would carry it).

Rows are whole on every layout Muon steps (FSDP2 shards rows; a bank's or a fused bank's matrices
are whole or row blocks), so ``v`` lives with the rows: each rank updates the rows it holds. The
two Frobenius norms of a matrix whose rows lie on several ranks are the one thing summed across
them: one all-reduce of two numbers per matrix per batch, over the batch's group. Exact on every
layout (microsoft/dion's distributed NorMuon normalises each shard by its own norm instead).
"""

from __future__ import annotations

import torch

from .base import ROW_SPLIT_LAYOUTS, RowsHeld, UpdateRule

EPS = 1e-10


def _check(values: dict, where: str) -> None:
    beta2 = values.get("normuon_beta2")
    if isinstance(beta2, bool) or not isinstance(beta2, (int, float)):
        raise TypeError(f"normuon_beta2 must be a number, got {beta2!r}{where}")
    if not 0 <= beta2 < 1:
        raise ValueError(f"normuon_beta2 must be in [0, 1), got {beta2}{where}")


def _refusal(spec) -> str | None:
    if spec.view == "transpose" and spec.layout in ROW_SPLIT_LAYOUTS:
        return ("it is stored (in, out) (view 'transpose') and its rows lie on several ranks, so each of its "
                "neurons (stored columns) would be summed across them: NorMuon takes such a matrix where it is "
                "whole (one process, DDP replicas)")
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
    """NorMuon's step on this rank's rows of a batch's updates, as a generator: it yields the
    per-matrix sums of the parameters whose matrices span ranks (one flat fp32 tensor) once, to be
    sent back summed over those ranks, and returns per parameter its update as it is with the fp32
    scale of each of its rows (1 / (sqrt(v) + eps) times its matrix's norm ratio), which the update
    applies as it adds the rows (no scaled copy of the update is made). The row second moments are
    updated before the yield."""
    rows, per_matrix = [], []
    for o, (v,), h, group in zip(updates, states, held, settings):
        x = o.reshape(-1, h.cols)
        if h.columns:  # neurons are stored columns, on a matrix whole here (the refusal says why)
            sq = torch.linalg.vector_norm(x, dim=0, dtype=torch.float32).square_()
            vc = v.view(-1)
            vc.lerp_(sq / x.shape[0], 1 - group["normuon_beta2"])
            inv = vc.sqrt().add_(EPS).reciprocal_()
            rows.append((x, inv, None))
            per_matrix.append(torch.stack([sq.sum(), (sq * inv.square()).sum()]).view(2, 1))
            continue
        sq = torch.linalg.vector_norm(x, dim=1, dtype=torch.float32).square_()  # per row: sum of O * O
        vr = v.view(-1)
        vr.lerp_(sq / h.cols, 1 - group["normuon_beta2"])
        inv = vr.sqrt().add_(EPS).reciprocal_()
        matrix = torch.arange(h.first_row, h.first_row + x.shape[0], device=x.device) // h.matrix_rows
        sums = torch.zeros(2, h.num_matrices, dtype=torch.float32, device=x.device)
        sums[0].index_add_(0, matrix, sq)  # ||O||_F^2, this rank's rows
        sums[1].index_add_(0, matrix, sq * inv.square())  # ||O_hat||_F^2
        rows.append((x, inv, matrix))
        per_matrix.append(sums)
    shared = [i for i, h in enumerate(held) if h.spans_ranks]
    if shared:
        flat = yield torch.cat([per_matrix[i].view(-1) for i in shared])
        for i, part in zip(shared, flat.split([per_matrix[i].numel() for i in shared])):
            per_matrix[i] = part.view(2, -1)
    out = []
    for (x, inv, matrix), sums, o in zip(rows, per_matrix, updates):
        scale = sums[0].sqrt() / sums[1].sqrt().add_(EPS)
        out.append((o, inv.mul_(scale).view(1, -1) if matrix is None else inv.mul_(scale[matrix])))
    return out


RULE = UpdateRule(
    name="normuon",
    summary="per-row second moments normalise the orthogonalized update, keeping its Frobenius norm",
    source="Z. Li et al., NorMuon: Making Muon more efficient and scalable, arXiv 2510.05491 (2025)",
    settings={"normuon_beta2": 0.95},
    state_keys=("row_variance",),
    check_settings=_check,
    refusal=_refusal,
    state_shape=_state_shape,
    sums_per_matrix=2,  # ||O||_F^2 and ||O_hat||_F^2
    transform=normalize,
)
