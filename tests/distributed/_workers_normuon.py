"""Workers of the NorMuon tests: the same parameters and gradients stepped by Muon with
``update_rule="normuon"`` on FSDP2 row shards (empty trailing shards, a fused bank whose blocks the
shards cut through, a flattened conv kernel), on DDP replicas (the owner path) and on expert banks
sharded by expert, and FSDP2 again with ``normuon_scale="paper"``; plus an FSDP2 checkpoint resumed
on the same ranks.

Every worker returns plain data; the parent steps the same tensors in one process.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from muonlab import Muon

from ._common import full

HYPER = dict(lr=0.02, weight_decay=0.01, momentum=0.9, update_rule="normuon", normuon_beta2=0.9)
STEPS = 3
FUSED = {"qkv": 3}
"""A fused bank of 3 (4, 6) blocks: 12 rows shard 6, 6 at 2 ranks and 3, 3, 3, 3 at 4 (through blocks: the blocks path)."""


def settings_for(kind: str) -> tuple[str, dict]:
    """(layout, Muon's settings) of a case: "fsdp_paper" is "fsdp" with normuon_scale="paper"."""
    if kind == "fsdp_paper":
        return "fsdp", dict(HYPER, normuon_scale="paper")
    return kind, HYPER


def shapes(kind: str) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) per case. At 4 ranks: 10 rows shard 3, 3, 3, 1; 2 rows 1, 1, 0, 0; 6 experts 2, 2, 2, 0."""
    if kind == "ep":
        return [("experts_in", (6, 5, 4)), ("experts_out", (6, 4, 5)), ("few", (2, 3, 3))]
    # "stored": a weight stored (in, out), its neurons are columns: whole on every DDP replica; under
    # FSDP2 its 10 rows shard 5, 5 at 2 ranks and 3, 3, 3, 1 at 4, so its column sums span ranks
    out = [("uneven", (10, 7)), ("wide", (4, 9)), ("tiny", (2, 6)), ("qkv", (12, 6))]
    if kind == "ddp":
        return out + [("stored", (7, 10))]
    return out + [("conv", (6, 2, 3, 3)), ("stored", (10, 7))] if kind in ("fsdp", "hsdp") else out


def init_tensor(shape, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def grad_for(shape, seed: int, step: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * seed + step))


def fused_for(kind: str) -> dict:
    return FUSED if kind != "ep" else {}


def views_for(kind: str) -> dict:
    return {"stored": "transpose"} if kind != "ep" else {}


def single_process(kind: str, steps: int = STEPS) -> dict:
    """The reference: the same tensors in one process, fp32 throughout."""
    kind, hyper = settings_for(kind)
    params = [(n, torch.nn.Parameter(init_tensor(s, seed))) for seed, (n, s) in enumerate(shapes(kind))]
    opt = Muon(params, ns_dtype=torch.float32, fused_banks=fused_for(kind), matrix_views=views_for(kind), **hyper)
    for step in range(steps):
        for seed, (_, p) in enumerate(params):
            p.grad = grad_for(p.shape, seed, step)
        opt.step()
    return dict(params={n: p.detach().clone() for n, p in params},
                variances={n: opt.state[p]["row_variance"].clone() for n, p in params})


def _sharded(kind: str):
    """(named parameters, optimizer) of one case on this rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    world = dist.get_world_size()
    kind, hyper = settings_for(kind)
    module = torch.nn.Module()
    for seed, (name, shape) in enumerate(shapes(kind)):
        module.register_parameter(name, torch.nn.Parameter(init_tensor(shape, seed)))
    if kind == "fsdp":
        fully_shard(module, mesh=init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)))
    elif kind == "hsdp":  # 2 replicas of 2 shards: the norms are summed over the shard axis only
        fully_shard(module, mesh=init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard")))
    elif kind == "ep":  # experts sharded by expert: each rank's matrices are whole
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
        for name, p in list(module.named_parameters()):
            setattr(module, name, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])))
    params = list(module.named_parameters())
    pg = dist.group.WORLD if kind == "ddp" else None
    opt = Muon(params, ns_dtype=torch.float32, comm_dtype=torch.float32, fused_banks=fused_for(kind),
               matrix_views=views_for(kind), process_group=pg, **hyper)
    return module, params, opt


def _set_grads(params, step: int) -> None:
    from torch.distributed.tensor import distribute_tensor

    for seed, (_, p) in enumerate(params):
        g = grad_for(p.shape, seed, step)
        p.grad = distribute_tensor(g, p.device_mesh, p.placements) if hasattr(p, "device_mesh") else g


def run(kind: str) -> dict:
    torch.set_num_threads(1)
    module, params, opt = _sharded(kind)
    for step in range(STEPS):
        _set_grads(params, step)
        opt.step()
    stats = opt.last_step_stats()
    calls = stats["calls"]
    # what the plan says the norms' all-reduce moves (a ring: 2 (W - 1) / W of its fp32 bytes, as counted)
    planned = sum(2 * (b.group.size - 1) * 4 * b.rule_sums // b.group.size for b in opt.plan() if b.rule_sums)
    if kind == "ddp":
        opt.consolidate_state()
    result = dict(calls=calls, params={n: full(p) for n, p in params}, planned_rule_bytes=planned,
                  counted_rule_bytes=stats["bytes_sent"].get("normuon", 0),
                  variances={n: full(opt.state[p]["row_variance"]) for n, p in params},
                  layouts=sorted({(b.path, b.names) for b in opt.plan()}))
    if kind == "ddp":
        opt.release_unowned_state()
    return result


def resume(path: str) -> dict:
    """FSDP2: 2 steps, save, a 3rd step; a fresh model and optimizer load the save and take the
    same 3rd step: both must end bit for bit alike."""
    from muonlab import checkpoint

    torch.set_num_threads(1)
    module, params, opt = _sharded("fsdp")
    for step in range(2):
        _set_grads(params, step)
        opt.step()
    checkpoint.save(path, module, opt, 2)
    _set_grads(params, 2)
    opt.step()
    straight = {n: full(p) for n, p in params}
    straight_var = {n: full(opt.state[p]["row_variance"]) for n, p in params}
    module2, params2, opt2 = _sharded("fsdp")
    checkpoint.load(path, module2, opt2)
    _set_grads(params2, 2)
    opt2.step()
    return dict(straight=straight, straight_var=straight_var,
                resumed={n: full(p) for n, p in params2},
                resumed_var={n: full(opt2.state[p]["row_variance"]) for n, p in params2})


def everything(ckpt_root: str) -> dict:
    """Every case in one launch (process start-up is the slow part)."""
    kinds = ("fsdp", "fsdp_paper", "ddp", "ep") + (("hsdp",) if dist.get_world_size() == 4 else ())
    out = {kind: run(kind) for kind in kinds}
    path = os.path.join(ckpt_root, f"world{dist.get_world_size()}")
    out["resume"] = resume(path)
    return out
