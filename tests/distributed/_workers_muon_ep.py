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
from muonlab.models import GPT
from muonlab.models.gpt import moe_config

MODEL_CFG = dict(d_model=16, n_layers=1, n_heads=2, context=8)
HYPER = dict(lr=0.02, weight_decay=0.01, momentum=0.9, adamw_lr=3e-3)
STEPS = 3
BATCH_PER_RANK = 2
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build_model(num_experts: int) -> GPT:
    torch.manual_seed(0)
    return GPT(moe_config(num_experts=num_experts, **MODEL_CFG))


def global_batches(world: int, steps: int = STEPS):
    """Random byte tokens (no corpus): one (inputs, targets) pair of the global batch per step."""
    gen = torch.Generator().manual_seed(11)
    out = []
    for _ in range(steps):
        t = torch.randint(0, 256, (world * BATCH_PER_RANK, MODEL_CFG["context"] + 1), generator=gen)
        out.append((t[:, :-1], t[:, 1:]))
    return out


def _optimizer(model, precision: str) -> Muon:
    dtype = DTYPES[precision]
    return Muon(muon_param_groups(model), ns_dtype=dtype, comm_dtype=dtype, **HYPER)


def single_process(world: int, num_experts: int, precision: str, steps: int = STEPS):
    """The reference: one process, the unsharded model, the whole global batch."""
    model = build_model(num_experts)
    opt = _optimizer(model, precision)
    for x, y in global_batches(world, steps):
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _full_param(p, ep_group) -> torch.Tensor:
    t = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
    if not hasattr(p, "_ep_rank"):
        return t.clone()
    # this EP rank's experts only; EP ranks hold consecutive blocks of the global bank
    out = t.new_empty((p._ep_size * t.shape[0], *t.shape[1:]))
    dist.all_gather_single(out, t.contiguous(), group=ep_group)
    return out


def _group_rank(b, rank: int) -> int:
    """This rank's index in a batch's group: GroupKey.local_ranks maps global -> group-local."""
    return b.group.local_ranks()[rank] if b.group is not None else 0


def _run_case(mesh, ep: int, num_experts: int, precision: str) -> dict:
    from muonlab.distributed import apply_ep

    world, rank = dist.get_world_size(), dist.get_rank()
    model = apply_ep(build_model(num_experts), mesh)
    opt = _optimizer(model, precision)
    mine = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
    for x, y in global_batches(world):
        model(x[mine], y[mine]).backward()
        opt.step()
        opt.zero_grad()
    plan = opt.plan()
    stats = opt.last_step_stats()
    plan_sent, plan_recv, plan_flops = {}, {}, 0
    for b in plan:
        r = _group_rank(b, rank)
        plan_flops += b.flops[r] if b.flops else 0
        if b.bytes_sent:
            plan_sent[b.path] = plan_sent.get(b.path, 0) + b.bytes_sent[r]
            plan_recv[b.path] = plan_recv.get(b.path, 0) + b.bytes_recv[r]
    # the same rank index the other way: the expert axis' own coordinate
    fsdp_rank = mesh["fsdp"].get_local_rank()
    expert_ranks = {b.index: _group_rank(b, rank) for b in plan if b.group is not None and b.group.axis_name == "fsdp"}
    ep_group = mesh.get_group("ep")
    return dict(
        params={n: _full_param(p, ep_group) for n, p in model.named_parameters()},
        plan=[(b.path, b.names, b.owners, b.bytes_sent, b.bytes_recv, b.flops, b.moves) for b in plan],
        groups=[None if b.group is None else (b.group.axis_name, b.group.size) for b in plan],
        sent=stats["bytes_sent"], recv=stats["bytes_recv"], plan_sent=plan_sent, plan_recv=plan_recv,
        plan_flops=plan_flops, expert_group_ranks_agree=all(r == fsdp_rank for r in expert_ranks.values()),
        spans=sorted({s.name for s in opt.last_step_spans()}),
    )


def everything(cases) -> dict:
    """All cases in one launch: {(ep, E, precision): result, or {"error": ValueError text}}."""
    from muonlab.distributed import apply_ep, build_ep_mesh

    torch.set_num_threads(1)
    meshes, results = {}, {}
    for ep, num_experts, precision in cases:
        if ep not in meshes:
            meshes[ep] = build_ep_mesh(ep)
        if num_experts % ep:
            try:
                apply_ep(build_model(num_experts), meshes[ep])
            except ValueError as e:
                results[(ep, num_experts, precision)] = dict(error=str(e))
            else:
                results[(ep, num_experts, precision)] = dict(error=None)
            continue
        results[(ep, num_experts, precision)] = _run_case(meshes[ep], ep, num_experts, precision)
    return results
