"""Which device and backend a rank uses: the one rule every worker entry point follows.

The rule (:func:`choose_device`): with CUDA available and a GPU for every local rank, rank ``r`` of a
node computes on ``cuda:LOCAL_RANK`` and the default process group is NCCL; otherwise the rank
computes on the CPU over gloo, as on the CPU machines this project is built on. An explicit choice,
the ``device`` argument of :func:`muonlab.launcher.launch` (``"cpu"``, ``"cuda"`` or ``"auto"``)
or else the environment variable ``MUONLAB_DEVICE``, overrides the automatic one, so a researcher on
a GPU node can still run CPU/gloo workers (and the CPU test suite stays on gloo there).

Once the default group is up, :func:`rank_device` is the device of this rank's model and batches,
read from the group itself (so a group that a user initialised under torchrun answers the same);
:func:`to_rank_device` moves a model there before any wrapper (``parallelize`` calls it), and
:func:`collective_device` says where a small tensor for a collective on a given group must live.

No extra gloo group is kept beside NCCL: the CPU objects muonlab sends (``all_gather_object`` of the
Muon plan check, ``gather_object`` of spans) are pickled into tensors on ``torch.cuda.current_device()``
by torch, which :func:`init_process_group` sets to this rank's GPU; the only CPU-built tensor sent
(Muon's non-finite flags) is placed with :func:`collective_device`.
"""

from __future__ import annotations

import os
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

from .._base import collective_device, dist_on  # noqa: F401 (collective_device: named here by callers)

__all__ = [
    "DEVICE_CHOICES",
    "DEVICE_ENV",
    "backend_for",
    "check_backend",
    "choose_device",
    "collective_device",
    "group_device",
    "init_process_group",
    "match_default_timeout",
    "rank_device",
    "to_rank_device",
    "wait_for",
]

DEVICE_ENV = "MUONLAB_DEVICE"
"""Environment variable read when no ``device`` is passed: "auto", "cpu" or "cuda"."""
DEVICE_CHOICES = ("auto", "cpu", "cuda")


def requested_device(device: str | None = None) -> str:
    """``device`` if given, else ``$MUONLAB_DEVICE``, else "auto"; checked against DEVICE_CHOICES."""
    source = "device"
    if device is None:
        device, source = os.environ.get(DEVICE_ENV) or "auto", f"${DEVICE_ENV}"
    choice = str(device).strip().lower()
    if choice not in DEVICE_CHOICES:
        raise ValueError(f"{source} must be one of {DEVICE_CHOICES}, got {device!r}")
    return choice


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


def choose_device(
    device: str | None = None, *, local_rank: int | None = None, local_world_size: int | None = None
) -> torch.device:
    """The device of local rank ``local_rank`` of ``local_world_size`` ranks on this node.

    ``local_rank`` and ``local_world_size`` default to the launcher's ``LOCAL_RANK`` and
    ``LOCAL_WORLD_SIZE`` (0 and 1 outside a launcher). ``device`` (else ``$MUONLAB_DEVICE``):

    * "auto" (the default): ``cuda:LOCAL_RANK`` when CUDA has at least one GPU per local rank, else
      the CPU (with a warning when CUDA is there but has too few GPUs);
    * "cpu": the CPU, whatever the machine has;
    * "cuda": ``cuda:LOCAL_RANK``; a clear error if CUDA is missing or has too few GPUs.
    """
    choice = requested_device(device)
    local_rank = _env_int("LOCAL_RANK", 0) if local_rank is None else local_rank
    local_world_size = _env_int("LOCAL_WORLD_SIZE", 1) if local_world_size is None else local_world_size
    if choice == "cpu":
        return torch.device("cpu")
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    enough = num_gpus >= max(local_world_size, local_rank + 1)
    if choice == "auto":
        if enough:
            return torch.device("cuda", local_rank)
        if num_gpus:
            warnings.warn(
                f"{local_world_size} ranks on this node but {num_gpus} CUDA device(s): one GPU per rank "
                f"is the rule, so local rank {local_rank} runs on the CPU over gloo (pass device='cpu' "
                f"to say so, or use at most {num_gpus} ranks per node for the GPUs)",
                RuntimeWarning, stacklevel=2,
            )
        return torch.device("cpu")
    if not num_gpus:
        raise RuntimeError(f"local rank {local_rank}: device 'cuda' was asked for, but CUDA is not available "
                           f"in this process (torch {torch.__version__}); use device='cpu' for gloo workers")
    if not enough:
        raise ValueError(f"local rank {local_rank} of {local_world_size} on this node: device 'cuda' needs one "
                         f"GPU per rank, but CUDA has {num_gpus}; use at most {num_gpus} ranks per node, or "
                         f"device='cpu'")
    return torch.device("cuda", local_rank)


def backend_for(device: torch.device | str) -> str:
    """The default process group's backend for ranks on ``device``: NCCL on CUDA, else gloo."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def check_backend(device: torch.device | str, backend: str | None, rank: int | str = "?") -> str:
    """``backend`` (None: :func:`backend_for` ``device``), refused if it cannot carry the device's
    tensors (NCCL for a CPU rank)."""
    device = torch.device(device)
    backend = backend or backend_for(device)
    if "nccl" in backend and device.type != "cuda":
        raise ValueError(f"rank {rank}: backend {backend!r} needs a CUDA device, but this rank's device is "
                         f"{device}; use backend='gloo', or device='cuda' on a node with a GPU per rank")
    return backend


def init_process_group(
    device: str | None = None,
    backend: str | None = None,
    *,
    timeout_s: float = 1800,
    connect_timeout_s: float | None = None,
) -> torch.device:
    """Initialise the default process group from the environment (env://) by the rule; return
    this rank's device.

    CUDA ranks get ``torch.cuda.set_device(cuda:LOCAL_RANK)`` and NCCL bound to that device; CPU
    ranks get gloo and one intra-op thread (several workers share the cores). ``backend``
    overrides the backend only: a CUDA rank over gloo still has the group bound to its GPU, so
    :func:`rank_device` puts its model and batches there (NCCL on a CPU rank is refused: it cannot
    carry CPU tensors).
    Connecting may take ``connect_timeout_s`` (the slowest rank's start-up); collectives get
    ``timeout_s`` from then on.
    """
    chosen = choose_device(device)
    backend = check_backend(chosen, backend, os.environ.get("RANK", "?"))
    timeout = timedelta(seconds=timeout_s)
    connect_timeout = timedelta(seconds=max(timeout_s, connect_timeout_s or 0))
    if chosen.type == "cuda":
        torch.cuda.set_device(chosen)
        dist.init_process_group(backend, timeout=connect_timeout, device_id=chosen)
    else:
        torch.set_num_threads(1)
        dist.init_process_group(backend, timeout=connect_timeout)
    if connect_timeout != timeout:
        dist.distributed_c10d._set_pg_timeout(timeout)
    return chosen


def _uses_cuda(backend: str) -> bool:
    # "nccl", or a per-device backend string such as "cpu:gloo,cuda:nccl"
    return "nccl" in str(backend)


def group_device(backend: str, bound_device: torch.device | None, cuda_available: bool,
                 current_cuda: int | None) -> torch.device:
    """The rule behind :func:`rank_device`, on plain values so it is testable without a GPU.

    ``bound_device``: the device the default group was initialised for (``init_process_group``'s
    ``device_id``, which :func:`init_process_group` passes for every CUDA rank, whatever the backend);
    it wins, so ``launch(device="cuda", backend="gloo")`` computes on the GPU it asked for (the
    backend overrides the backend only). Without one: this rank's current CUDA device
    (``current_cuda``) under NCCL, else the CPU (a gloo group started for CPU workers on a GPU node).
    """
    if bound_device is not None and torch.device(bound_device).type == "cuda":
        return torch.device(bound_device)
    if _uses_cuda(backend) and cuda_available:
        return torch.device("cuda", current_cuda)
    return torch.device("cpu")


def rank_device() -> torch.device:
    """The device of this rank's model and batches.

    In a process group, read from the default group (:func:`group_device`): the CUDA device it was
    bound to (every CUDA rank of :func:`init_process_group`, NCCL or gloo), else this rank's current
    CUDA device when the group is NCCL, else the CPU (a gloo group on a GPU node that was not asked
    for CUDA wants CPU tensors). Outside one: :func:`choose_device`.
    """
    if dist_on():
        cuda_available = torch.cuda.is_available()
        return group_device(str(dist.get_backend()), getattr(_default_group(), "bound_device_id", None),
                            cuda_available, torch.cuda.current_device() if cuda_available else None)
    return choose_device()


def _default_group():
    return dist.distributed_c10d._get_default_group()


def _group_timeout(group) -> timedelta | None:
    # torch keeps a group's collective timeout in each of its backends' options; no public getter
    for device_type in getattr(group, "_device_types", ()):
        timeout = getattr(getattr(group._get_backend(device_type), "options", None), "_timeout", None)
        if isinstance(timeout, timedelta):
            return timeout
    return None


def match_default_timeout(mesh):
    """Give every dimension group of the DeviceMesh ``mesh`` the default group's collective timeout;
    return ``mesh``.

    ``init_device_mesh`` creates its sub-groups with torch's default timeout (30 min on gloo, 10 on
    NCCL), not the one :func:`init_process_group` gave the default group (``timeout_s``), so a stuck
    expert all-to-all or HSDP all-reduce would outwait the caller's limit. Called wherever muonlab
    builds a mesh (``build_mesh``, ``build_ep_mesh``, ``apply_ep``). A group whose timeout torch
    does not expose (a backend other than gloo or NCCL) is left as it is, and so is every group when
    the default group's is not exposed.
    """
    timeout = _group_timeout(_default_group())
    if timeout is None:
        return mesh
    for dim in range(mesh.ndim):
        group = mesh.get_group(dim)
        current = _group_timeout(group)
        if current is not None and current != timeout:
            dist.distributed_c10d._set_pg_timeout(timeout, group)
    return mesh


def wait_for(device: torch.device) -> None:
    """On a GPU, until the work queued on ``device`` so far has run (a host clock around
    asynchronous kernels times their launches); on a CPU nothing."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def to_rank_device(model: nn.Module) -> nn.Module:
    """Move ``model`` to :func:`rank_device` if it sits on the CPU; return it.

    A wrapper needs the model on the rank's device first (DDP over NCCL fails with "No backend type
    associated with device type cpu"). A model with meta tensors (deferred initialisation) or
    already on a GPU is left where its owner put it.
    """
    device = rank_device()
    if device.type == "cpu":
        return model
    tensors = [*model.parameters(), *model.buffers()]
    if any(t.is_meta for t in tensors) or not any(t.device.type == "cpu" for t in tensors):
        return model
    return model.to(device)
