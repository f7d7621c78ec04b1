"""Worker launching (with progress reported by the workers: report_progress), the device rule (device.py: cuda:LOCAL_RANK with NCCL when CUDA has a GPU per
rank, else gloo on the CPU), named meshes (MeshAxis) and parallelism: apply_fsdp, apply_ddp,
apply_ep, composed by parallelize()."""

import warnings

# `python -m muonlab.distributed.launch` (the torchrun entry point) runs launch.py as __main__
# after this package has imported it; runpy's warning about that is harmless here.
warnings.filterwarnings(
    "ignore",
    message=r".*'muonlab\.distributed\.launch' found in sys\.modules",
    category=RuntimeWarning,
)

from .device import rank_device, to_rank_device  # noqa: E402
from .expert_parallel import apply_ep, build_ep_mesh  # noqa: E402
from .launch import WorkerError, WorkerTimeout, launch, run_worker, shutdown_workers  # noqa: E402
from .mesh import MeshAxis, build_mesh, mesh_axis_group  # noqa: E402
from .parallelize import Parallelized, apply_ddp, apply_fsdp, find_blocks, fsdp_units, parallelize  # noqa: E402
from .progress import report_progress  # noqa: E402

__all__ = [
    "MeshAxis",
    "Parallelized",
    "WorkerError",
    "WorkerTimeout",
    "apply_ddp",
    "apply_ep",
    "apply_fsdp",
    "build_ep_mesh",
    "build_mesh",
    "find_blocks",
    "fsdp_units",
    "launch",
    "mesh_axis_group",
    "parallelize",
    "rank_device",
    "report_progress",
    "run_worker",
    "shutdown_workers",
    "to_rank_device",
]
