"""Worker functions for the Muon-on-expert-parallel tests (importable by spawned children).

Every case builds the MoE GPT from seed 0 on every rank, applies ``apply_ep`` on a
``build_ep_mesh(ep)`` mesh, trains ``STEPS`` steps of Muon on this rank's slice of each global
batch, and returns plain data: every parameter in full (expert banks gathered back into global
(E, ...) banks over the "ep" axis), the plan as rows, the bytes measured at the collectives and
the bytes the plan gives this rank. The parent compares with :func:`single_process`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from muonlab import Muon, muon_param_groups
from muonlab.comm.records import bytes_for_rank
from muonlab.models import GPT

from ._common import (DTYPES, SMALL_MOE, build_moe_gpt, full_ep, group_rank, rank_rows,
                      shifted, single_process as _single_process, token_batches, train_steps)
from ._memory import memory_check

MODEL_CFG = SMALL_MOE
HYPER = dict(lr=0.02, weight_decay=0.01, momentum=0.9, adamw_lr=3e-3)
STEPS = 3


def build_model(num_experts: int) -> GPT:
    return build_moe_gpt(num_experts, **MODEL_CFG)


def global_batches(world: int, steps: int = STEPS):
    """Random byte tokens (no corpus): one (inputs, targets) pair of the global batch per step."""
    return [shifted(t) for t in token_batches(11, world, MODEL_CFG["context"] + 1, steps)]


PARTS = "fp32-parts"
"""A precision tag: fp32, with a workspace budget of one expert matrix per batch, so that every
expert bank is cut into parts (``BatchPlan.part``), one matrix per rank each."""


NORMUON, NORMUON_PARTS = "normuon", "normuon-parts"
"""fp32 with NorMuon's update rule (muonlab.optim.rules.normuon); the second with PARTS' budget."""


def _optimizer(model, precision: str) -> Muon:
    dtype = DTYPES[precision if precision in DTYPES else "fp32"]
    budget = dict(workspace_bytes=1) if precision in (PARTS, NORMUON_PARTS) else {}
    rule = dict(update_rule="normuon") if precision in (NORMUON, NORMUON_PARTS) else {}
    return Muon(muon_param_groups(model), ns_dtype=dtype, comm_dtype=dtype, **HYPER, **budget, **rule)


def single_process(world: int, num_experts: int, precision: str, steps: int = STEPS):
    """The reference: one process, the unsharded model, the whole global batch."""
    model = build_model(num_experts)
    return _single_process(model, _optimizer(model, precision), global_batches(world, steps))


def _run_case(mesh, ep: int, num_experts: int, precision: str) -> dict:
    from muonlab.distributed import apply_ep

    world, rank = dist.get_world_size(), dist.get_rank()
    model = apply_ep(build_model(num_experts), mesh)
    opt = _optimizer(model, precision)
    train_steps(model, opt, [(rank_rows(x), rank_rows(y)) for x, y in global_batches(world)])
    plan = opt.plan()
    stats = opt.last_step_stats()
    plan_sent, plan_recv = bytes_for_rank(plan, rank)
    plan_flops = sum(b.flops[group_rank(b, rank)] if b.flops else 0 for b in plan)
    # the same rank index the other way: the expert axis' own coordinate
    fsdp_rank = mesh["fsdp"].get_local_rank()
    expert_ranks = {b.index: group_rank(b, rank) for b in plan if b.group is not None and b.group.axis_name == "fsdp"}
    ep_group = mesh.get_group("ep")
    return dict(
        params={n: full_ep(p, p, ep_group) for n, p in model.named_parameters()},
        plan=[(b.path, b.names, b.owners, b.bytes_sent, b.bytes_recv, b.flops, b.moves, b.part) for b in plan],
        groups=[None if b.group is None else (b.group.axis_name, b.group.size) for b in plan],
        sent=stats["bytes_sent"], recv=stats["bytes_recv"], plan_sent=plan_sent, plan_recv=plan_recv,
        plan_flops=plan_flops, expert_group_ranks_agree=all(r == fsdp_rank for r in expert_ranks.values()),
        spans=sorted({s.name for s in opt.last_step_spans()}), memory=memory_check(opt),
    )


def everything(cases) -> dict:
    """All cases in one launch: {(ep, E, precision): result, or {"error": ValueError text}}."""
    from muonlab.distributed import apply_ep, build_ep_mesh

    torch.set_num_threads(1)
    meshes, results = {}, {}
    for ep, num_experts, precision in cases:
        if ep not in meshes:
            meshes[ep] = build_ep_mesh(ep)
        if num_experts % ep or not num_experts:  # refused by apply_ep (0 experts: the dense GPT)
            try:
                apply_ep(build_model(num_experts), meshes[ep])
            except ValueError as e:
                results[(ep, num_experts, precision)] = dict(error=str(e))
            else:
                results[(ep, num_experts, precision)] = dict(error=None)
            continue
        results[(ep, num_experts, precision)] = _run_case(meshes[ep], ep, num_experts, precision)
    return results
