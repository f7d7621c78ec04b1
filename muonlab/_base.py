"""The ground floor: small helpers every floor of muonlab uses, importing nothing from muonlab.

They lived in domain modules (the comm package's collectives and specs, the optimizer's validation,
the distributed device rule), so a model checking its config imported the optimizer, and the trace
imported comm, which imports the trace: imports that ran back up the house. Here they sit under
everything; the old homes re-export them where callers name them there.
(``tests/unit/test_layering.py`` states which package may import which.)
"""

from __future__ import annotations

import operator

import torch
import torch.distributed as dist

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch built without distributed
    DTensor = None

__all__ = [
    "check_whole",
    "collective_device",
    "dist_on",
    "local_shard",
    "local_shards",
    "rank_or_zero",
    "whole_number",
    "world_size_or_one",
]


def dist_on() -> bool:
    """torch.distributed is available and a default process group is up."""
    return dist.is_available() and dist.is_initialized()


def rank_or_zero() -> int:
    """This process's global rank; 0 where torch.distributed is off (one process)."""
    return dist.get_rank() if dist_on() else 0


def world_size_or_one() -> int:
    """The default group's size; 1 where torch.distributed is off."""
    return dist.get_world_size() if dist_on() else 1


def collective_device(group=None) -> torch.device:
    """Where a small tensor for a collective on ``group`` must live: this rank's GPU when the group
    is NCCL only, else the CPU (gloo, or a group that has gloo for CPU tensors)."""
    backend = str(dist.get_backend(group))
    # "nccl", or a per-device backend string such as "cpu:gloo,cuda:nccl"
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard (aliasing its storage), else ``t``.

    Outside autograd (an optimizer step) the shard is read directly: ``to_local()`` goes through
    an autograd Function, which costs microseconds a call, and a step calls this a few times per
    parameter.
    """
    if DTensor is None or not isinstance(t, DTensor):
        return t
    if torch.is_grad_enabled() and t.requires_grad:
        return t.to_local()  # keeps the autograd link back to the DTensor
    return t._local_tensor


def local_shards(tensors: list) -> list:
    """``local_shard`` of each of ``tensors``, in one pass (a hot step reads a batch's at once);
    with autograd on, each through ``local_shard`` (its autograd link)."""
    if DTensor is None:
        return list(tensors)
    if torch.is_grad_enabled():
        return [local_shard(t) for t in tensors]
    return [t._local_tensor if isinstance(t, DTensor) else t for t in tensors]


def whole_number(value) -> int | None:
    """``value`` as an int (an int, a numpy int, a one-element integer tensor), or None for anything
    else: a float, a str, and a bool (an int to Python, but True as a count is a mistake)."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def check_whole(name: str, value, low: int) -> None:
    """A ValueError naming ``name`` unless ``value`` is a whole number (``whole_number``) >= ``low``."""
    number = whole_number(value)
    if number is None or number < low:
        raise ValueError(f"{name} must be a whole number >= {low}, got {value!r}")
