"""The update rule's stage of a Muon step: between a batch's orthogonalized updates coming back and
the parameters taking them (``muonlab.optim.rules`` holds the rules; this is where the step meets
them: each matrix's rule, its state, the rows this rank holds, and the group the sums travel in).

A rule's state lives with the rows of its parameter, as the parameter itself does: a row shard's
on that shard, an expert bank's with its experts. A replicated (DDP) matrix's lives on every
replica: each receives the whole update and applies it, so each updates its copy of the state
alike (the momentum alone has one home, see ``muonlab.optim.momentum_homes``). Rule state stays on
the parameters' device under ``state_offload``: it is one number per row, 1/cols of the momentum.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..comm.records import BatchPlan, part_range
from ..comm.specs import MatrixSpec, default_view, local_shard
from .rules import RULES, RowsHeld, UpdateRule

ROW_SPLIT_LAYOUTS = ("row_shard", "subgroup", "gather_all")
"""Layouts whose matrices' rows lie on several ranks of the group (with shard dim 0)."""


def rule_of(group: dict) -> UpdateRule:
    return RULES[group["update_rule"]]


def state_shapes(group: dict, p: torch.Tensor, view: str) -> dict[str, tuple[int, ...]]:
    """The global shape of each state tensor the group's rule keeps for ``p``."""
    rule = rule_of(group)
    return {key: rule.state_shape(tuple(p.shape), view or default_view(tuple(p.shape))) for key in rule.state_keys}


def ensure_rule_state(state: dict, group: dict, p: torch.Tensor, view: str) -> None:
    """Zeros for the rule's state keys ``state`` lacks (a rule chosen after the first step too)."""
    rule = rule_of(group)
    for key in rule.state_keys:
        if key not in state:
            state[key] = rule.new_state(p, key, view or default_view(tuple(p.shape)))


def refuse_unfit(group: dict, spec: MatrixSpec) -> None:
    """A ValueError naming the parameter when its group's rule can't update its layout."""
    rule = rule_of(group)
    why = rule.refusal(spec)
    if why:
        raise ValueError(f"update_rule={rule.name!r} can't update parameter {spec.name!r} of shape "
                         f"{tuple(spec.shape)}: {why}")


def rows_held(spec: MatrixSpec, update: torch.Tensor, group_rank: int) -> RowsHeld:
    """Where this rank's rows of ``update`` (its part of one parameter's update) lie."""
    matrix_rows, cols = spec.matrix_shape
    local_rows = update.numel() // cols
    if spec.layout in ROW_SPLIT_LAYOUTS:
        # rows of the parameter read as (rows, cols) per dim-0 entry: 1 for a 2-D matrix or a
        # flattened kernel, the rows of one entry for anything else
        per_entry = 1 if spec.view == "flatten" else math.prod(spec.shape[1:-1])
        first = sum(spec.rows[:group_rank]) * per_entry
        return RowsHeld(matrix_rows, cols, first, spec.num_matrices, spans_ranks=True)
    return RowsHeld(matrix_rows, cols, 0, local_rows // matrix_rows, spans_ranks=False)


def rule_part(batch: BatchPlan, state: torch.Tensor) -> torch.Tensor:
    """The local state tensor, or its rows of the bank part a batch holds (``BatchPlan.part``)."""
    local = local_shard(state)
    if batch.part is None:
        return local
    rows = local.view(-1, batch.matrix_shape[0], 1)
    lo, hi = part_range(rows.shape[0], batch.part)
    return rows[lo:hi]


def apply_rules(batch: BatchPlan, members: list[tuple[int, torch.Tensor]], *, entries, specs, groups,
                state_of, counter) -> list[torch.Tensor]:
    """Each update of ``members`` ((Muon entry index, this rank's update)) through its group's
    rule; the rules' per-matrix sums travel in one all-reduce per rule over the batch's group,
    counted in ``counter`` (a ``CommCounter``) under the rule's name as a ring all-reduce moves
    them: 2 (W - 1) / W of the bytes out and in. ``state_of(i)``: entry i's state dict with its
    rule's keys."""
    out = dict(members)
    by_rule: dict[str, list[int]] = {}
    for i, _ in members:
        by_rule.setdefault(entries[i][0]["update_rule"], []).append(i)
    pg, group_rank = groups[batch.group]

    for name, indices in by_rule.items():
        rule = RULES[name]
        if rule.transform is None:
            continue

        def reduce(flat: torch.Tensor, name=name) -> None:
            if pg is not None and (world := dist.get_world_size(pg)) > 1:
                nbytes = 2 * (world - 1) * flat.numel() * flat.element_size() // world
                counter.add(name, nbytes, nbytes)
                dist.all_reduce(flat, group=pg)

        updates = [out[i] for i in indices]
        states = [[rule_part(batch, state_of(i)[k]) for k in rule.state_keys] for i in indices]
        held = [rows_held(specs[i], u, group_rank) for i, u in zip(indices, updates)]
        results = rule.transform(updates, states, held, [entries[i][0] for i in indices], reduce)
        out.update(zip(indices, results))
    return [out[i] for i, _ in members]
