"""Worker functions for bench_host_work.py (a module of its own so spawned workers import it).

Steady steps of each optimizer are counted, not timed: Python function calls (``sys.setprofile``
"call" events: functions written in Python, in muonlab, torch's Python layers and the peers alike)
and aten ops (every op a ``TorchDispatchMode`` sees). Both are the same on any machine of a kind,
so they measure the host work a step does whatever the machine's load.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import muonlab
from muonlab import Muon
from muonlab.distributed import MeshAxis

from _peers_workers import EPS, LR, MOMENTUM, _import_peer, keller_ns

# GPT-2-small's hidden matrices at 1/8 scale (width 96): per layer qkv, attention out, MLP in, MLP out
PER_LAYER = (("attn.qkv", (288, 96)), ("attn.proj", (96, 96)), ("mlp.fc", (384, 96)), ("mlp.out", (96, 384)))
MUONLAB_KINDS = {
    "muonlab": {},
    "muonlab-device": dict(nonfinite_decision="device"),
    "muonlab-offload": dict(state_offload="cpu"),
    "muonlab-normuon": dict(update_rule="normuon"),
}
# on CUDA only: the whole step captured in one CUDA graph after its first step (lr a device tensor)
CUDA_KINDS = {"muonlab-captured": dict(capture_after=1, nonfinite_decision="device")}  # a captured step decides a skip on the device
KINDS = [*MUONLAB_KINDS, *CUDA_KINDS, "torch", "dion"]
WARMUP = 3


def shapes(num_matrices: int) -> list[tuple[str, tuple[int, int]]]:
    layers = num_matrices // len(PER_LAYER)
    return [(f"blocks.{i}.{n}", s) for i in range(layers) for n, s in PER_LAYER]


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


PACKAGE = str(Path(muonlab.__file__).resolve().parent) + os.sep


def count_step(step: Callable[[], None]) -> tuple[int, int, int, int]:
    """(Python calls, aten ops, muonlab files, muonlab/kernels files) of a step: two calls of
    ``step``, one counted by each, since a dispatch mode runs Python for every op it sees and would
    inflate the calls. The files are the modules of muonlab whose functions the step called (its
    walk; issue 40's goal: at most 12, and a Newton-Schulz call within 3 of kernels/)."""
    calls = 0
    files = set()

    def profile(frame, event, arg):
        nonlocal calls
        if event == "call":
            calls += 1
            files.add(frame.f_code.co_filename)

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    mode = _CountOps()
    with mode:
        step()
    walk = [f.removeprefix(PACKAGE) for f in files if f.startswith(PACKAGE)]
    return calls, mode.ops, len(walk), sum(f.startswith("kernels" + os.sep) for f in walk)


def _optimizer(kind: str, named: list[tuple[str, torch.nn.Parameter]], mesh):
    if kind in MUONLAB_KINDS:
        return Muon(named, lr=LR, momentum=MOMENTUM, eps=EPS, **MUONLAB_KINDS[kind])
    if kind in CUDA_KINDS:
        lr = torch.tensor(LR, device=named[0][1].device)
        return Muon(named, lr=lr, momentum=MOMENTUM, eps=EPS, **CUDA_KINDS[kind])
    params = [p for _, p in named]
    if kind == "torch":
        return torch.optim.Muon(params, lr=LR, momentum=MOMENTUM, eps=EPS)
    cls = _import_peer("dion")
    if cls is None:
        return None
    return cls(params, distributed_mesh=mesh, lr=LR, mu=MOMENTUM, weight_decay=0.0, epsilon=EPS, nesterov=True,
               adjust_lr="rms_norm", newton_schulz_func=keller_ns, use_polar_express=False)


def host_work_worker(kinds: list[str], sizes: list[int], device: str = "cpu") -> dict:
    """Per kind and number of matrices, rank 0's (Python calls, aten ops) in a steady step after
    ``WARMUP`` steps. One process: plain tensors on ``device``; several: FSDP2-style Shard(0)
    DTensors on a 1-D gloo mesh (torch.optim.Muon, single-device, only in one process). The
    CUDA-only kinds are left out elsewhere."""
    torch.set_num_threads(1)
    # Dion decorates its math with torch.compile(fullgraph=True): eager here, like muonlab
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    torch._dynamo.config.disable = True
    world = dist.get_world_size() if dist.is_initialized() else 1
    mesh = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=(MeshAxis.DP.value,))
    out: dict = {}
    for kind in kinds:
        if (kind == "torch" and world > 1) or (kind in CUDA_KINDS and device != "cuda"):
            continue
        for n in sizes:
            named, grads = [], []
            for seed, (name, shape) in enumerate(shapes(n)):
                gen = torch.Generator().manual_seed(seed)
                full, grad = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
                full, grad = full.to(device), grad.to(device)
                if mesh is not None:
                    from torch.distributed.tensor import Shard, distribute_tensor
                    full, grad = distribute_tensor(full, mesh, [Shard(0)]), distribute_tensor(grad, mesh, [Shard(0)])
                named.append((name, torch.nn.Parameter(full)))
                grads.append(grad)
            opt = _optimizer(kind, named, mesh)
            if opt is None:
                break
            for (_, p), g in zip(named, grads):
                p.grad = g
            for _ in range(WARMUP):
                opt.step()
            if device == "cuda":
                torch.cuda.synchronize()
            if mesh is not None:
                dist.barrier()
            # with the Newton-Schulz backends the step ran (muonlab's "auto" times them per batch:
            # on CUDA a Triton launch is Python work of its own)
            ran = sorted({c["backend"] for c in opt.resolved_choices()}) if hasattr(opt, "resolved_choices") else []
            out[(kind, n)] = (*count_step(opt.step), "+".join(ran))
            if mesh is not None:
                dist.barrier()
    return out
