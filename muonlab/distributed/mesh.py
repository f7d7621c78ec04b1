"""Device meshes with named axes over the default process group.

A 1-D mesh has the axis "dp" (plain FSDP or DDP); a 2-D mesh has the axes ("replicate", "shard")
(HSDP: FSDP within a shard group, replicas across). Code asks for an axis by name through
:func:`mesh_axis_group`, never by position.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["DP_AXIS", "REPLICATE_AXIS", "SHARD_AXIS", "build_mesh", "mesh_axis_group"]

DP_AXIS = "dp"
REPLICATE_AXIS = "replicate"
SHARD_AXIS = "shard"


def _default_device_type() -> str:
    # A gloo group on a GPU machine still wants CPU tensors, so look at the backend too.
    if torch.cuda.is_available() and "nccl" in str(dist.get_backend()):
        return "cuda"
    return "cpu"


def _check_size(name: str, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def build_mesh(
    dp: int | None = None,
    *,
    replicate: int = 1,
    shard: int | None = None,
    device_type: str | None = None,
) -> DeviceMesh:
    """Build a mesh over all ranks of the default process group.

    ``build_mesh()`` or ``build_mesh(dp=world_size)``: 1-D, axis "dp".
    ``build_mesh(replicate=R, shard=S)``: 2-D (R x S), axes ("replicate", "shard"); ranks that
    differ only in their shard coordinate are consecutive. ``shard`` defaults to
    ``world_size // replicate``.

    ``device_type``: default "cuda" when CUDA is available and the default group uses NCCL,
    else "cpu". Every rank must call this with the same arguments (it creates process groups).

    Raises:
        ValueError: sizes that are not positive ints, ``dp`` together with ``replicate``/``shard``,
            or sizes whose product is not the world size.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("build_mesh needs an initialised default process group (see launch())")
    world_size = dist.get_world_size()
    for name, value in (("dp", dp), ("replicate", replicate), ("shard", shard)):
        _check_size(name, value)
    if device_type is None:
        device_type = _default_device_type()

    if shard is None and replicate == 1:
        num_dp = world_size if dp is None else dp
        if num_dp != world_size:
            raise ValueError(f"dp={num_dp} must equal the world size {world_size}")
        return init_device_mesh(device_type, (num_dp,), mesh_dim_names=(DP_AXIS,))

    if dp is not None:
        raise ValueError(
            f"pass either dp (1-D mesh) or replicate/shard (2-D mesh), got dp={dp}, "
            f"replicate={replicate}, shard={shard}"
        )
    if shard is None:
        if world_size % replicate != 0:
            raise ValueError(
                f"replicate={replicate} does not divide the world size {world_size}; "
                f"pass shard explicitly so that replicate * shard == {world_size}"
            )
        shard = world_size // replicate
    if replicate * shard != world_size:
        raise ValueError(
            f"replicate={replicate} x shard={shard} = {replicate * shard} must equal the world "
            f"size {world_size}"
        )
    return init_device_mesh(
        device_type, (replicate, shard), mesh_dim_names=(REPLICATE_AXIS, SHARD_AXIS)
    )


def mesh_axis_group(mesh: DeviceMesh, axis_name: str) -> ProcessGroup:
    """The process group of this rank along the mesh axis ``axis_name``."""
    names = tuple(mesh.mesh_dim_names or ())
    if axis_name not in names:
        raise ValueError(
            f"mesh has no axis named {axis_name!r}; available axes: {list(names)} "
            f"(mesh shape {tuple(mesh.shape)})"
        )
    return mesh.get_group(axis_name)
