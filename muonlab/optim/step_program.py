"""The step program: what each batch of a plan needs in the hot step, made once with the plan.

The plan says which matrices travel together (``BatchPlan``); the program holds, per batch, the
parameters in the batch's order, which of them this rank takes the momentum of (a replicated
matrix's runs on its owner only), the runs of matrices that share a parameter group (each run is
one ``muon_momentum_`` and one ``muon_apply_`` call) and each matrix's lr ratio. The hot step then
makes a number of Python calls per batch that does not grow with its matrices: what changes
between steps is read per batch in one list comprehension each (the gradients, a new tensor every
step under ``zero_grad(set_to_none=True)``; the local shards; the momentum buffers, which loading
a state dict replaces), the settings once per run (a scheduler moves them between steps).

Where that can't hold, a batch takes the per-matrix way: a bank cut into parts (each matrix
through ``part_of``), momentum offloaded to the host or a file (fetched one matrix ahead), a
momentum buffer not made yet (``state_for`` makes it).

What a step would otherwise look up each time it is made from settings fixed with the plan (where
momentum lives, whether an update rule transforms updates, the device) is decided when the program
is made, and the step's spans go straight into its tracer's log (muonlab.trace.Tracer.log): a
step makes no call to read them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..comm.collectives import CommCounter
from ..comm.engine import execute_plan, path_contexts
from ..comm.records import BatchPlan, part_range
from ..comm.specs import DTensor, MatrixSpec, local_shards
from . import functional as F
from .rule_step import RuleStage, ensure_rule_state, rule_of
from .saved_state import state_for
from .validation import fmt_shape


def part_of(batch: BatchPlan, local: torch.Tensor, read_only: bool = False) -> torch.Tensor:
    """``local`` (a parameter-shaped local tensor: the shard, its grad or its momentum) or, for a
    batch holding one part of a bank (``BatchPlan.part``), the view of the part's matrices: the
    part's run of the matrices this rank holds, the same cut as the planner's. ``read_only``: a
    copy will do where no view can (a grad)."""
    if batch.part is None:
        return local
    try:
        mats = local.reshape(-1, *batch.matrix_shape) if read_only else local.view(-1, *batch.matrix_shape)
    except RuntimeError as err:
        raise ValueError(f"parameter {batch.names[0]!r}: its local {fmt_shape(local.shape)} tensor is not laid out "
                         f"as contiguous {fmt_shape(batch.matrix_shape)} matrices, so its bank can't be cut into "
                         f"parts; make it contiguous or raise workspace_bytes") from err
    lo, hi = part_range(mats.shape[0], batch.part)
    return mats[lo:hi]


def lr_of(group: dict) -> float | torch.Tensor:
    """A group's lr as the step uses it: a float, or a tensor lr as it is (read on the device)."""
    lr = group["lr"]
    return lr if isinstance(lr, torch.Tensor) else float(lr)


@dataclass(frozen=True)
class Run:
    """Matrices of one batch that share a parameter group: one momentum or update call."""

    group: dict
    """The parameter group whose settings the call reads (at each step: a scheduler moves them)."""
    positions: tuple[int, ...]
    """Their places in the batch's parameter list."""
    ratios: tuple[float, ...] = ()
    """Their lr ratios (``adjust_lr`` of each matrix's GLOBAL shape; update runs only)."""
    whole: bool = False
    """Whether the run is every matrix of its list, in order (then the lists are passed as they are)."""


@dataclass(frozen=True)
class BatchProgram:
    """One batch of the plan, as the hot step runs it on this rank."""

    batch: BatchPlan
    params: tuple[torch.Tensor, ...]
    """The batch's parameters, in its order (``batch.param_indices``)."""
    mine: tuple[int, ...]
    """Places of the parameters whose momentum this rank takes (all but replicas owned elsewhere)."""
    mine_params: tuple[torch.Tensor, ...]
    """Those parameters."""
    plain: bool
    """No parameter of the batch is a DTensor: its tensors are their own local shards."""
    momentum_runs: tuple[Run, ...]
    """Runs over ``mine``'s places: positions index ``mine``."""
    update_runs: tuple[Run, ...]
    """Runs over every parameter of the batch (each rank updates its shard of each)."""
    ran_here: tuple[bool | None, ...]
    """For the spectral observer, per parameter: whether this rank ran its Newton-Schulz (None: a
    replicated matrix without an owner, which every rank ran)."""


def _runs(groups: list[dict], ratios: list[float] | None = None) -> tuple[Run, ...]:
    """The places of a list whose k-th matrix is in ``groups[k]``, split by group in first-seen order."""
    by_group: dict[int, tuple[dict, list[int]]] = {}
    for k, group in enumerate(groups):
        by_group.setdefault(id(group), (group, []))[1].append(k)
    return tuple(Run(group, tuple(ks), tuple(ratios[k] for k in ks) if ratios is not None else (),
                     whole=len(ks) == len(groups))
                 for group, ks in by_group.values())


def batch_program(batch: BatchPlan, entries: list[tuple[dict, torch.Tensor]], specs: dict[int, MatrixSpec],
                  owners: dict[int, tuple]) -> BatchProgram:
    """The program of one batch: ``entries`` (the optimizer's Muon (group, parameter) pairs),
    ``specs`` (layout per entry index) and ``owners`` (replicated entry index -> (group, owner's
    global rank, owned here)) as the plan gives them."""
    indices = batch.param_indices
    groups = [entries[i][0] for i in indices]
    here = [i not in owners or owners[i][2] for i in indices]  # a replica's momentum: on its owner only
    mine = [k for k, h in enumerate(here) if h]
    ratios = [F.adjust_lr_ratio(specs[i].lr_shape, entries[i][0]["adjust_lr"]) for i in indices]
    params = tuple(entries[i][1] for i in indices)
    return BatchProgram(
        batch=batch, params=params, mine=tuple(mine), mine_params=tuple(params[k] for k in mine),
        plain=DTensor is None or not any(isinstance(p, DTensor) for p in params),
        momentum_runs=_runs([groups[k] for k in mine]), update_runs=_runs(groups, ratios),
        ran_here=tuple(None if i not in owners and specs[i].layout == "replicated" else h
                       for i, h in zip(indices, here)))


class StepProgram:
    """Every batch of a plan (``BatchProgram``), and the two stages the engine calls per batch:
    ``prepare`` (momentum, the Newton-Schulz inputs) and ``apply`` (the observer, then the update
    rule or the update). ``run`` runs one step's batches.

    ``param_groups``, ``offload`` (the optimizer's ``StateStores``) and ``view_of`` (a parameter's
    matrix view) are read once, here: the settings they give (the update rule, where momentum
    lives) are fixed while the plan is (muonlab.optim.prepared.PLAN_SETTINGS)."""

    def __init__(self, plan, entries, specs, owners, groups, device, *, param_groups: list[dict], offload, view_of):
        self.plan, self.entries, self.specs, self.groups, self.device = plan, entries, specs, groups, device
        self.batches = [batch_program(b, entries, specs, owners) for b in plan.batches]
        self._states: list[tuple | None] = [None] * len(self.batches)
        """Per batch, (the state table, its version, the state dict of each of ``mine_params``) as
        last looked up (muonlab.optim.state_table)."""
        self.contexts = path_contexts(plan, groups, device)
        """Each batch's ``PathContext`` (muonlab.comm.engine), for the engine."""
        self.ruled = any(rule_of(g).transform is not None for g in param_groups if g["algorithm"] == "muon")
        """Whether an update rule transforms updates: then a step runs a ``RuleStage``."""
        self._offload, self._view_of = offload, view_of
        self._resident = offload.place_of("momentum_buffer") is None
        # the step's parts (``run``): the optimizer's state, the tracer, the gate, the spectral
        # observer and the rule's stage
        self._state = self._tracer = self._gate = self._observer = self._stage = None

    def run(self, state, runner, tracer, counter: CommCounter, gate, observer) -> None:
        """One step's Muon batches (see muonlab.comm.engine): momentum on the local shards, move,
        orthogonalize (``runner``), move back, update; only the batches in flight hold inputs and
        outputs. ``state``: the optimizer's; ``gate``: the step's ``StepGate`` (a decision on the
        device) or None; ``observer``: the spectral observer of this step, or None."""
        runner.health.begin_step()  # this step's unhealthy updates, counted on the device (Muon's last_step_stats)
        stage = None
        if self.ruled:
            stage = RuleStage(entries=self.entries, specs=self.specs, groups=self.groups, state_of=self._rule_state,
                              counter=counter, apply_update=self.ruled_update, gate=gate)
        self._state, self._tracer, self._gate, self._observer, self._stage = state, tracer, gate, observer, stage
        execute_plan(self.plan, self.groups, prepare=self.prepare, apply=self.apply, orthogonalize=runner,
                     tracer=tracer, counter=counter, device=self.device, contexts=self.contexts)
        if stage is not None:
            stage.flush()  # the last batch whose rule's sums travelled

    def _rule_state(self, i: int) -> dict:
        p = self.entries[i][1]
        entry = self._state[p]  # a replica's rule state lives on every rank (muonlab.optim.rule_step)
        ensure_rule_state(entry, self.entries[i][0], p, self._view_of(p))
        return entry

    # -------------------------------------------------------------------- 1. momentum

    def prepare(self, batch: BatchPlan) -> list[torch.Tensor | None]:
        """This rank's Newton-Schulz input per parameter of ``batch`` (None where another rank
        takes its momentum), its momentum updated."""
        prog, tracer = self.batches[batch.index], self._tracer
        start = tracer.mark()
        try:
            mine = prog.mine_params
            bufs = None
            if self._resident and batch.part is None:
                # the momentum buffers, from the state dicts kept while the state table is unchanged
                # (a lookup hashes each tensor: a Python call; a table without a version: every step)
                table = self._state
                version = getattr(table, "version", None)
                kept = self._states[batch.index]
                if kept is None or kept[0] is not table or kept[1] != version or version is None:
                    states = [table[p] for p in mine]  # (a missing one is added, and counted)
                    kept = self._states[batch.index] = (table, getattr(table, "version", None), states)
                bufs = [s.get("momentum_buffer") for s in kept[2]]
                for buf in bufs:  # by identity: `None in bufs` compares DTensors with ==, ~30 us each
                    if buf is None:  # not made yet: the per-matrix way makes it
                        bufs = None
                        break
                if bufs is not None and not prog.plain:
                    bufs = local_shards(bufs)
            if bufs is None:
                outs = self._momentum_each(prog, mine)
            else:
                grads = [p.grad for p in mine]
                if not prog.plain:
                    grads = local_shards(grads)
                outs = [None] * len(mine)
                for run in prog.momentum_runs:
                    group, ks = run.group, run.positions
                    got = F.muon_momentum_(grads if run.whole else [grads[k] for k in ks],
                                           bufs if run.whole else [bufs[k] for k in ks],
                                           momentum=group["momentum"], nesterov=group["nesterov"],
                                           form=group["momentum_form"], gate=self._gate)
                    if run.whole:
                        outs = got
                    else:
                        for k, out in zip(ks, got):
                            outs[k] = out
            if len(mine) == len(prog.params):
                return outs
            inputs: list[torch.Tensor | None] = [None] * len(prog.params)
            for k, out in zip(prog.mine, outs):
                inputs[k] = out
            return inputs
        finally:  # recorded however it is left, as a span context would
            tracer.log.append(("momentum", start, tracer.mark(), {"batch": batch.index}))

    def _momentum_each(self, prog: BatchProgram, mine: list[torch.Tensor]) -> list[torch.Tensor]:
        """The momentum one matrix at a time: a batch holding a part of a bank, momentum kept off
        the device (the store fetches the next matrix's while this one computes) or not made yet."""
        batch, state = prog.batch, self._state
        group_of = {k: run.group for run in prog.momentum_runs for k in run.positions}
        items = [(k, p, state_for(state, p, "muon", self._offload, group_of[k], self._view_of))
                 for k, p in enumerate(mine)]
        outs: list = [None] * len(mine)
        for k, (buf,) in self._offload.each(items, ("momentum_buffer",), view=lambda t: part_of(batch, t)):
            group = group_of[k]
            grad = part_of(batch, local_shards([mine[k].grad])[0], read_only=True)
            outs[k], = F.muon_momentum_([grad], [buf], momentum=group["momentum"], nesterov=group["nesterov"],
                                        form=group["momentum_form"], gate=self._gate)
        return outs

    # -------------------------------------------------------------------- 3. update

    def apply(self, batch: BatchPlan, outputs: list[torch.Tensor]) -> None:
        """The Newton-Schulz outputs to the spectral observer (a recording step), then to the
        update rule's stage (which applies the batch once its sums are back) or the update."""
        prog, tracer, stage = self.batches[batch.index], self._tracer, self._stage
        start = tracer.mark()
        try:
            if self._observer is not None:
                for p, out, here in zip(prog.params, outputs, prog.ran_here):
                    self._observer(p, out, here)
            if stage is None:
                self.update(batch, outputs)
                return
            stage.start(batch, list(zip(batch.param_indices, outputs)))
        finally:
            tracer.log.append(("update", start, tracer.mark(), {"batch": batch.index}))
        stage.finish_due()  # each batch applied in an "update" span of its own

    def update(self, batch: BatchPlan, outputs: list[torch.Tensor], scales: list | None = None) -> None:
        """Decay and update each parameter's local shard (of a bank in parts, the part), with its
        lr ratio and, when the update rule gave them, its row scales; one call per run."""
        prog = self.batches[batch.index]
        params = prog.params if prog.plain else local_shards(prog.params)
        if batch.part is not None:
            params = [part_of(batch, t) for t in params]
        for run in prog.update_runs:
            group, ks = run.group, run.positions
            lr = group["lr"]  # lr_of(group), written out: a call per batch is host work every step repeats
            F.muon_apply_(params if run.whole else [params[k] for k in ks],
                          outputs if run.whole else [outputs[k] for k in ks],
                          lr=lr if isinstance(lr, torch.Tensor) else float(lr), weight_decay=group["weight_decay"],
                          ratios=run.ratios, row_scales=None if scales is None else [scales[k] for k in ks],
                          gate=self._gate)

    def ruled_update(self, batch: BatchPlan, pairs: list[tuple[int, torch.Tensor]], scales: list) -> None:
        """The update of a batch whose rule's sums came back (``RuleStage``'s ``apply_update``)."""
        tracer = self._tracer
        start = tracer.mark()
        try:
            self.update(batch, [out for _, out in pairs], scales)
        finally:
            tracer.log.append(("update", start, tracer.mark(), {"batch": batch.index}))
