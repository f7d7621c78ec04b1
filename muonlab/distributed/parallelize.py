"""Parallelism as small apply_* functions, composed in one place: :func:`parallelize`
(torchtitan's style).

``apply_fsdp`` shards with FSDP2 (``fully_shard``): parameters become DTensors with ``Shard(0)``
over the mesh (``(Replicate(), Shard(0))`` on a 2-D ``MeshAxis.REPLICATE`` x ``MeshAxis.SHARD``
mesh: HSDP). Local shards follow ``torch.chunk``: 3 rows on 2 ranks are 2 + 1, 6 rows on 4 ranks
2 + 2 + 2 + 0, so a trailing rank may hold an empty shard. ``apply_ddp`` replicates with
DistributedDataParallel. ``apply_ep`` (expert_parallel.py) places experts and shards the rest.
Each modifies and returns the model; ``parallelize`` picks one by mode, builds the default mesh,
and says which module's parameters the optimizer should see.
"""

from __future__ import annotations

from typing import NamedTuple

import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from .device import collective_device, to_rank_device
from .expert_parallel import apply_ep, build_ep_mesh, check_ep, fsdp_module_in
from .mesh import build_mesh

__all__ = ["MODES", "Parallelized", "apply_ddp", "apply_fsdp", "parallelize"]

MODES = ("fsdp", "hsdp", "ddp", "ep")
"""The modes of :func:`parallelize`."""


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    block_attr: str | None = "blocks",
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> nn.Module:
    """``fully_shard`` each module of ``model.<block_attr>`` (an nn.ModuleList), then the root.

    Each block is its own FSDP unit (one all-gather and one reduce-scatter per block); the root
    unit takes the remaining parameters (embeddings, head, norms). A 1-D mesh gives FSDP, a 2-D
    (``MeshAxis.REPLICATE``, ``MeshAxis.SHARD``) mesh HSDP. ``block_attr=None`` shards only the root.
    """
    if mesh.ndim not in (1, 2):
        raise ValueError(f"apply_fsdp needs a 1-D or 2-D mesh, got shape {tuple(mesh.shape)}")
    options = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        options["mp_policy"] = mp_policy
    if block_attr is not None:
        _check_blocks(model, block_attr, "apply_fsdp")
        for block in getattr(model, block_attr):
            fully_shard(block, **options)
    fully_shard(model, **options)
    return model


def apply_ddp(
    model: nn.Module, process_group: ProcessGroup | DeviceMesh | None = None
) -> DistributedDataParallel:
    """Wrap ``model`` in DistributedDataParallel over ``process_group`` (default: all ranks).

    A 1-D DeviceMesh is accepted in place of a group. CUDA models are bound to their device;
    CPU models get no ``device_ids``. Over an NCCL group the model must already be on the GPU
    (:func:`parallelize` moves it; alone, ``to_rank_device(model)`` first).

    Raises:
        ValueError: a CPU parameter under a group that carries CUDA tensors only (NCCL), naming
            the rank and the parameter.
    """
    if isinstance(process_group, DeviceMesh):
        if process_group.ndim != 1:
            raise ValueError(
                f"apply_ddp needs a 1-D mesh or a process group, got a mesh of shape "
                f"{tuple(process_group.shape)}"
            )
        process_group = process_group.get_group()
    if collective_device(process_group).type == "cuda":
        on_cpu = next((n for n, p in model.named_parameters() if p.device.type == "cpu"), None)
        if on_cpu is not None:
            raise ValueError(
                f"rank {dist.get_rank()}: apply_ddp over an NCCL group needs the model on this rank's GPU, "
                f"but parameter {on_cpu!r} is on the CPU; move it first (model.to(rank_device()), or use "
                f"parallelize(), which does)"
            )
    device = next((p.device for p in model.parameters()), None)
    if device is not None and device.type == "cuda":
        return DistributedDataParallel(
            model, device_ids=[device.index], output_device=device.index, process_group=process_group
        )
    return DistributedDataParallel(model, process_group=process_group)


class Parallelized(NamedTuple):
    """What :func:`parallelize` returns; unpacks as ``model, inner, mesh``."""

    model: nn.Module
    """The module to call for forward and backward (the DDP wrapper in "ddp" mode)."""
    inner: nn.Module
    """The module whose parameters the optimizer gets (``muon_param_groups(inner)``): ``model``
    itself, or ``model.module`` under DDP, whose parameter names carry no "module." prefix."""
    mesh: DeviceMesh | None
    """The mesh the model lives on (None for "ddp" over the default group)."""


def _check_not_parallelized(model: nn.Module, mode: str) -> None:
    """Refuse a model that a wrapper already holds: DDP over DDP (or over FSDP) would nest two
    gradient synchronisations, and FSDP/EP over either would shard or slice what is already
    distributed."""
    if isinstance(model, DistributedDataParallel):
        raise ValueError(f"parallelize(mode {mode!r}) got a model that is already wrapped in DistributedDataParallel; "
                         f"pass the full model (its .module, or a fresh one), parallelized once")
    sharded = fsdp_module_in(model)
    if sharded is not None:
        raise ValueError(f"parallelize(mode {mode!r}) got a model that is already FSDP-sharded ({sharded!r} is an "
                         f"FSDP module); pass the full model, parallelized once")


def _check_blocks(model: nn.Module, block_attr: str, who: str) -> None:
    blocks = getattr(model, block_attr, None)
    if not isinstance(blocks, nn.ModuleList):
        raise TypeError(
            f"{who} expects model.{block_attr} to be an nn.ModuleList, got "
            f"{type(blocks).__name__} on {type(model).__name__}"
        )


def parallelize(
    model: nn.Module,
    mode: str,
    mesh: DeviceMesh | None = None,
    *,
    ep: int | None = None,
    block_attr: str | None = None,
    reshard_after_forward: bool | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> Parallelized:
    """Apply the parallelism ``mode`` to ``model`` in place; the one place the apply_* meet.

    Modes (``MODES``):

    * "fsdp": :func:`apply_fsdp` on a 1-D mesh (default ``build_mesh()``, all ranks);
    * "hsdp": :func:`apply_fsdp` on a 2-D (``MeshAxis.REPLICATE``, ``MeshAxis.SHARD``) mesh, which
      must be given (``build_mesh(replicate=R)``): there is no default split of the world;
    * "ddp": :func:`apply_ddp` over ``mesh`` (1-D) or, by default, the whole default group;
    * "ep": :func:`apply_ep` on a (``MeshAxis.FSDP``, ``MeshAxis.EP``) mesh, default
      ``build_ep_mesh(ep)``; ``model`` must be the MoE GPT, built from the same seed on every rank.

    Every argument is checked first (the default mesh is built then, which checks ``ep``); only
    then is a model on the CPU moved to this rank's device (``cuda:LOCAL_RANK`` for a CUDA rank;
    see :func:`muonlab.distributed.device.to_rank_device`), before any wrapper sees it.

    ``ep`` is read in "ep" mode only, to build the default mesh; ``block_attr`` (default "blocks")
    and ``reshard_after_forward`` (default True) go to apply_fsdp/apply_ep, so None, "not given",
    is all "ddp" takes; ``mp_policy`` goes to apply_fsdp only. (To shard only the root, call
    ``apply_fsdp(model, mesh, block_attr=None)`` directly.) Every rank must call this with the same
    arguments (it may create process groups).

    Raises:
        ValueError: an unknown mode, an option the mode does not read, a model that is already
            parallelized (wrapped in DDP, or FSDP-sharded anywhere, e.g. by a previous call), or a
            mesh of the wrong dimension for the mode (apply_ddp and apply_ep check theirs too), each
            naming the value.
        TypeError: ``model.<block_attr>`` is not an nn.ModuleList ("fsdp", "hsdp", "ep").
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if ep is not None and mode != "ep":
        raise ValueError(f"ep is read in 'ep' mode only, got ep={ep!r} with mode {mode!r}")
    if mp_policy is not None and mode not in ("fsdp", "hsdp"):
        raise ValueError(f"mp_policy is read in 'fsdp' and 'hsdp' modes only, got mode {mode!r}")
    if mode == "ddp":
        for name, value in (("block_attr", block_attr), ("reshard_after_forward", reshard_after_forward)):
            if value is not None:
                raise ValueError(f"{name} is read in 'fsdp', 'hsdp' and 'ep' modes only, got {name}={value!r} "
                                 f"with mode 'ddp'")
    _check_not_parallelized(model, mode)
    block_attr = "blocks" if block_attr is None else block_attr
    reshard_after_forward = True if reshard_after_forward is None else reshard_after_forward

    # The mesh (given, or the default one) is checked before the model moves: a refused call leaves
    # the caller's model where it was.
    if mode in ("fsdp", "hsdp"):
        if mesh is None:
            if mode == "hsdp":
                raise ValueError("mode 'hsdp' needs a 2-D mesh: pass mesh=build_mesh(replicate=R)")
            mesh = build_mesh()
        # apply_fsdp takes either; "fsdp" on a 2-D mesh would silently be HSDP, so the mode says
        # which one the caller meant. Axis names are not checked: a 1-D sub-mesh (mesh["shard"]) is fine.
        wanted_ndim = 1 if mode == "fsdp" else 2
        if mesh.ndim != wanted_ndim:
            raise ValueError(
                f"mode {mode!r} needs a {wanted_ndim}-D mesh, got axes {list(mesh.mesh_dim_names or ())} "
                f"with shape {tuple(mesh.shape)}"
            )
        _check_blocks(model, block_attr, "apply_fsdp")
        model = apply_fsdp(to_rank_device(model), mesh, block_attr=block_attr,
                           reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)
        return Parallelized(model, model, mesh)
    if mode == "ddp":
        if mesh is not None and mesh.ndim != 1:
            raise ValueError(f"mode 'ddp' needs a 1-D mesh or none (the default group), got axes "
                             f"{list(mesh.mesh_dim_names or ())} with shape {tuple(mesh.shape)}")
        wrapped = apply_ddp(to_rank_device(model), mesh)
        return Parallelized(wrapped, wrapped.module, mesh)
    if mesh is None:
        if ep is None:
            raise ValueError("mode 'ep' needs ep (the expert-parallel size) or a mesh from build_ep_mesh")
        mesh = build_ep_mesh(ep)
    elif ep is not None:
        raise ValueError(f"pass either ep or mesh in mode 'ep', not both (got ep={ep!r} and a mesh "
                         f"of shape {tuple(mesh.shape)})")
    check_ep(model, mesh, block_attr=block_attr)
    model = apply_ep(to_rank_device(model), mesh, block_attr=block_attr, reshard_after_forward=reshard_after_forward)
    return Parallelized(model, model, mesh)
