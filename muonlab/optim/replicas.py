"""Do replicated parameters really hold replicas? Checked across ranks when a plan is made.

A plain tensor under a process group of several ranks is taken as a replica (DDP): each matrix is
orthogonalized on one owner rank and its update applied everywhere. Ranks that plan different
matrices would hang in mismatched collectives, and replicas that differ (independent models per
rank, or equal weights trained on each rank's own data without DDP) would silently train wrong.
``check_ranks_agree`` compares what each rank plans and the replicas' checksums in one exchange.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..comm.specs import MatrixSpec, local_shard


def checksums(tensors: list[torch.Tensor | None]) -> list[tuple[float, float] | None]:
    """Each tensor's (local shard's) sum and sum of squares in fp64, None for None: equal on
    replicas (bit-identical tensors, of any float dtype), cheap, and different for another tensor
    of the same shape (another init, another layer, a gradient of other data). Read to the host
    once per device (on a GPU one synchronisation, not two per tensor)."""
    pairs: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for k, x in enumerate(tensors):
        if x is not None:
            t = local_shard(x).detach().double()
            pairs.setdefault(t.device, []).append((k, torch.stack((t.sum(), t.square().sum()))))
    out: list[tuple[float, float] | None] = [None] * len(tensors)
    for items in pairs.values():
        for (k, _), values in zip(items, torch.stack([pair for _, pair in items]).tolist()):
            out[k] = tuple(values)
    return out


def check_ranks_agree(group, specs: list[MatrixSpec], configs: tuple, params: list[torch.Tensor], budget_bytes: int,
                      grads: bool = False) -> bool:
    """Every rank of ``group`` (the ranks that step together; None or one rank: nothing to compare)
    must plan the same matrices, or collectives would pair up wrongly and hang.
    (Every step first compares what each rank is about to do, see muonlab.optim.agreement;
    this check, on a new plan only, adds each spec's layout and the replicas' checksums.)

    One all_gather_object, once per new plan, of (name, global shape, layout, settings) per
    parameter, and checksums of each replicated (plain-tensor) one: a plain tensor under a
    multi-rank group is taken as a replica (DDP), updated from one owner's result, so replicas
    that differ (independent models per rank, parameters listed in another order) would
    silently train wrong. The workspace budget too: it groups matrices into batches. A
    mismatch is a ValueError naming the ranks and the parameter (or the budgets).

    ``grads`` (a step's plan, every gradient present): the replicas' gradients are compared
    in the same exchange. Equal weights with different gradients are a model without DDP
    given each rank's own data: each matrix would take its owner rank's update everywhere,
    the replicas staying equal, each matrix trained on one rank's data, with no error. DDP's
    all-reduced gradients are bit-identical on every rank (fp32 or bf16 alike: the checksums
    are exact fp64 sums), so they pass. A gradient with an inf or NaN on some rank is left to
    the non-finite check (skip or raise); that parameter's gradients are compared by the
    next step using this plan. Only a
    new plan is checked (the first step, and a change of the layout, the settings or the set
    of parameters with gradients): gradients that diverge only at a later step (data
    parallelism switched off mid-run, a rank skipping the all-reduce) are not caught, since
    comparing them at every step would put a collective that exists only to check into the
    steady-state step (see DESIGN.md, Two phases). The cost, once per plan: each replica's
    gradient summed in fp64 and 16 bytes per replica more in the exchange. Measured at 2 gloo
    ranks sharing 2 CPU cores under DDP: the tests' small GPT (8 matrices, 14k elements)
    +0.2 ms on a first step of 17 ms; 16 matrices of 3.1M elements +4 to 6 ms (the sums) on
    one of 250 ms. A DDP or FSDP2 run plans once; plans are cached per key, so only a plan
    setting that takes a new value at every step (a schedule of ns_steps or eps) would pay
    this at every step.

    Returns whether nothing is left to compare: False where the gradients were not compared
    (``grads`` False, or a gradient not finite on some rank) for some replicated parameter.
    """
    if group is None or dist.get_world_size(group) == 1:
        return True
    mine = [(s.name, s.shape, s.layout, s.num_fused, c, s.view) for s, c in zip(specs, configs)]
    replicas = [s.layout == "replicated" for s in specs]
    sums = checksums([p if r else None for r, p in zip(replicas, params)])
    grad_sums = checksums([p.grad if r and grads else None for r, p in zip(replicas, params)])
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (mine, sums, grad_sums, budget_bytes), group=group)
    ranks = dist.get_process_group_ranks(group)
    first, first_sums, first_grad_sums, first_budget = everyone[0]
    for rank, (theirs, their_sums, _, their_budget) in zip(ranks, everyone):
        if their_budget != first_budget:  # it groups matrices into batches: plans would differ
            raise ValueError(f"ranks disagree on the Newton-Schulz workspace budget: rank {ranks[0]} has "
                             f"{first_budget} bytes, rank {rank} has {their_budget}; pass the same "
                             "workspace_bytes on every rank")
        if theirs != first:
            for a, b in zip(first, theirs):
                if a != b:
                    raise ValueError(
                        f"ranks disagree on the Muon parameters: rank {ranks[0]} has {a[0]!r} of shape {a[1]} "
                        f"({a[2]}), rank {rank} has {b[0]!r} of shape {b[1]} ({b[2]})")
            raise ValueError(f"ranks disagree on the Muon parameters: rank {ranks[0]} has {len(first)} "
                             f"with gradients, rank {rank} has {len(theirs)}")
        for spec, a, b in zip(specs, first_sums, their_sums):
            if a != b:
                raise ValueError(
                    f"replicated parameter {spec.name!r} of shape {spec.shape} differs between rank {ranks[0]} "
                    f"and rank {rank} (checksums {a} vs {b}): a plain tensor under a process group of "
                    "several ranks is taken as a replica (DDP). Wrap the model in DDP or FSDP2 "
                    "(muonlab.distributed.parallelize) so replicas start equal, or give a model of "
                    "its own to each rank with process_group=dist.new_group([rank])")
    if not grads:
        return not any(replicas)
    compared = True
    for k, (spec, replica) in enumerate(zip(specs, replicas)):
        if not replica:
            continue
        theirs = [entry[2][k] for entry in everyone]
        if not all(pair is not None and math.isfinite(pair[0]) and math.isfinite(pair[1]) for pair in theirs):
            compared = False  # the non-finite check's (the step skips or raises); compared next step
            continue
        differ = [rank for rank, pair in zip(ranks, theirs) if pair != first_grad_sums[k]]
        if differ:
            raise ValueError(
                f"replicated parameter {spec.name!r} of shape {spec.shape} has equal weights but a different "
                f"gradient on rank(s) {', '.join(map(str, differ))} than on rank {ranks[0]} (gradient "
                f"checksums {first_grad_sums[k]} vs {theirs[ranks.index(differ[0])]}): a plain tensor under a "
                "process group of several ranks is taken as a replica (DDP) and updated everywhere from its "
                "owner rank's result, so each matrix would follow one rank's data alone. For data-parallel "
                'training wrap the model in DDP (muonlab.distributed.parallelize(model, "ddp")), which '
                "averages the gradients before the step; for a model per rank trained on its own data, "
                "give each rank's optimizer process_group=dist.new_group([rank])")
    return compared
