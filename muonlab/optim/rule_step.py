"""The update rule's stage of a Muon step: between a batch's orthogonalized updates coming back and
the parameters taking them (``muonlab.optim.rules`` holds the rules; this is where the step meets
them: each matrix's rule, its state, the rows this rank holds, and the group the sums travel in).

A batch's rule runs when its updates come back; where its sums travel across ranks (NorMuon's
norms of a row-sharded matrix) their all-reduce is issued then and the batch is applied when the
next batch comes back, so the sums travel while that batch computes (``RuleStage``).

A rule's state lives with the rows of its parameter, as the parameter itself does: a row shard's
on that shard, an expert bank's with its experts. A replicated (DDP) matrix's lives on every
replica: each receives the whole update and applies it, so each updates its copy of the state
alike (the momentum alone has one home, see ``muonlab.optim.momentum_homes``). Rule state stays on
the parameters' device under ``state_offload``: it is one number per row, 1/cols of the momentum.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..comm.records import BatchPlan, Plan, part_range
from ..comm.specs import MatrixSpec, default_view, local_shard, piece_rows
from .rules import ROW_SPLIT_LAYOUTS, RULES, RowsHeld, UpdateRule


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
    refuse_unfit_for(rule_of(group), spec)


def refuse_unfit_for(rule: UpdateRule, spec: MatrixSpec) -> None:
    """``refuse_unfit`` with the rule given (a simulation has no groups)."""
    why = rule.refusal(spec)
    if why:
        raise ValueError(f"update_rule={rule.name!r} can't update parameter {spec.name!r} of shape "
                         f"{tuple(spec.shape)}: {why}")


def with_rule_sums(plan: Plan, specs: dict[int, MatrixSpec], rule_for: Callable[[int], UpdateRule]) -> Plan:
    """``plan`` with each batch's ``rule_sums``: what its matrices' update rules (``rule_for(i)``
    of Muon entry i) add across the batch's group once it is back, as ``RuleStage`` sends it."""
    batches = []
    for b in plan:
        sums = 0
        if b.group is not None and b.group.size > 1:
            sums = sum(rule_for(i).sums(specs[i]) for i in b.param_indices if specs[i].layout in ROW_SPLIT_LAYOUTS)
        batches.append(dataclasses.replace(b, rule_sums=sums) if sums else b)
    return Plan(tuple(batches))


def rows_held(spec: MatrixSpec, update: torch.Tensor, group_rank: int) -> RowsHeld:
    """Where this rank's rows of ``update`` (its part of one parameter's update) lie."""
    matrix_rows, cols = spec.matrix_shape
    if spec.layout == "pieces":
        return RowsHeld(matrix_rows, cols, 0, spec.num_matrices, spans_ranks=True, columns=spec.view == "transpose",
                        rows=tuple(piece_rows(spec, group_rank)))
    local_rows = update.numel() // cols
    if spec.layout in ROW_SPLIT_LAYOUTS:
        # rows of the parameter read as (rows, cols) per dim-0 entry: 1 for a 2-D matrix or a
        # flattened kernel, the rows of one entry for anything else
        per_entry = 1 if spec.view == "flatten" else math.prod(spec.shape[1:-1])
        first = sum(spec.rows[:group_rank]) * per_entry
        return RowsHeld(matrix_rows, cols, first, spec.num_matrices, spans_ranks=True,
                        columns=spec.view == "transpose")
    return RowsHeld(matrix_rows, cols, 0, local_rows // matrix_rows, spans_ranks=False,
                    columns=spec.view == "transpose")


def rule_part(batch: BatchPlan, state: torch.Tensor) -> torch.Tensor:
    """The local state tensor, or its rows of the bank part a batch holds (``BatchPlan.part``)."""
    local = local_shard(state)
    if batch.part is None:
        return local
    rows = local.view(-1, batch.matrix_shape[0], 1)
    lo, hi = part_range(rows.shape[0], batch.part)
    return rows[lo:hi]


class _Travel:
    """One rule's run over a batch's matrices: its transform (a generator) paused where it
    yielded the sums that travel across ranks, with the all-reduce carrying them."""

    def __init__(self, indices, transform, flat=None, work=None, result=None, kept=None):
        self.indices, self.transform, self.flat, self.work, self.result = indices, transform, flat, work, result
        self.kept = kept  # under a gate: (the rule's state tensors, their values before the transform)

    def finish(self) -> list:
        if self.result is None:
            if self.work is not None:
                self.work.wait()
            try:
                self.transform.send(self.flat)
            except StopIteration as done:
                self.result = done.value
            else:  # pragma: no cover - a rule yields once
                raise RuntimeError("an update rule's transform yielded twice")
        return self.result


class RuleStage:
    """The update rule's stage over one step's batches (see the module doc).

    ``start(batch, pairs)`` runs each matrix's rule on the batch's updates as they come back, up
    to the sums that travel across ranks, and issues their all-reduce (async: it travels while the
    next batch computes); ``finish_due()`` then calls ``apply_update(batch, pairs, scales)`` for
    each batch whose sums are back: the batches before the last, or at ``flush()`` (the end of the
    step) the last. So one
    batch's updates wait a batch longer when its rule's sums travel; a rule whose sums stay on this
    rank applies at once. The all-reduce per rule and batch is counted in ``counter`` under the
    rule's name, as a ring all-reduce moves it: 2 (W - 1) / W of its bytes out and in.

    ``gate`` (a muonlab.optim.step_gate.StepGate: the step decided on the device): a rule's state
    keeps its values unless the step goes (a copy taken before its transform, restored through
    the gate: rule state is one number per row, so the copy is small and any rule is covered)."""

    def __init__(self, *, entries, specs, groups, state_of, counter, apply_update, gate=None):
        self._entries, self._specs, self._groups = entries, specs, groups
        self._state_of, self._counter, self._apply_update = state_of, counter, apply_update
        self._gate = gate
        self._waiting: list[tuple[BatchPlan, list, list[_Travel]]] = []

    def start(self, batch: BatchPlan, pairs: list[tuple[int, torch.Tensor]]) -> None:
        entries = self._entries
        by_rule: dict[str, list[int]] = {}
        for i, _ in pairs:
            by_rule.setdefault(entries[i][0]["update_rule"], []).append(i)
        pg, group_rank = self._groups[batch.group]
        world = dist.get_world_size(pg) if pg is not None else 1
        updates = dict(pairs)
        travels = []
        for name, indices in by_rule.items():
            rule = RULES[name]
            if rule.transform is None:
                travels.append(_Travel(indices, None, result=[(updates[i], None) for i in indices]))
                continue
            mine = [updates[i] for i in indices]
            states = [[rule_part(batch, self._state_of(i)[k]) for k in rule.state_keys] for i in indices]
            held = [rows_held(self._specs[i], u, group_rank) for i, u in zip(indices, mine)]
            kept = None if self._gate is None else [(s, s.clone()) for per in states for s in per]
            transform = rule.transform(mine, states, held, [entries[i][0] for i in indices])
            try:
                flat = next(transform)
            except StopIteration as done:  # nothing to sum across ranks
                travels.append(_Travel(indices, transform, result=done.value, kept=kept))
                continue
            work = None
            if world > 1:
                nbytes = 2 * (world - 1) * flat.numel() * flat.element_size() // world
                self._counter.add(name, nbytes, nbytes)
                work = dist.all_reduce(flat, group=pg, async_op=True)
            travels.append(_Travel(indices, transform, flat, work, kept=kept))
        self._waiting.append((batch, pairs, travels))

    def finish_due(self) -> None:
        """Apply the batches started before the last one (their sums had a batch's time to
        travel), and the last one too when nothing of it travels."""
        while self._waiting and (len(self._waiting) > 1 or all(t.work is None for t in self._waiting[-1][2])):
            self._finish(*self._waiting.pop(0))

    def flush(self) -> None:
        while self._waiting:
            self._finish(*self._waiting.pop(0))

    def _finish(self, batch: BatchPlan, pairs: list, travels: list[_Travel]) -> None:
        done = {}
        for t in travels:
            done.update(zip(t.indices, t.finish()))
            for state, before in t.kept or ():
                self._gate.restore_unless_go_(state, before)
        self._apply_update(batch, [(i, done[i][0]) for i, _ in pairs], [done[i][1] for i, _ in pairs])
