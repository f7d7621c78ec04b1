"""Parallelism: the device rule (device.py: cuda:LOCAL_RANK with NCCL when CUDA has a GPU per
rank, else gloo on the CPU), named meshes (MeshAxis) and apply_fsdp, apply_ddp, apply_ep, composed
by parallelize(). Starting worker processes is :mod:`muonlab.launcher`'s (``muonlab.launch``)."""

import importlib

from .device import rank_device, to_rank_device
from .expert_parallel import apply_ep, build_ep_mesh
from .mesh import MeshAxis, build_mesh, mesh_axis_group
from .parallelize import Parallelized, apply_ddp, apply_fsdp, find_blocks, fsdp_units, parallelize

# The launcher's names, as code written before it left this package imports them
# (`from muonlab.distributed import launch`): looked up in muonlab.launcher on first use, so importing
# this package still imports no launcher code. muonlab itself imports them from muonlab.launcher.
_LAUNCHER_NAMES = ("WorkerError", "WorkerTimeout", "launch", "report_progress", "run_worker", "shutdown_workers")


def __getattr__(name):
    if name in _LAUNCHER_NAMES:
        return getattr(importlib.import_module("muonlab.launcher"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "MeshAxis",
    "Parallelized",
    "apply_ddp",
    "apply_ep",
    "apply_fsdp",
    "build_ep_mesh",
    "build_mesh",
    "find_blocks",
    "fsdp_units",
    "mesh_axis_group",
    "parallelize",
    "rank_device",
    "to_rank_device",
]
