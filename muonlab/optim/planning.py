"""Muon's plan: which matrices travel and orthogonalize together, made from the parameters'
metadata and the options, cached per set of parameters, and what the plan's batches resolve to.

The functions take what they read: the Muon entries ((group, parameter) pairs in the optimizer's
order), its ``MuonOptions``, its parameter names and views (``NamedParams``), its state stores and
the Newton-Schulz runner, whose budget shapes the batches.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..comm.collectives import dist_on
from ..comm.memory import PlanMemory, over_budget, plan_memory, with_buffer_bytes
from ..comm.paths.base import Itemsizes
from ..comm.paths import PATHS
from ..comm.planner import plan_batches
from ..comm.records import Plan, group_rank_maps
from ..comm.specs import (MatrixSpec, even_share_bytes, is_pieces_placement, local_shard, matrix_spec,
                          process_group_for)
from ..comm.wire import wire_itemsizes
from ..kernels.config import NSConfig, form_for
from ..kernels.newton_schulz import possible_backends, resolve_dtype, resolve_form
from ..kernels.runner import NewtonSchulzRunner, default_budget
from ..kernels.workspace import batch_bytes_per_matrix
from .replicas import check_ranks_agree
from .rule_step import refuse_unfit, rule_of, with_rule_sums
from .step_program import part_of


class Planned(NamedTuple):
    """A plan with what the step needs beside it, cached per set of parameters."""

    plan: Plan
    specs: dict[int, MatrixSpec]
    """Parameter index -> its layout."""
    groups: dict
    """GroupKey -> (torch ProcessGroup, this rank's index in it)."""
    owners: dict[int, tuple]
    """Replicated (DDP) parameter index -> (process group, owner's global rank, owned here)."""
    grads_compared: bool = False
    """Whether the replicas' gradients were compared across ranks (see
    ``muonlab.optim.replicas.check_ranks_agree``): False for a plan made outside a step, or where a
    gradient was not finite; the next step that uses it compares them then."""
    memory: PlanMemory | None = None
    """The plan's buffer bytes per rank and workspace bound (muonlab.comm.memory)."""


def why_captured_again(old: tuple, new: tuple) -> str:
    """Why a captured step's key changed (Muon._graph_key's parts), in words."""
    if old[0] != new[0]:
        return "the prepared step changed: which parameters have gradients, a plan setting or an option"
    if old[1] != new[1]:
        return ("a setting changed (a float lr under a scheduler keeps the step eager: give lr as a tensor on the "
                "parameters' device, which a scheduler fills in place)")
    return ("a parameter or gradient moved: zero_grad(set_to_none=True), torch's default, makes new gradients "
            "each step; use zero_grad(set_to_none=False)")


def _layout(p: torch.Tensor) -> tuple:
    """What a plan depends on of one parameter: which tensor it is, its global and local shapes,
    dtype, device and (for a DTensor) placements."""
    return (id(p), tuple(p.shape), tuple(local_shard(p).shape), p.dtype, p.device,
            tuple(getattr(p, "placements", ())))


def replicate_group(process_group):
    """The group replicated (plain-tensor) parameters are divided over (None: this process alone)."""
    if process_group is not None:
        return process_group
    return dist.group.WORLD if dist_on() and dist.get_world_size() > 1 else None


def ns_config(group: dict, options, device: torch.device) -> NSConfig:
    """A Muon group's Newton-Schulz settings with the optimizer-wide dtype, form and backend."""
    return NSConfig(steps=group["ns_steps"], coefficients=group["ns_coefficients"], eps=group["eps"],
                    dtype=options.ns_dtype, **resolve_form(options.ns_form, options.ns_dtype, device),
                    backend=options.ns_backend)


def new_runner(options, entries: list, device: torch.device) -> NewtonSchulzRunner:
    """The Newton-Schulz runner (chunks within the workspace budget, reused buffers, graphs); its
    ``budget_bytes`` is the one budget the plan and the chunks use. The default is computed from
    each parameter's even share of its bytes, not from this rank's own shards: it decides how
    matrices are grouped into batches, so it must be the same on every rank (uneven FSDP2 shards
    would otherwise give ranks different plans)."""
    budget = options.workspace_bytes
    if budget is None:
        budget = default_budget(sum(even_share_bytes(p) for _, p in entries), device.type)
    return NewtonSchulzRunner(budget, graphs=options.ns_graphs)


def max_local_matrices(shape: tuple[int, int], cfg: NSConfig, device: torch.device, momentum: torch.dtype,
                       runner: NewtonSchulzRunner) -> int:
    """Matrices of ``shape`` one batch of the local path may hold within the budget: its results
    overwrite its momentum inputs, whose bytes serve as an iterate when their dtype (``momentum``,
    the first Muon parameter's, standing for all) is the compute dtype, and count at the
    momentum's itemsize otherwise (fp32 momentum into bf16 Newton-Schulz: twice the bytes)."""
    dtype = resolve_dtype(cfg.dtype, device, shape) or torch.float32
    return runner.chunk_size(shape, dtype, reuses_input=momentum == dtype, cfg=cfg, device=device,
                             input_dtype=momentum)


def plan_for(cache: dict, indices: tuple[int, ...], entries: list, options, named, offload,
             runner: NewtonSchulzRunner | None, device: torch.device | None, check_group,
             collective: bool = True, stepping: bool = False) -> Planned:
    """The plan for these Muon entries. Cached in ``cache``: it depends only on metadata and on the
    settings below (part of the key, so changing one re-plans).

    A new plan is first checked against the other ranks' (over ``check_group``) and its sub-groups
    made, both collectives. ``collective=False`` (``Muon.plan()``, which one rank may call alone)
    skips them and leaves the plan uncached, so the step still checks it. ``stepping``: called by
    a step, whose gradients (all present) are compared too; a plan made outside a step
    (consolidate_state, release_unowned_state: gradients there need not be a step's) has them
    compared by the first step that uses it, in one more exchange of the same check."""
    # one config per group (settings may change between steps, so made anew each step)
    by_group = {id(g): g for g, _ in entries}
    by_group = {key: ns_config(g, options, device) for key, g in by_group.items()}
    configs = tuple(by_group[id(entries[i][0])] for i in indices)
    # each parameter's identity and layout too: one may be replaced, resized (p.data = ...) or
    # resharded between steps, and a plan made for its old shape would update it wrongly
    layouts = tuple(_layout(entries[i][1]) for i in indices)
    rules = tuple(entries[i][0]["update_rule"] for i in indices)  # a rule may refuse a layout
    if runner is not None and options.workspace_bytes not in (None, runner.budget_bytes):
        # set after the runner was made (e.g. as a refused plan's message says): the next plan and chunks use it
        runner.budget_bytes = int(options.workspace_bytes)
    cache_key = (indices, configs, layouts, rules, options.comm_dtype, options.strategy, options.remainder_path,
                 options.hardware_profile, options.memory_budget, runner.budget_bytes if runner is not None else None)
    if cache_key not in cache:
        if runner is not None:  # a new plan is made outside the hot step: the place to read them
            runner.health.warn_unread(" (read when making a new plan)")
        for i in indices:  # still a matrix Muon can update (it may have changed since construction)
            named.check_param(entries[i][1], "muon", options)
        replicate = replicate_group(options.process_group)
        specs, groups = [], {None: (None, 0)}
        for i in indices:
            group, p = entries[i]
            name = named.names.get(p, f"param{i}")
            # a rule with per-row state keeps TP-split heads on "pieces", where its state's layout holds
            spec = matrix_spec(i, name, p, replicate, named.fused_banks.get(name, 1), named.view_of(p),
                               tp_slices=not rule_of(group).state_keys)
            refuse_unfit(group, spec)
            specs.append(spec)
            if spec.group not in groups:
                groups[spec.group] = process_group_for(p, spec, replicate, create=collective)
        compared = False
        if collective:  # before planning: disagreeing ranks can't plan alike
            compared = check_ranks_agree(check_group, specs, configs, [entries[i][1] for i in indices],
                                         runner.budget_bytes, grads=stepping)

        def momentum_dtype(spec: MatrixSpec) -> torch.dtype:  # what Newton-Schulz reads with ns_dtype=None
            return offload.dtype(entries[spec.index][1], "momentum_buffer")

        # each batch's wire dtype follows its Newton-Schulz dtype on this device (comm_dtype "auto")
        wire = wire_itemsizes(options.comm_dtype, device=device, input_dtype=momentum_dtype)
        sizes = itemsizes_of(entries, offload, device)

        def planned_with(runner: NewtonSchulzRunner) -> tuple[Plan, PlanMemory]:
            def max_local(shape: tuple[int, int], cfg: NSConfig) -> int:
                return max_local_matrices(shape, cfg, device, offload.dtype(entries[0][1], "momentum_buffer"), runner)

            plan = plan_batches(
                specs, configs, comm_itemsize=wire,
                remainder_path=options.remainder_path, strategy=options.strategy, profile=options.hardware_profile,
                max_local_matrices=max_local,
            )
            plan = with_rule_sums(plan, {s.index: s for s in specs}, lambda i: rule_of(entries[i][0]))
            plan = Plan(tuple(with_buffer_bytes(plan, sizes)))
            return plan, plan_memory(plan, world_of(plan), sizes, runner.budget_bytes, matrix_bytes(sizes))

        plan, memory = planned_with(runner)
        if collective:  # a step: refused before it changes anything (Muon.plan() shows it instead)
            refuse_over_budget(memory, memory_budget(options, device, check_group, runner), planned_with, runner)
        owners = {}
        for b in plan:
            if b.part is not None:  # a bank that can't be cut raises here, before anything changes
                part_of(b, local_shard(entries[b.param_indices[0]][1]))
            prepare = PATHS[b.path].prepare_groups
            if prepare is not None and collective:  # process groups are made collectively, here, never mid-step
                prepare(b)
            homes = PATHS[b.path].state_homes
            if homes is not None:  # one rank of the group keeps each parameter's state (owner: replicas)
                pg, me = groups[b.group]
                owners.update({i: (pg, dist.get_global_rank(pg, o), mine) for i, (o, mine) in homes(b, me).items()})
        memory = dataclasses.replace(memory, state=state_bytes([entries[i] for i in indices], indices, owners, named,
                                                               offload))
        planned = Planned(plan, {s.index: s for s in specs}, groups, owners, compared, memory)
        if not collective:
            return planned
        cache[cache_key] = planned
    elif stepping and not cache[cache_key].grads_compared:  # (the cache is alike on every rank)
        planned = cache[cache_key]
        compared = check_ranks_agree(check_group, [planned.specs[i] for i in indices], configs,
                                     [entries[i][1] for i in indices], runner.budget_bytes, grads=True)
        cache[cache_key] = planned._replace(grads_compared=compared)
    return cache[cache_key]


def itemsizes_of(entries: list, offload, device: torch.device):
    """``batch -> Itemsizes``: its momentum's (the first parameter's, for all), its Newton-Schulz
    output's on ``device`` (None: what it is handed) and its wire itemsize."""
    def sizes(batch) -> Itemsizes:
        momentum = offload.dtype(entries[batch.param_indices[0]][1], "momentum_buffer")
        ns = resolve_dtype(batch.ns_config.dtype, device, batch.matrix_shape)
        return Itemsizes(momentum.itemsize, None if ns is None else ns.itemsize, batch.comm_itemsize)
    return sizes


def matrix_bytes(sizes):
    """``batch -> bytes`` of one of its matrices in a Newton-Schulz call (the workspace takes one
    whatever the budget)."""
    def one(batch) -> int:
        s = sizes(batch)
        m, n = sorted(batch.matrix_shape)
        return batch_bytes_per_matrix(m, n, s.ns or s.momentum)
    return one


def world_of(plan: Plan) -> int:
    """Global ranks the plan spans, or the world where larger (a rank with no batch has no buffers)."""
    spanned = 1 + max((g for ranks in group_rank_maps(plan.batches).values() for g in ranks), default=0)
    return max(spanned, dist.get_world_size() if dist_on() else 1)


def memory_budget(options, device: torch.device, group, runner: NewtonSchulzRunner) -> int | None:
    """``options.memory_budget`` in bytes per rank (None: no limit). "auto": on CUDA the device's
    free memory now, plus what this process holds and the step may reuse (the caching allocator's
    unused blocks, the workspace arena, which the plan counts), the least over ``group``'s ranks
    (every rank must refuse alike, or the others would wait in the step's collectives); elsewhere
    no limit."""
    budget = options.memory_budget
    if budget != "auto":
        return budget
    if device.type != "cuda":
        return None
    reusable = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device) + runner.nbytes
    free = torch.cuda.mem_get_info(device)[0] + reusable
    if dist_on() and dist.get_world_size(group) > 1:
        least = torch.tensor(free, device=device)
        dist.all_reduce(least, op=dist.ReduceOp.MIN, group=group)
        free = least.item()
    return int(free)


def refuse_over_budget(memory: PlanMemory, budget: int | None, planned_with, runner: NewtonSchulzRunner) -> None:
    """ValueError where ``memory`` exceeds ``budget``, naming the batch and a ``workspace_bytes``
    that fits (planned again at halves of the current one), or saying none does."""
    why = None if budget is None else over_budget(memory, budget)
    if why is None:
        return
    ws, floor = runner.budget_bytes // 2, 1 << 20
    while ws >= floor:
        _, smaller = planned_with(NewtonSchulzRunner(ws))
        if over_budget(smaller, budget) is None:
            raise ValueError(f"{why}: workspace_bytes={ws} fits (step needs "
                             f"{smaller.peak(smaller.worst_rank)} bytes), or raise memory_budget")
        ws //= 2
    raise ValueError(f"{why}: no workspace_bytes down to {floor} fits (the buffers alone need "
                     f"{memory.ranks[memory.worst_rank].peak} bytes): raise memory_budget, or shard the parameters of "
                     "that batch over more ranks")


def state_bytes(entries: list, indices, owners: dict, named, offload) -> int:
    """This rank's Muon state between steps: the momentum of each shard whose momentum lives here (a
    replicated matrix's on its owner alone), in its dtype, and the update rule's state, fp32, as
    ``UpdateRule.new_state`` lays it out (the local rows of a sharded parameter; whole for a stored
    (in, out) matrix or a tensor-parallel piece)."""
    total = 0
    for i, (group, p) in zip(indices, entries):
        local = local_shard(p)
        if i not in owners or owners[i][2]:
            total += local.numel() * offload.dtype(p, "momentum_buffer").itemsize
        rule, view = rule_of(group), named.view_of(p)
        for _ in rule.state_keys:
            shape = rule.state_shape(tuple(p.shape), view)
            if hasattr(p, "to_local") and not (view == "transpose" or is_pieces_placement(p.placements)):
                shape = (local.shape[0], *shape[1:])
            total += math.prod(shape) * 4
    return total


def memory_of(opt) -> PlanMemory:
    """The memory ``opt``'s plan for all its Muon parameters reports (``Muon.plan()``'s plan):
    per global rank the buffers' peak and the batches then in flight, each batch's bytes, and
    the Newton-Schulz workspace's bound. Made from metadata alone, without a step."""
    return opt._plan_for(tuple(range(len(opt._muon_entries()))), collective=False).memory


def resolved_choices(plan: Plan, runner: NewtonSchulzRunner | None, device: torch.device,
                     param_dtype: torch.dtype) -> list[dict]:
    """Muon.resolved_choices' rows for ``plan``: what ran on this rank (``runner.ran``), else what
    the rules give from the shapes (``param_dtype``: the first Muon parameter's, for ns_dtype=None)."""
    runner_ran = runner.ran if runner is not None else {}
    rows = []
    for batch in plan:
        shape = tuple(batch.matrix_shape)
        ran = runner_ran.get(shape)
        if ran is None:
            cfg = batch.ns_config
            dtype = resolve_dtype(cfg.dtype, device, shape) or param_dtype
            backends = possible_backends(cfg.backend, device, dtype)
            ran = dict(dtype=str(dtype).removeprefix("torch."), form=form_for(cfg, shape),
                       backend=backends[0] if len(backends) == 1 else "auto (timed at the first step)")
        rows.append(dict(batch=batch.index, names=batch.names, shape=shape, matrices=batch.num_matrices,
                         path=batch.path, wave=batch.travels_with, **ran,
                         wire_dtype=str(batch.wire_dtype).removeprefix("torch.")))
    return rows
