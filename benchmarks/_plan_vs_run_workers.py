"""Measuring work for bench_plan_vs_run.py (a module of its own so spawned workers import it)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _dist_workers import gpt_matrix_shapes  # noqa: E402
from _sets import small48_matrices  # noqa: E402

SETS = ("gpt", "small48")


def set_shapes(name: str) -> list[tuple[str, tuple[int, int]]]:
    """gpt: the 16 hidden matrices of the 4-layer, width-256 GPT (bench_distributed's); small48: the
    48 of the width-8 GPT (benchmarks/_sets.py)."""
    return gpt_matrix_shapes() if name == "gpt" else small48_matrices()


def measure(set_name: str, device: torch.device, profiles: dict, steps: int, warmup: int, mesh=None) -> dict:
    """Muon (defaults) on the set's matrices (FSDP2-style Shard(0) DTensors over ``mesh``, else plain
    tensors), ``warmup`` steps then ``steps`` recorded ones; per profile name, plan_vs_run on this
    rank: {"rows", "step_predicted_s", "step_measured_s", "source"}, and the plan's paths."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from muonlab import Muon
    from muonlab.comm.plan_vs_run import plan_vs_run
    from muonlab.trace import StepRecorder

    gen = torch.Generator().manual_seed(0)
    params = []
    for name, shape in set_shapes(set_name):
        full = torch.randn(shape, generator=gen).to(device)  # drawn on the CPU: the same on every device
        if mesh is not None:
            full = distribute_tensor(full, mesh, [Shard(0)])
        params.append(torch.nn.Parameter(full))
    opt = Muon(params, lr=1e-3)
    rec = StepRecorder(opt, keep=steps)
    for step in range(warmup + steps):
        for p in params:
            g = torch.randn(p.shape, generator=gen).to(device)
            p.grad = distribute_tensor(g, mesh, [Shard(0)]) if mesh is not None else g
        opt.step()
    out = dict(paths=sorted({b.path for b in opt.plan()}), profiles={})
    for label, profile in profiles.items():
        r = plan_vs_run(opt, rec, profile=profile)
        figures = (f"latency {1e6 * profile.latency_s:.0f} us, links {profile.intra_bw / 1e9:.2f} GB/s, host per call "
                   f"{1e6 * profile.host_s_per_call:.0f} us, elementwise {profile.mem_bw / 1e9:.1f} GB/s, Newton-Schulz "
                   + (", ".join(f"{d} {c} {r / 1e9:.1f}" for d, c, r in profile.matmul_rates) or
                      f"{profile.matmul_flops / 1e9:.0f}") + " GFLOP/s, host per batch + per matrix "
                   + (", ".join(f"{p} {1e6 * a:.0f}+{1e6 * b:.0f} us" for p, a, b in profile.host_s) or "none"))
        out["profiles"][label] = dict(rows=r.rows, step_predicted_s=r.step_predicted_s,
                                      step_measured_s=r.step_measured_s, source=f"{profile.source} ({figures})",
                                      rank=r.rank)
    return out


def single_device(device: str, sets: list[str], steps: int, warmup: int, threads: int) -> dict:
    """Every set on one device, under the shipped profile of its kind and a calibrated one."""
    from muonlab.calibration import calibrate
    from muonlab.comm.cost import PROFILES

    torch.set_num_threads(threads)
    dev = torch.device(device)
    shipped = PROFILES["h100_node" if dev.type == "cuda" else "cpu_gloo"]
    profiles = {shipped.name: shipped, "calibrated": calibrate(device=dev)}
    return {s: measure(s, dev, profiles, steps, warmup) for s in sets}


def gloo_worker(sets: list[str], steps: int, warmup: int) -> dict:
    """On each rank of a gloo launch: calibrate over the world, then every set as FSDP2 shards."""
    from torch.distributed.device_mesh import init_device_mesh

    from muonlab.calibration import calibrate
    from muonlab.comm.cost import PROFILES
    from muonlab.distributed import MeshAxis

    torch.set_num_threads(1)
    dev = torch.device("cpu")
    profiles = {"cpu_gloo": PROFILES["cpu_gloo"], "calibrated": calibrate()}
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=(MeshAxis.DP.value,))
    return {s: measure(s, dev, profiles, steps, warmup, mesh) for s in sets}
