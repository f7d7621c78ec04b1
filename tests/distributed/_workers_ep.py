"""Worker functions for the expert-parallel tests (importable by spawned children).

Each case builds the MoE GPT from seed 0 on every rank, applies ``apply_ep``, runs one forward and
backward on this rank's slice of the global batch, and returns the global loss and every
parameter's full gradient (expert banks gathered back to (E, ...) over the "ep" axis). The parent
compares them with :func:`single_process` on the whole batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from muonlab.models import GPT
from muonlab.models.gpt import MoE

from ._common import SMALL_MOE, build_moe_gpt, cloned, full_ep, rank_rows, token_batches

MODEL_CFG = SMALL_MOE
DEAD_BIAS = -1e4


def dead_experts(num_experts: int, ep: int) -> list[int]:
    """Experts the 'starved' case switches off: all of the last EP rank's, and expert 1."""
    num_local = num_experts // ep
    return sorted({1} | set(range(num_experts - num_local, num_experts)))


def build_model(num_experts: int, starved: bool, ep: int) -> GPT:
    """The MoE GPT from seed 0; ``starved`` gives the routers a bias that no token survives."""
    model = build_moe_gpt(num_experts, **MODEL_CFG)
    if starved:
        for moe in (m for m in model.modules() if isinstance(m, MoE)):
            router = nn.Linear(moe.router.in_features, num_experts, bias=True)
            with torch.no_grad():
                router.weight.copy_(moe.router.weight)
                router.bias.zero_()
                router.bias[dead_experts(num_experts, ep)] = DEAD_BIAS
            moe.router = router
    return model


def global_batch(world: int) -> torch.Tensor:
    """The global batch (inputs and targets alike) from a generator seeded 7."""
    return token_batches(7, world, MODEL_CFG["context"])[0]


def single_process(world: int, num_experts: int, starved: bool = False, ep: int = 1):
    """The reference: one process, the whole global batch."""
    model = build_model(num_experts, starved, ep)
    x = global_batch(world)
    loss = model(x, x)
    loss.backward()
    return float(loss.detach()), cloned((n, p.grad) for n, p in model.named_parameters())


def _run_case(mesh, ep: int, num_experts: int, starved: bool):
    from muonlab.distributed.expert_parallel import apply_ep

    world, rank = dist.get_world_size(), dist.get_rank()
    model = apply_ep(build_model(num_experts, starved, ep), mesh)
    x = rank_rows(global_batch(world), rank)
    loss = model(x, x)
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    ep_group = mesh.get_group("ep")
    banks = {}
    for n, p in model.named_parameters():
        if hasattr(p, "_ep_rank"):
            banks[n] = dict(
                ep_rank=p._ep_rank, ep_size=p._ep_size, num_global=p._num_global_experts,
                global_experts=list(p._global_experts), global_shape=tuple(p.shape),
                local_shape=tuple(p.to_local().shape), mesh_dims=p.device_mesh.mesh_dim_names,
                placements=repr(p.placements),
            )
    return dict(
        loss=float(total) / world,
        grads={n: full_ep(p.grad, p, ep_group) for n, p in model.named_parameters()},
        banks=banks,
    )


def _error(fn, *args):
    try:
        fn(*args)
    except ValueError as e:
        return str(e)
    return None


def everything(cases, bad_meshes, bad_experts):
    """All cases in one launch: {(ep, E, starved): result}, plus the ValueErrors seen."""
    from torch.distributed.device_mesh import init_device_mesh

    from muonlab.distributed.expert_parallel import apply_ep, build_ep_mesh

    meshes = {}
    results = {}
    for ep, num_experts, starved in cases:
        if ep not in meshes:
            meshes[ep] = build_ep_mesh(ep)
        results[(ep, num_experts, starved)] = _run_case(meshes[ep], ep, num_experts, starved)

    mesh_errors = {args: _error(build_ep_mesh, *args) for args in bad_meshes}
    flat = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    mesh_errors["1-D"] = _error(apply_ep, build_model(4, False, 1), flat)
    expert_errors = {}
    for ep, num_experts in bad_experts:
        model = build_model(num_experts, False, ep)
        before = cloned(model.named_parameters())
        msg = _error(apply_ep, model, meshes.get(ep) or build_ep_mesh(ep))
        unchanged = all(
            type(p) is nn.Parameter and torch.equal(p.detach(), before[n])
            for n, p in model.named_parameters()
        ) and [n for n, _ in model.named_parameters()] == list(before)
        unchanged = unchanged and all(m.dispatcher is None for m in model.modules() if isinstance(m, MoE))
        expert_errors[(ep, num_experts)] = (msg, unchanged)
    return dict(cases=results, mesh_errors=mesh_errors, expert_errors=expert_errors,
                mesh_ranks={ep: m.mesh.tolist() for ep, m in meshes.items()},
                coords={ep: (m.get_local_rank("fsdp"), m.get_local_rank("ep")) for ep, m in meshes.items()})
