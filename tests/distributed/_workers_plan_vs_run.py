"""Worker for tests/distributed/test_plan_vs_run.py (importable by spawned children): calibrate over
the world, then plan_vs_run of a few FSDP2-sharded matrices on every rank."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

SHAPES = [(32, 16), (32, 16), (16, 48)]


def calibrate_and_compare(steps: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from muonlab import Muon, calibrate
    from muonlab.comm.plan_vs_run import plan_vs_run
    from muonlab.trace import StepRecorder

    torch.set_num_threads(1)
    refused = {}
    for key, bad in (("not_a_group", "world"), ("not_a_member", dist.new_group([0]))):
        try:
            calibrate(process_group=bad, steps=1)
        except (TypeError, ValueError) as e:
            refused[key] = f"{type(e).__name__}: {e}"
    profile = calibrate(steps=1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(distribute_tensor(torch.randn(s, generator=gen), mesh, [Shard(0)])) for s in SHAPES]
    opt = Muon(params, lr=1e-3)
    rec = StepRecorder(opt, keep=steps)
    for _ in range(steps):
        for p in params:
            p.grad = distribute_tensor(torch.randn(p.shape, generator=gen), mesh, [Shard(0)])
        opt.step()
    res = plan_vs_run(opt, rec, profile=profile)
    return dict(profile=dataclasses.asdict(profile), rows=res.rows, rank=res.rank, steps=res.steps,
                step_measured_s=res.step_measured_s, step_predicted_s=res.step_predicted_s,
                spans=[dataclasses.asdict(s) for s in rec.spans()], paths=sorted({b.path for b in opt.plan()}),
                refused=refused)
