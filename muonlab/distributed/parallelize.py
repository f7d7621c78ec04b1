"""Data parallelism as small apply_* functions, composed by the caller (torchtitan's style).

``apply_fsdp`` shards with FSDP2 (``fully_shard``): parameters become DTensors with ``Shard(0)``
over the mesh (``(Replicate(), Shard(0))`` on a 2-D "replicate" x "shard" mesh: HSDP). Local
shards follow ``torch.chunk``: 3 rows on 2 ranks are 2 + 1, 6 rows on 4 ranks 2 + 2 + 2 + 0, so a
trailing rank may hold an empty shard. ``apply_ddp`` replicates with DistributedDataParallel.
Both modify and return the model.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

__all__ = ["apply_ddp", "apply_fsdp"]


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
    ("replicate", "shard") mesh HSDP. ``block_attr=None`` shards only the root.
    """
    if mesh.ndim not in (1, 2):
        raise ValueError(f"apply_fsdp needs a 1-D or 2-D mesh, got shape {tuple(mesh.shape)}")
    options = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        options["mp_policy"] = mp_policy
    if block_attr is not None:
        blocks = getattr(model, block_attr, None)
        if not isinstance(blocks, nn.ModuleList):
            raise TypeError(
                f"apply_fsdp expects model.{block_attr} to be an nn.ModuleList, got "
                f"{type(blocks).__name__} on {type(model).__name__}"
            )
        for block in blocks:
            fully_shard(block, **options)
    fully_shard(model, **options)
    return model


def apply_ddp(
    model: nn.Module, process_group: ProcessGroup | DeviceMesh | None = None
) -> DistributedDataParallel:
    """Wrap ``model`` in DistributedDataParallel over ``process_group`` (default: all ranks).

    A 1-D DeviceMesh is accepted in place of a group. CUDA models are bound to their device;
    CPU models get no ``device_ids``.
    """
    if isinstance(process_group, DeviceMesh):
        if process_group.ndim != 1:
            raise ValueError(
                f"apply_ddp needs a 1-D mesh or a process group, got a mesh of shape "
                f"{tuple(process_group.shape)}"
            )
        process_group = process_group.get_group()
    device = next((p.device for p in model.parameters()), None)
    if device is not None and device.type == "cuda":
        return DistributedDataParallel(
            model, device_ids=[device.index], output_device=device.index, process_group=process_group
        )
    return DistributedDataParallel(model, process_group=process_group)
