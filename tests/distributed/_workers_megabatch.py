"""Workers of the megabatch tests: several matrices per owner rank in one all_to_all (or agrs)
batch, on FSDP2 through Muon and on each path by itself with owners chosen by hand.

Every worker returns plain data; the parent computes the single-process reference the same way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from muonlab import Muon
from muonlab.comm.paths import PATHS, PathContext
from muonlab.comm.paths import agrs as agrs_path
from muonlab.comm.paths import all_to_all as all_to_all_path
from muonlab.comm.records import BatchPlan, bytes_for_rank
from muonlab.comm.specs import GroupKey, chunk_sizes
from muonlab.kernels.config import NSConfig
from muonlab.kernels.newton_schulz import newton_schulz

from ._common import full
from ._memory import memory_check

HYPER = dict(lr=0.02, weight_decay=0.01, momentum=0.9)
STEPS = 3


def fsdp_shapes(world: int) -> list[tuple[str, tuple[int, int]]]:
    """(name, shape) of the FSDP2 model. At 4 ranks: 10 rows shard 3, 3, 3, 1; 2 rows 1, 1, 0, 0
    (empty trailing shards); 3 rows 1, 1, 1, 0 and fewer matrices than ranks (a remainder)."""
    shapes = [(f"uneven{i}", (10, 7)) for i in range(5)]
    shapes += [(f"even{i}", (8, 12)) for i in range(6)]
    shapes += [(f"tiny{i}", (2, 6)) for i in range(6)]
    shapes += [(f"short{i}", (3, 5)) for i in range(3)]
    return shapes


def init_tensor(shape, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def grad_for(shape, seed: int, step: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * seed + step))


def single_process(world: int, workspace_bytes: int | None = None, steps: int = STEPS) -> dict[str, torch.Tensor]:
    """The reference: the same parameters and gradients in one process, fp32 throughout."""
    params = [(n, torch.nn.Parameter(init_tensor(s, seed))) for seed, (n, s) in enumerate(fsdp_shapes(world))]
    opt = Muon(params, ns_dtype=torch.float32, workspace_bytes=workspace_bytes, **HYPER)
    for step in range(steps):
        for seed, (_, p) in enumerate(params):
            p.grad = grad_for(p.shape, seed, step)
        opt.step()
    return {n: p.detach().clone() for n, p in params}


def no_waves_profile():
    """The CPU profile with no collective latency: no batch is latency-bound, so none makes a wave
    (muonlab.comm.planner.coalesce) and each shape's megabatch travels alone."""
    from dataclasses import replace

    from muonlab.comm.cost import get_profile

    return replace(get_profile("cpu_gloo"), name="cpu_gloo_no_latency", latency_s=0.0)


def fsdp_run(workspace_bytes: int | None = None, waves: bool = False, steps: int = STEPS) -> dict:
    """Muon on parameters sharded by FSDP2's fully_shard, fp32 on the wire and in Newton-Schulz;
    ``waves``: under the default CPU profile, whose latency makes these small batches one wave."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    torch.set_num_threads(1)
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    module = torch.nn.Module()
    for seed, (name, shape) in enumerate(fsdp_shapes(world)):
        module.register_parameter(name, torch.nn.Parameter(init_tensor(shape, seed)))
    fully_shard(module, mesh=mesh)
    params = list(module.named_parameters())
    opt = Muon(params, ns_dtype=torch.float32, comm_dtype=torch.float32, workspace_bytes=workspace_bytes,
               hardware_profile=None if waves else no_waves_profile(), **HYPER)
    calls = []
    for step in range(steps):
        for seed, (_, p) in enumerate(params):
            p.grad = distribute_tensor(grad_for(p.shape, seed, step), p.device_mesh, p.placements)
        opt.step()
        calls.append(opt.last_step_stats()["calls"])
    stats = opt.last_step_stats()
    plan = opt.plan()
    plan_sent, plan_recv = bytes_for_rank(plan, dist.get_rank())
    return dict(
        params={n: full(p) for n, p in params}, calls=calls, sent=stats["bytes_sent"], recv=stats["bytes_recv"],
        plan_sent=plan_sent, plan_recv=plan_recv, memory=memory_check(opt),
        plan=[(b.path, b.names, b.owners, b.rows, PATHS[b.path].collectives if b.pays_latency else 0,
               b.travels_with) for b in plan],
    )


def fsdp_cases(cases) -> dict:
    """Several Muon runs in one launch: process start-up is the slow part."""
    return {case: fsdp_run(*case) for case in cases}


# ---------------------------------------------------------------- each path with chosen owners


def path_batches(world: int) -> list[BatchPlan]:
    """all_to_all and agrs batches whose owners repeat, empty-shard ranks among them at 4 ranks."""
    g = GroupKey(mesh_ranks=tuple(range(world)), mesh_shape=(world,), axis_name="dp")
    owners = {  # (rows, cols): owners per world size
        (10, 7): {2: (1, 1, 0, 1, 1), 4: (3, 3, 0, 1, 3)},  # rows 3, 3, 3, 1: rank 3 holds one row
        (2, 6): {2: (0, 1, 1), 4: (2, 3, 3, 0)},  # rows 1, 1, 0, 0: ranks 2 and 3 hold none
    }
    batches = []
    for path, module in (("all_to_all", all_to_all_path), ("agrs", agrs_path)):
        for (A, B), by_world in owners.items():
            own = by_world[world]
            rows = chunk_sizes(A, world)
            sent, recv = module.bytes_per_rank(rows, B, own, 4)
            batches.append(BatchPlan(
                index=len(batches), path=path, names=tuple(f"m{i}" for i in range(len(own))),
                param_indices=tuple(range(len(own))), matrix_shape=(A, B), num_matrices=len(own), group=g,
                ns_config=NSConfig(dtype=torch.float32), ranks=tuple(range(world)), owners=own,
                bytes_sent=tuple(sent), bytes_recv=tuple(recv), rows=rows,
                param_shapes=((A, B),) * len(own), comm_itemsize=4))
    return batches


def path_matrices(batch: BatchPlan) -> list[torch.Tensor]:
    return [init_tensor(batch.matrix_shape, 100 * batch.index + i) for i in range(batch.num_matrices)]


def drive(batch: BatchPlan, inputs: list[torch.Tensor], ctx: PathContext):
    """One batch through its path's generator as the engine drives it (out, matrices, back):
    (this rank's outputs, (sent, recv) counted at the calls, collectives issued)."""
    gen = PATHS[batch.path].run(batch, inputs, ctx)
    sent = recv = calls = 0
    out = next(gen)
    sent, recv, calls = sent + out.sent, recv + out.recv, calls + 1
    mats = gen.send(out.wait())
    ortho = newton_schulz(mats, batch.ns_config) if mats is not None else None
    back = gen.send(ortho)
    sent, recv, calls = sent + back.sent, recv + back.recv, calls + 1
    try:
        gen.send(back.wait())
    except StopIteration as done:
        return done.value, (sent, recv), calls
    raise AssertionError(f"path {batch.path} yielded after its way back")


def path_runs() -> list[dict]:
    torch.set_num_threads(1)
    world, me = dist.get_world_size(), dist.get_rank()
    ctx = PathContext(group=None, group_rank=me, wire_dtype=torch.float32)
    results = []
    for batch in path_batches(world):
        offsets = [sum(batch.rows[:q]) for q in range(world)]
        inputs = [m[offsets[me]:offsets[me] + batch.rows[me]].contiguous() for m in path_matrices(batch)]
        outputs, counted, calls = drive(batch, inputs, ctx)
        results.append(dict(outputs=outputs, counted=counted, calls=calls,
                            planned=(batch.bytes_sent[me], batch.bytes_recv[me])))
    return results


def everything(cases) -> dict:
    """Every check of one world size in one launch."""
    return dict(fsdp=fsdp_cases(cases), paths=path_runs())
