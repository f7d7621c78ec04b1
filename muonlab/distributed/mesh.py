"""Device meshes with named axes over the default process group.

Every mesh axis name is a member of :class:`MeshAxis`, the one place they are spelled. A 1-D mesh
has the axis ``MeshAxis.DP`` (plain FSDP or DDP); a 2-D mesh has the axes ``(MeshAxis.REPLICATE,
MeshAxis.SHARD)`` (HSDP: FSDP within a shard group, replicas across); the expert-parallel mesh
(:func:`muonlab.distributed.build_ep_mesh`) has ``(MeshAxis.FSDP, MeshAxis.EP)``; the tensor-parallel
mesh (``build_mesh(tp=T)``) ``(MeshAxis.DP, MeshAxis.TP)``. Code asks for an axis by name through
:func:`mesh_axis_group`, never by position.
"""

from __future__ import annotations

from enum import Enum

import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .._base import dist_on, whole_number
from .device import match_default_timeout, rank_device

__all__ = ["MeshAxis", "build_mesh", "mesh_axis_group"]


class MeshAxis(str, Enum):
    """The names of muonlab's mesh axes.

    A ``str`` subclass, so a member indexes a mesh (``mesh[MeshAxis.EP]``) and compares equal to
    its value (``MeshAxis.DP == "dp"``). Not ``enum.StrEnum``: that is Python 3.11+, and muonlab
    supports 3.10; ``__str__``/``__format__`` below give the same printing (the plain value).
    Meshes are built with the plain values (``.value``), so ``mesh.mesh_dim_names`` and torch's
    own messages hold ``'dp'``, not ``<MeshAxis.DP: 'dp'>``.
    """

    DP = "dp"
    """All ranks of a 1-D mesh: FSDP or DDP over the world."""
    REPLICATE = "replicate"
    """The outer axis of an HSDP mesh: ranks holding the same shard."""
    SHARD = "shard"
    """The inner axis of an HSDP mesh: ranks sharing one copy of the parameters."""
    FSDP = "fsdp"
    """The outer axis of the expert-parallel mesh: ranks holding the same experts, sharded."""
    EP = "ep"
    """The inner axis of the expert-parallel mesh: ranks holding different experts."""
    TP = "tp"
    """The inner axis of the tensor-parallel mesh (``build_mesh(tp=T)``, after ``DP``): ranks holding
    different columns or rows of the same weights, fed the same batch."""

    __str__ = str.__str__
    __format__ = str.__format__


def _default_device_type() -> str:
    # The rank's own device: a gloo group started for CPU workers on a GPU machine wants CPU tensors.
    return rank_device().type


def _check_size(name: str, value) -> int:
    """``value`` as a plain int (torch's mesh shapes want one), or a ValueError naming ``name`` unless
    it is a whole number >= 1.

    The rule of the callers' own checks (``check_whole``/``whole_number``: numpy ints accepted, bools,
    floats and None not), so a size that ``train_worker`` accepted is accepted here too.
    """
    number = whole_number(value)
    if number is None or number < 1:
        raise ValueError(f"{name} must be a positive int (a whole number >= 1), got {value!r}")
    return number  # whole_number converted it with operator.index


def build_mesh(
    dp: int | None = None,
    *,
    replicate: int = 1,
    shard: int | None = None,
    tp: int | None = None,
    device_type: str | None = None,
) -> DeviceMesh:
    """Build a mesh over all ranks of the default process group.

    ``build_mesh()`` or ``build_mesh(dp=world_size)``: 1-D, axis ``MeshAxis.DP``.
    ``build_mesh(replicate=R, shard=S)``: 2-D (R x S), axes ``(MeshAxis.REPLICATE, MeshAxis.SHARD)``;
    ranks that differ only in their shard coordinate are consecutive. ``shard`` defaults to
    ``world_size // replicate``.
    ``build_mesh(tp=T)``: 2-D (world_size / T x T), axes ``(MeshAxis.DP, MeshAxis.TP)``; the ranks of
    one TP group are consecutive (on a GPU node, inside it).

    ``device_type``: default this rank's device type (:func:`muonlab.distributed.device.rank_device`:
    "cuda" for a CUDA rank, else "cpu"). Every rank must call this with the same arguments (it
    creates process groups); the mesh's groups get the default group's collective timeout.

    Raises:
        ValueError: sizes that are not whole numbers >= 1 (ints or numpy ints), ``dp`` together with
            ``replicate``/``shard``, ``tp`` together with any other size, ``tp`` not dividing the world
            size, or sizes whose product is not the world size.
    """
    if not dist_on():
        raise RuntimeError("build_mesh needs an initialised default process group (see launch())")
    world_size = dist.get_world_size()
    # dp and shard may be left out (None); the keyword names go into the error message
    dp = None if dp is None else _check_size("dp", dp)
    replicate = _check_size("replicate", replicate)
    shard = None if shard is None else _check_size("shard", shard)
    tp = None if tp is None else _check_size("tp", tp)
    if device_type is None:
        device_type = _default_device_type()

    if tp is not None:
        if dp is not None or replicate != 1 or shard is not None:
            raise ValueError(f"pass tp alone (the data-parallel size is world size / tp), got tp={tp} with "
                             f"dp={dp}, replicate={replicate}, shard={shard}")
        if world_size % tp:
            raise ValueError(f"tp={tp} does not divide the world size {world_size}")
        return match_default_timeout(init_device_mesh(
            device_type, (world_size // tp, tp), mesh_dim_names=(MeshAxis.DP.value, MeshAxis.TP.value)))

    if shard is None and replicate == 1:
        num_dp = world_size if dp is None else dp
        if num_dp != world_size:
            raise ValueError(f"dp={num_dp} must equal the world size {world_size}")
        return match_default_timeout(init_device_mesh(device_type, (num_dp,), mesh_dim_names=(MeshAxis.DP.value,)))

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
    return match_default_timeout(init_device_mesh(
        device_type, (replicate, shard), mesh_dim_names=(MeshAxis.REPLICATE.value, MeshAxis.SHARD.value)
    ))


def mesh_axis_group(mesh: DeviceMesh, axis_name: MeshAxis | str) -> ProcessGroup:
    """The process group of this rank along the mesh axis ``axis_name``."""
    names = tuple(mesh.mesh_dim_names or ())
    if axis_name not in names:
        raise ValueError(
            f"mesh has no axis named {str(axis_name)!r}; available axes: {list(names)} "
            f"(mesh shape {tuple(mesh.shape)})"
        )
    return mesh.get_group(axis_name)
