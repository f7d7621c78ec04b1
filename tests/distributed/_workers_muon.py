"""Worker functions for the distributed Muon tests (importable by spawned children).

Each returns plain data (full tensors, plan rows, byte counts) so the parent compares against a
single-process reference computed the same way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from muonlab import Muon, muon_param_groups
from muonlab.comm.records import bytes_for_rank

from ._memory import memory_check

from ._common import (DTYPES, SMALL_GPT, build_gpt, cloned, full, rank_rows, single_process, token_batches,
                      train_steps)

GPT_CFG = SMALL_GPT
HYPER = dict(lr=0.02, weight_decay=0.01, momentum=0.9)
STEPS = 5


def gpt_batches(world: int, steps: int = STEPS):
    """Global batches of tokens (inputs and targets alike) from a generator seeded 5."""
    return token_batches(5, world, GPT_CFG["context"], steps)


def single_process_gpt(world: int, ns_dtype: torch.dtype, steps: int = STEPS):
    """The reference: one process, the whole global batch."""
    model = build_gpt(**GPT_CFG)
    opt = Muon(muon_param_groups(model), ns_dtype=ns_dtype, **HYPER)
    return single_process(model, opt, [(x, x) for x in gpt_batches(world, steps)])


def _train_gpt(mode: str, precision: str):
    from muonlab.distributed import parallelize

    world, rank = dist.get_world_size(), dist.get_rank()
    dtype = DTYPES[precision]
    model, inner, _ = parallelize(build_gpt(**GPT_CFG), mode)
    opt = Muon(muon_param_groups(inner), ns_dtype=dtype, **HYPER)  # the default wire: ns_dtype's
    train_steps(model, opt, [(rank_rows(x), rank_rows(x)) for x in gpt_batches(world)])
    params = {n: full(p) for n, p in inner.named_parameters()}
    stats = opt.last_step_stats()
    plan_sent, plan_recv = bytes_for_rank(opt.plan(), rank)
    rows = [(b.path, b.names, b.owners, b.bytes_sent, b.flops) for b in opt.plan()]
    assert {b.wire_dtype for b in opt.plan()} == {dtype}, opt.plan()
    return dict(params=params, sent=stats["bytes_sent"], recv=stats["bytes_recv"], plan_sent=plan_sent,
                plan_recv=plan_recv, plan=rows, spans=len(opt.last_step_spans()), memory=memory_check(opt))


def gpt_runs(cases):
    """Several (mode, precision) trainings in one launch: process start-up is the slow part."""
    return {case: _train_gpt(*case) for case in cases}


# ---------------------------------------------------------------- every path, explicit layouts

def path_params(world: int):
    """(name, global shape, placement kind) of a set of parameters that exercises every path."""
    specs = [(f"even{i}", (8, 10), "shard0") for i in range(world + 1)]  # a full batch + a remainder
    specs += [("rows_uneven_a", (6, 10), "shard0"), ("rows_uneven_b", (6, 10), "shard0")]  # 2,2,2,0 on 4
    specs += [("rows_uneven_c", (10, 7), "shard0")]  # 3,3,3,1 on 4; 4,4,2 on 3
    specs += [("experts", (5, 6, 8), "shard0")]  # whole experts: 2,2,1,0 on 4 -> local
    # two banks of 2 large experts: on 4 ranks they sit on ranks 0, 1 only -> rebalance
    specs += [("bank_a", (2, 24, 32), "shard0"), ("bank_b", (2, 24, 32), "shard0")]
    specs += [("cols", (8, 6), "shard1")]  # a column block per rank (2,2,2,0 on 4) -> pieces
    specs += [(f"replicated{i}", (12, 5), "replicate") for i in range(3)]  # plain tensors -> owner
    # fused expert banks (E*M, N): on 4 ranks, 2 experts of 8 rows -> sub-groups of 2 ranks;
    # 8 experts of 3 rows -> 2 whole experts per rank
    specs += [("fused_pair", (16, 8), "shard0"), ("fused_eight", (24, 5), "shard0")]
    if world == 4:
        specs += [("second_mesh", (9, 4), "hsdp")]  # another mesh: 2 x 2, sharded on its 2nd axis
    return specs


FUSED = {"fused_pair": 2, "fused_eight": 8}


def init_tensor(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def grads_for(shape, seed, step):
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * seed + step))


def run_paths(world: int, remainder_path: str, precision: str, workspace_bytes: int | None = None, steps: int = 3):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dtype = DTYPES[precision]
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard")) if world == 4 else None
    placement = {
        "shard0": (mesh, [Shard(0)]), "shard1": (mesh, [Shard(1)]),
        "hsdp": (mesh2, [Replicate(), Shard(0)]),
    }
    params, layouts = [], []
    for seed, (name, shape, kind) in enumerate(path_params(world)):
        whole = init_tensor(shape, seed)
        if kind == "replicate":
            p = torch.nn.Parameter(whole)
        else:
            m, pl = placement[kind]
            p = torch.nn.Parameter(distribute_tensor(whole, m, pl))
        params.append((name, p))
        layouts.append(placement.get(kind))
    # the default wire (comm_dtype="auto"), on every path: each batch travels in ns_dtype
    opt = Muon(params, ns_dtype=dtype, remainder_path=remainder_path, fused_banks=FUSED,
               workspace_bytes=workspace_bytes, **HYPER)
    for step in range(steps):
        for seed, ((name, p), layout) in enumerate(zip(params, layouts)):
            g = grads_for(p.shape, seed, step)
            p.grad = g if layout is None else distribute_tensor(g, *layout)
        opt.step()
    stats = opt.last_step_stats()
    rank = dist.get_rank()
    plan_sent, plan_recv = bytes_for_rank(opt.plan(), rank)
    assert {b.wire_dtype for b in opt.plan()} == {dtype}, opt.plan()
    return dict(
        params={n: full(p) for n, p in params},
        momentum={n: full(opt.state[p]["momentum_buffer"]) for n, p in params if p in opt.state},
        sent=stats["bytes_sent"], recv=stats["bytes_recv"], plan_sent=plan_sent, plan_recv=plan_recv,
        plan=[(b.path, b.names, b.owners, b.bytes_sent, b.flops) for b in opt.plan()],
        parts=[b.part for b in opt.plan()],
        spans=[(s.name, s.path, s.bytes_sent) for s in opt.last_step_spans()],
        memory=memory_check(opt),
    )


def path_runs(world: int, cases):
    return {case: run_paths(world, *case) for case in cases}


def single_process_paths(world: int, precision: str, steps: int = 3):
    dtype = DTYPES[precision]
    params = [(name, torch.nn.Parameter(init_tensor(shape, seed)))
              for seed, (name, shape, _) in enumerate(path_params(world))]
    opt = Muon(params, ns_dtype=dtype, fused_banks=FUSED, **HYPER)
    for step in range(steps):
        for seed, (_, p) in enumerate(params):
            p.grad = grads_for(p.shape, seed, step)
        opt.step()
    return cloned(params)


def nonfinite_case():
    """An inf on the last rank only: every rank skips; with nonfinite="raise" every rank raises."""
    from muonlab.distributed import apply_fsdp, build_mesh

    world, rank = dist.get_world_size(), dist.get_rank()
    model = apply_fsdp(build_gpt(**GPT_CFG), build_mesh())
    out = {}
    for policy in ("skip", "raise"):
        opt = Muon(muon_param_groups(model), nonfinite=policy, **HYPER)
        x = rank_rows(gpt_batches(world, 1)[0])
        model(x, x).backward()
        if rank == world - 1:
            model.blocks[0].mlp.fc.weight.grad.to_local().view(-1)[0] = float("inf")
        before = {n: full(p) for n, p in model.named_parameters()}
        try:
            opt.step()
            out[policy] = opt.last_step_stats()
        except ValueError as e:
            out[policy] = str(e)
        opt.zero_grad()
        out[policy + "_unchanged"] = all(torch.equal(before[n], full(p)) for n, p in model.named_parameters())
        out[policy + "_state"] = len(opt.state)
    return out


def disagree_case():
    """The last rank builds a matrix of another shape: every rank gets a clear error, nothing moves."""
    world, rank = dist.get_world_size(), dist.get_rank()
    w = torch.nn.Parameter(torch.ones(4, 9 if rank == world - 1 else 8))
    b = torch.nn.Parameter(torch.ones(4))
    opt = Muon([{"params": [("w", w)]}, {"params": [("b", b)], "algorithm": "adamw"}])
    w.grad, b.grad = torch.ones_like(w), torch.ones_like(b)
    try:
        opt.step()
        message = None
    except ValueError as e:
        message = str(e)
    return dict(message=message, untouched=bool((w == 1).all() and (b == 1).all()), state=len(opt.state))


def budget_case():
    """Each rank passes its own workspace_bytes: a clear error on every rank, nothing moves. And the
    default budget's basis, a parameter's even share of its bytes, is the same on every rank where
    the shards are not (5 rows on the ranks of the group)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from muonlab.comm.specs import even_share_bytes, local_shard

    world, rank = dist.get_world_size(), dist.get_rank()
    w = torch.nn.Parameter(torch.ones(4, 8))
    opt = Muon([("w", w)], workspace_bytes=2**20 + rank)
    w.grad = torch.ones_like(w)
    try:
        opt.step()
        message = None
    except ValueError as e:
        message = str(e)
    mesh = init_device_mesh("cpu", (world,))
    uneven = distribute_tensor(torch.ones(5, 3), mesh, [Shard(0)])
    shard = local_shard(uneven)
    # a memory_budget one byte short of the plan's peak (its worst rank's): every rank refuses alike
    from muonlab.optim.planning import memory_of

    sharded = [(f"s{i}", torch.nn.Parameter(distribute_tensor(torch.ones(8, 10), mesh, [Shard(0)]))) for i in range(3)]
    short = Muon(sharded, workspace_bytes=2**21)
    need = memory_of(short)
    short.memory_budget = need.peak(need.worst_rank) - 1
    for _, p in sharded:
        p.grad = distribute_tensor(torch.ones(8, 10), mesh, [Shard(0)])
    try:
        short.step()
        refused = None
    except ValueError as e:
        refused = str(e)
    return dict(message=message, untouched=bool((w == 1).all()), state=len(opt.state),
                share=even_share_bytes(uneven), local=shard.numel() * shard.element_size(),
                refused=refused, refused_untouched=all(bool((p.full_tensor() == 1).all()) for _, p in sharded),
                refused_buffers=need.ranks[need.worst_rank].peak, refused_state=len(short.state))


def diverged_case():
    """Plain tensors that are not replicas: each rank's own model, and the same two matrices listed
    in another order on the last rank. Both must be refused, naming the parameter, before any change."""
    world, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    for kind in ("own_model", "reordered"):
        if kind == "own_model":
            params = [("w", torch.nn.Parameter(torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))))]
        else:
            a, b = (torch.nn.Parameter(torch.full((4, 8), float(v))) for v in (1, 2))
            params = [a, b] if rank < world - 1 else [b, a]  # unnamed, another order on one rank
        tensors = [p for _, p in params] if kind == "own_model" else params
        before = [p.detach().clone() for p in tensors]
        opt = Muon(params)
        for p in tensors:
            p.grad = torch.ones_like(p)
        try:
            opt.step()
            out[kind] = None
        except ValueError as e:
            out[kind] = str(e)
        out[kind + "_untouched"] = all(torch.equal(p, q) for p, q in zip(tensors, before)) and not opt.state
    return out


def everything(world: int, gpt_cases, path_cases):
    """All checks of one world size in one launch."""
    return dict(gpt=gpt_runs(gpt_cases), paths=path_runs(world, path_cases),
                nonfinite=nonfinite_case() if world > 1 else None,
                disagree=disagree_case() if world > 1 else None,
                budget=budget_case() if world > 1 else None,
                diverged=diverged_case() if world > 1 else None)
