"""Do replicated parameters really hold replicas? Checked across ranks: in full when a plan is
made, their gradients at every step.

A plain tensor under a process group of several ranks is taken as a replica (DDP): each matrix is
orthogonalized on one owner rank and its update applied everywhere. Ranks that plan different
matrices would hang in mismatched collectives, and replicas that differ (independent models per
rank, or equal weights trained on each rank's own data without DDP) would silently train wrong:
each matrix would follow its owner rank's data alone, the replicas staying equal.

``check_ranks_agree`` compares what each rank plans and the replicas' checksums (weights and, in a
step, gradients) in one exchange, when a plan is made. Gradients that part ways later (DDP
switched off mid-run, a rank skipping the all-reduce, the same batch at the first step only) are
caught by the step that has them: each step's control exchange (muonlab.optim.agreement) carries a
fingerprint of this rank's replicated gradients (``fingerprints``, ``fold``), and only when the
fingerprints differ do the ranks exchange per-matrix values to name the parameter
(``name_the_difference``), every rank raising the same ValueError before anything changes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..comm.specs import MatrixSpec, local_shard
from .agreement import digest

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""The integer dtype of each float width: a gradient's bits, read as integers."""


def fingerprints(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per gradient, the sum of its elements' bit patterns read as integers, mod 2**32: an int32
    vector on the first gradient's device, nothing read. Integer sums are exact and the same in any
    order, so bit-identical gradients (DDP's all-reduced ones) give equal values on every rank,
    whatever the thread count, vector width or GPU reduction order, where a float sum need not.
    Gradients that differ anywhere differ by a nonzero amount that cancels mod 2**32 with
    probability about 2**-32 per matrix (gradients of other data differ in nearly every element),
    and a run whose replicas drifted is compared again at the next step. One reduction per
    matrix reading its bits once (no copy: a same-width view; the non-finite pass reads and writes
    them); its cost is measured in benchmarks/results/peers_check.md."""
    device = grads[0].device
    sums = []
    for g in grads:
        bits = g.detach().view(_BITS[g.element_size()])
        if g.element_size() == 8:  # summed mod 2**64, its high word added in: the sign and exponent count
            total = bits.sum()
            total = total + (total >> 32)
        else:
            total = bits.sum(dtype=torch.int32)
        total = total.to(torch.int32)
        sums.append(total if total.device == device else total.to(device))
    return torch.stack(sums)


def fold(values: list[int]) -> int:
    """The per-matrix ``fingerprints`` (read) as the one 63-bit value a rank sends in the step's
    control exchange (muonlab.optim.agreement)."""
    return digest(values)


def name_the_difference(group, names: list[str], params: Sequence[torch.Tensor], values: list[int]) -> str:
    """After the step's exchange found fingerprints that differ: every rank of ``group`` calls this
    (one all_gather_object of its per-matrix values and its weights' ``checksums``) and gets the
    same message naming the first replicated parameter that differs, and the ranks."""
    everyone: list = [None] * dist.get_world_size(group)
    shapes = [tuple(p.shape) for p in params]
    dist.all_gather_object(everyone, (names, shapes, values, checksums(list(params))), group=group)
    ranks = dist.get_process_group_ranks(group)
    first_names, first_shapes, first_values, first_sums = everyone[0]
    for rank, (their_names, their_shapes, _, _) in zip(ranks, everyone):
        if (their_names, their_shapes) != (first_names, first_shapes):
            return (f"ranks disagree on the replicated Muon parameters: rank {ranks[0]} has "
                    f"{list(zip(first_names, first_shapes))}, rank {rank} has {list(zip(their_names, their_shapes))}")
    for k, (name, shape) in enumerate(zip(first_names, first_shapes)):
        for rank, (_, _, _, their_sums) in zip(ranks, everyone):
            if their_sums[k] != first_sums[k]:
                return different_weights(name, shape, ranks[0], rank, f"checksums {first_sums[k]} vs {their_sums[k]}")
        differ = [(rank, theirs[k]) for rank, (_, _, theirs, _) in zip(ranks, everyone) if theirs[k] != first_values[k]]
        if differ:
            return different_gradients(name, shape, ranks[0], [rank for rank, _ in differ],
                                       f"gradient fingerprints {first_values[k]} vs {differ[0][1]}")
    return "replicated Muon parameters' gradients differ between ranks"  # pragma: no cover - values differ


def different_weights(name: str, shape: tuple, first_rank: int, rank: int, evidence: str) -> str:
    """The error for replicas whose weights differ (``evidence``: the values compared)."""
    return (f"replicated parameter {name!r} of shape {shape} differs between rank {first_rank} "
            f"and rank {rank} ({evidence}): a plain tensor under a process group of "
            "several ranks is taken as a replica (DDP). Wrap the model in DDP or FSDP2 "
            "(muonlab.distributed.parallelize) so replicas start equal, or give a model of "
            "its own to each rank with process_group=dist.new_group([rank])")


def different_gradients(name: str, shape: tuple, first_rank: int, differ: list[int], evidence: str) -> str:
    """The error for replicas with equal weights and different gradients: a model without DDP
    given each rank's own data (``evidence``: the values compared)."""
    return (f"replicated parameter {name!r} of shape {shape} has equal weights but a different "
            f"gradient on rank(s) {', '.join(map(str, differ))} than on rank {first_rank} ({evidence}): "
            "a plain tensor under a process group of several ranks is taken as a replica (DDP) and updated "
            "everywhere from its owner rank's result, so each matrix would follow one rank's data alone. For "
            'data-parallel training wrap the model in DDP (muonlab.distributed.parallelize(model, "ddp")), which '
            "averages the gradients before the step; for a model per rank trained on its own data, "
            "give each rank's optimizer process_group=dist.new_group([rank])")


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
    next step using this plan. Only a new plan is checked here (the first step, and a change of
    the layout, the settings or the set of parameters with gradients); gradients that diverge at
    a later step are caught by that step's control exchange (``fingerprints``, see the module
    docstring), which needs no collective of its own. The cost, once per plan: each replica's
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
                raise ValueError(different_weights(spec.name, spec.shape, ranks[0], rank, f"checksums {a} vs {b}"))
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
            raise ValueError(different_gradients(
                spec.name, spec.shape, ranks[0], differ,
                f"gradient checksums {first_grad_sums[k]} vs {theirs[ranks.index(differ[0])]}"))
    return compared
