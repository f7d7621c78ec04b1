"""What an update rule is: what happens between a matrix's orthogonalized update and its parameter.

A rule is one module with an ``UpdateRule`` and one entry in ``muonlab.optim.rules.RULES``. Muon
reads from it the group settings it adds (with their defaults and checks), the state it keeps per
parameter beside the momentum, the layouts it refuses, and its transform of the update.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


ROW_SPLIT_LAYOUTS = ("row_shard", "subgroup", "blocks", "gather_all", "pieces")
"""Layouts whose matrices' rows lie on several ranks of the group (with shard dim 0; "pieces" may
split rows across ranks too: ``RowsHeld.rows``)."""


@dataclass(frozen=True)
class RowsHeld:
    """Where one parameter's rows of the update held by this rank lie, read as (rows, cols).

    The update of one parameter on this rank is read as ``rows`` x ``cols`` (its matrices' rows
    stacked: a bank's matrices one after another, a fused bank's blocks in order, a flattened conv
    kernel's output channels); the first of them is global row ``first_row`` of the parameter. Its
    matrices are ``matrix_rows`` rows each; ``num_matrices`` is how many the per-matrix sums count
    (the parameter's, or this rank's where ``spans_ranks`` is False and every matrix is whole here).
    """

    matrix_rows: int
    cols: int
    first_row: int
    num_matrices: int
    spans_ranks: bool
    """Whether other ranks hold rows of the same matrices (a row-sharded matrix), so that sums
    over a matrix add this rank's part to theirs."""
    columns: bool = False
    """Whether the matrix's neurons are its stored columns (view "transpose": a weight stored
    (in, out)): a per-neuron rule then scales columns."""
    rows: tuple[int, ...] | None = None
    """Layout "pieces" (tensor parallel): the global rows (columns, with ``columns``) this rank's
    piece holds part of, in its local order. Other ranks may hold other columns of the same rows,
    so a per-row sum adds every rank's part, and a rule's per-row state holds every row, alike on
    each rank (``UpdateRule.new_state``)."""


@dataclass(frozen=True, kw_only=True)
class UpdateRule:
    """One update rule (see the module doc)."""

    name: str
    summary: str
    source: str
    """Where it was published, cited."""
    settings: dict[str, Any] = field(default_factory=dict)
    """Group settings it adds, with their defaults (Muon's keyword arguments of the same names)."""
    state_keys: tuple[str, ...] = ()
    """State kept per parameter beside the momentum (fp32, shape ``state_shape``)."""
    check_settings: Callable[[dict, str], None] = lambda values, where: None
    """Raises a ValueError/TypeError naming the setting for a bad value (``where``: which group)."""
    refusal: Callable[[Any], str | None] = lambda spec: None
    """Why a matrix (a ``muonlab.comm.specs.MatrixSpec``) can't take this rule, or None."""
    state_shape: Callable[[tuple[int, ...], str], tuple[int, ...]] = lambda shape, view: shape
    """The global shape of its state for a parameter of ``shape`` read with matrix view ``view``."""
    sums: Callable[[Any], int] = lambda spec: 0
    """How many fp32 numbers its transform sums across the ranks holding the rows of a parameter
    (a ``MatrixSpec``) whose rows lie on several ranks (its share of what it yields): what the plan
    and its cost model count."""
    transform: Callable | None = None
    """``transform(updates, states, held, settings)``, a generator: the updates this rank holds (one
    per parameter of a batch, its local rows), each parameter's state tensors (local, in
    ``state_keys`` order, updated in place), its ``RowsHeld`` and its group's settings. Where
    matrices' rows lie on several ranks it yields once a 1-D fp32 tensor of sums and is sent it
    back summed over the ranks sharing the batch's matrices (muonlab.optim.rule_step carries it
    while the next batch computes). It returns, per parameter, the update to apply and None, or a
    1-D fp32 scale of each of its rows (read as ``RowsHeld`` does), or a (1, cols) one of each of
    its columns, applied as the update is added to the parameter
    (``muonlab.optim.functional.muon_apply_``'s ``row_scales``). None: the update is used as it is."""

    def new_state(self, p: torch.Tensor, key: str, view: str) -> torch.Tensor:
        """Zeros of ``key`` for parameter ``p``: fp32 on p's device; a DTensor with p's mesh and
        placements when p is one (the placements' dim 0 is kept, so its rows fall where p's do)."""
        shape = self.state_shape(tuple(p.shape), view)
        if not hasattr(p, "to_local"):
            return torch.zeros(shape, dtype=torch.float32, device=p.device)
        from torch.distributed.tensor import DTensor

        from ...comm.specs import is_pieces_placement

        local = p.to_local()
        # one per stored column, or per row of a tensor-parallel piece (whose rows other ranks hold
        # columns of): every rank keeps them all
        if view == "transpose" or is_pieces_placement(p.placements):
            from torch.distributed.tensor import Replicate

            zeros = torch.zeros(shape, dtype=torch.float32, device=local.device)
            return DTensor.from_local(zeros, p.device_mesh, [Replicate()] * p.device_mesh.ndim, run_check=False,
                                      shape=torch.Size(shape), stride=zeros.stride())
        local_shape = (local.shape[0],) + shape[1:]
        zeros = torch.zeros(local_shape, dtype=torch.float32, device=local.device)
        return DTensor.from_local(zeros, p.device_mesh, p.placements, run_check=False, shape=torch.Size(shape),
                                  stride=torch.empty(shape, device="meta").stride())
