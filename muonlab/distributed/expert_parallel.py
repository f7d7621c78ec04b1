"""Expert parallelism for the MoE GPT: ``build_ep_mesh`` and ``apply_ep``.

Mesh layout. ``build_ep_mesh(ep, fsdp)`` is a 2-D mesh of shape ``(fsdp, ep)`` with the axes
``(MeshAxis.FSDP, MeshAxis.EP)`` = ``("fsdp", "ep")``; rank ``r`` sits at ``(r // ep, r % ep)``:

* an **"ep" group** is ``ep`` consecutive ranks. They hold *different* experts (EP rank ``i``
  holds global experts ``[i * E/ep, (i + 1) * E/ep)``) and exchange tokens with an all-to-all in
  every MoE layer, forward and backward;
* an **"fsdp" group** is the ranks ``ep`` apart. They hold the *same* experts, shard them with
  FSDP2 (``Shard(0)`` over the local experts) and reduce their gradients.

"ep" is the inner (fastest-varying) axis because its all-to-all sits on the critical path of every
MoE layer and cannot be prefetched, whereas FSDP's all-gathers can; consecutive ranks share a node
on a GPU cluster. (torchtitan orders its axes the same way: ..., "efsdp", "ep", ....)

Gradients. Each rank's loss is the mean over its own slice of the global batch, so single-process
training on the global batch has gradient ``(1 / world) * sum_r grad(loss_r)``. Dense parameters
(embeddings, attention, norms, router, head) are FSDP-sharded over the whole world, whose default
average already divides by ``world``. An expert's gradient on one rank already sums the tokens of
its whole EP group (the all-to-all's backward brings them home), so FSDP over the "fsdp" axis sums
``fsdp`` such partial sums and must divide by ``ep * fsdp = world``, not by ``fsdp``: the expert
modules get ``set_gradient_divide_factor(world)`` (checked against one process in
tests/distributed/test_expert_parallel.py).

After ``apply_ep`` each MoE's ``w_in``/``w_out`` is a DTensor parameter on ``mesh[MeshAxis.FSDP]``
with ``Shard(0)`` and global shape ``(E/ep, d_out, d_in)``: the *local* experts only. Each carries

* ``_ep_rank``: this rank's coordinate on the "ep" axis,
* ``_ep_size``: ``ep``,
* ``_num_global_experts``: ``E``,
* ``_global_experts``: ``range(_ep_rank * E/ep, (_ep_rank + 1) * E/ep)``, the global ids of its
  rows ``0 .. E/ep - 1``.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.nn.functional import all_to_all_single as _all_to_all_autograd
from torch.distributed.tensor import DTensor

from muonlab.models.gpt import MoE

from .._base import dist_on
from .device import match_default_timeout
from .mesh import MeshAxis, _check_size, _default_device_type

__all__ = ["AllToAllDispatcher", "apply_ep", "build_ep_mesh", "check_ep"]


def build_ep_mesh(ep: int, fsdp: int | None = None, *, device_type: str | None = None) -> DeviceMesh:
    """A 2-D mesh of shape ``(fsdp, ep)``, axes ``(MeshAxis.FSDP, MeshAxis.EP)``, over all ranks.

    ``ep`` is required; ``fsdp`` defaults to ``world_size // ep``. EP groups are ``ep`` consecutive
    ranks (see the module docstring). Every rank must call this with the same arguments; the mesh's
    groups get the default group's collective timeout.

    Raises:
        ValueError: sizes that are not whole numbers >= 1 (ints or numpy ints; ``ep=None`` included),
            ``ep`` not dividing the world size, or ``ep * fsdp`` different from the world size.
    """
    if not dist_on():
        raise RuntimeError("build_ep_mesh needs an initialised default process group (see launch())")
    world_size = dist.get_world_size()
    ep = _check_size("ep", ep)  # the keyword names, for the error message
    fsdp = None if fsdp is None else _check_size("fsdp", fsdp)
    if fsdp is None:
        if world_size % ep:
            raise ValueError(f"ep={ep} does not divide the world size {world_size}")
        fsdp = world_size // ep
    if ep * fsdp != world_size:
        raise ValueError(
            f"ep={ep} x fsdp={fsdp} = {ep * fsdp} must equal the world size {world_size}"
        )
    if device_type is None:
        device_type = _default_device_type()
    return match_default_timeout(
        init_device_mesh(device_type, (fsdp, ep), mesh_dim_names=(MeshAxis.FSDP.value, MeshAxis.EP.value))
    )


class AllToAllDispatcher:
    """Sends each routed token copy to the EP rank owning its expert and brings the result back.

    Installed as ``MoE.dispatcher``; called as ``dispatcher(moe, tokens, counts)`` with the token
    copies sorted by global expert and ``counts`` (E,) per global expert; returns the expert
    outputs in the same order. Both all-to-alls are differentiable, so an expert's gradient sums
    the tokens of the whole EP group.
    """

    def __init__(self, group: ProcessGroup, num_global_experts: int):
        self.group = group
        self.ep_size = dist.get_world_size(group)
        self.ep_rank = dist.get_rank(group)
        self.num_global_experts = num_global_experts
        self.num_local_experts = num_global_experts // self.ep_size

    def __call__(self, moe: MoE, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ep, num_local = self.ep_size, self.num_local_experts
        # counts_recv[i, l]: copies EP rank i sends to my local expert l
        counts_send = counts.reshape(ep, num_local).contiguous()
        counts_recv = torch.empty_like(counts_send)
        dist.all_to_all_single(counts_recv, counts_send, group=self.group)
        send_splits = counts_send.sum(1).tolist()
        recv_splits = counts_recv.sum(1).tolist()
        if sum(send_splits) != tokens.shape[0]:  # a mismatch can hang gloo: check before the call
            raise AssertionError(f"split sizes {send_splits} do not add up to {tokens.shape[0]}")

        received = tokens.new_empty((sum(recv_splits), tokens.shape[1]))
        received = differentiable_all_to_all(
            received, tokens.contiguous(), recv_splits, send_splits, group=self.group
        )
        # received is ordered (source rank, local expert); the experts want (local expert, source)
        chunk = torch.repeat_interleave(
            torch.arange(ep * num_local, device=tokens.device), counts_recv.reshape(-1)
        )
        source, local = chunk // num_local, chunk % num_local
        order = (local * ep + source).argsort(stable=True)
        y_sorted = moe.expert_forward(moe.w_in, moe.w_out, received[order], counts_recv.sum(0))
        y = torch.empty_like(y_sorted).index_copy(0, order, y_sorted)  # back to (source, expert)

        out = y.new_empty((tokens.shape[0], y.shape[1]))
        return differentiable_all_to_all(out, y.contiguous(), send_splits, recv_splits, group=self.group)


def differentiable_all_to_all(output, input, output_split_sizes, input_split_sizes, group):
    """``torch.distributed.nn.functional.all_to_all_single`` (its backward is the reverse
    all-to-all), without its deprecation warning: the suggested replacement is private API."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*all_to_all_single is deprecated", category=FutureWarning)
        return _all_to_all_autograd(output, input, output_split_sizes, input_split_sizes, group=group)


def _moe_layers(model: nn.Module, block_attr: str) -> list[MoE]:
    """Each MoE under ``model.<block_attr>`` once, in block order: a MoE shared by two blocks must be
    sliced and sharded once, not twice."""
    blocks = getattr(model, block_attr, None)
    if not isinstance(blocks, nn.ModuleList):
        raise TypeError(
            f"apply_ep expects model.{block_attr} to be an nn.ModuleList, got "
            f"{type(blocks).__name__} on {type(model).__name__}"
        )
    unique = {id(m): m for block in blocks for m in block.modules() if isinstance(m, MoE)}
    return list(unique.values())


EP_MARKS = ("_ep_rank", "_ep_size", "_num_global_experts", "_global_experts")
"""The attributes apply_ep sets on the expert banks it places (see the module docstring)."""


def fsdp_module_in(model: nn.Module) -> str | None:
    """The name of the first FSDP2-sharded module of ``model`` ("the model itself" for the root),
    None if none is: a model apply_ep or parallelize must not shard again."""
    return next((n or "the model itself" for n, m in model.named_modules() if isinstance(m, FSDPModule)), None)


def check_ep(model: nn.Module, mesh: DeviceMesh, *, block_attr: str = "blocks") -> list[MoE]:
    """:func:`apply_ep`'s checks, which change nothing: the MoE layers it would place, each once.

    ``parallelize`` calls it too, before it moves the model to the rank's device.

    Raises:
        ValueError: the mesh lacks the "ep"/"fsdp" axes or does not cover the world; the model is
            already parallelized (an FSDP module anywhere in it, expert banks that are DTensors or
            carry apply_ep's ``_ep_*`` marks); no MoE layer; an MoE's ``num_experts`` not divisible
            by ``ep``.
        TypeError: ``model.<block_attr>`` is not an nn.ModuleList.
    """
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim != 2 or set(names) != {MeshAxis.EP, MeshAxis.FSDP}:
        raise ValueError(
            f"apply_ep needs a 2-D mesh with axes ('{MeshAxis.FSDP}', '{MeshAxis.EP}') (build_ep_mesh), "
            f"got axes {list(names)} with shape {tuple(mesh.shape)}"
        )
    world_size = dist.get_world_size()
    if mesh.size() != world_size:
        raise ValueError(f"the mesh has {mesh.size()} ranks but the world has {world_size}")
    ep = mesh.size(names.index(MeshAxis.EP))
    moes = _moe_layers(model, block_attr)
    if not moes:  # it would silently be FSDP over the world
        raise ValueError(f"apply_ep found no muonlab MoE layer under model.{block_attr} of {type(model).__name__}: "
                         "nothing to spread over the 'ep' axis (a dense model takes mode 'fsdp')")
    # Slicing banks that are already local experts (or FSDP shards) would keep the wrong rows, and
    # torch's own "applied once" error comes only after the banks are replaced.
    for i, moe in enumerate(moes):
        for name in ("w_in", "w_out"):
            bank = getattr(moe, name)
            if any(hasattr(bank, mark) for mark in EP_MARKS):
                raise ValueError(f"MoE layer {i}'s {name} already holds this rank's experts only (it carries "
                                 f"apply_ep's _ep_* marks): apply_ep was already applied to this model; build a "
                                 f"fresh full model to place the experts again")
            if isinstance(bank, DTensor):
                raise ValueError(f"MoE layer {i}'s {name} is already a DTensor (placements {list(bank.placements)}): "
                                 f"apply_ep needs the full, unsharded model; apply it instead of apply_fsdp, "
                                 f"not after it")
    sharded = fsdp_module_in(model)
    if sharded is not None:
        raise ValueError(f"{type(model).__name__} is already FSDP-sharded ({sharded!r} is an FSDP module): apply_ep "
                         f"needs the full, unsharded model; apply it instead of apply_fsdp, not after it")
    for i, moe in enumerate(moes):
        if moe.num_experts % ep:
            raise ValueError(
                f"num_experts={moe.num_experts} (MoE layer {i}) is not divisible by ep={ep}"
            )
    return moes


def apply_ep(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    block_attr: str = "blocks",
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Expert-parallel + FSDP2 the MoE GPT ``model`` in place on an ``(MeshAxis.FSDP, MeshAxis.EP)``
    mesh (:func:`build_ep_mesh`).

    ``model`` must be the same full model on every rank (same seed): each rank keeps its EP
    rank's experts, slicing them out of the full banks. Then, per block: the router is sharded
    over the whole world, the MoE's expert banks over ``mesh[MeshAxis.FSDP]`` (gradient divide
    factor = world size), the rest of the block over the whole world; finally the root
    (embeddings, final norm, head) over the whole world. Feed each rank its own slice of the batch.

    An MoE module shared by several blocks is placed once.

    Raises:
        ValueError: (:func:`check_ep`, raised before anything changes) the mesh lacks the "ep"/"fsdp"
            axes or does not cover the world, the model is already parallelized (a second apply_ep,
            or apply_ep after apply_fsdp/parallelize), or an MoE's ``num_experts`` is not divisible
            by ``ep``.
    """
    moes = check_ep(model, mesh, block_attr=block_attr)
    world_size = dist.get_world_size()
    ep = mesh.size(mesh.mesh_dim_names.index(MeshAxis.EP))

    ep_rank = mesh.get_local_rank(MeshAxis.EP)
    ep_group = mesh.get_group(MeshAxis.EP)
    fsdp_mesh = mesh[MeshAxis.FSDP]
    # The whole world as a 1-D mesh (the default group) for the dense parameters.
    world_mesh = match_default_timeout(
        init_device_mesh(mesh.device_type, (world_size,), mesh_dim_names=(MeshAxis.DP.value,))
    )

    for moe in moes:
        num_local = moe.num_experts // ep
        lo = ep_rank * num_local
        for name in ("w_in", "w_out"):
            full = getattr(moe, name)
            local = full.detach()[lo : lo + num_local].clone()
            setattr(moe, name, nn.Parameter(local, requires_grad=full.requires_grad))
        if ep > 1:
            moe.dispatcher = AllToAllDispatcher(ep_group, moe.num_experts)

    options = {"reshard_after_forward": reshard_after_forward}
    # A divide factor other than the group size makes FSDP2 reduce with PREMUL_SUM, which gloo
    # lacks; summing and dividing afterwards is the same. Not on one rank: FSDP2 then skips the
    # collective and already divides by the factor itself (forcing the sum would divide twice).
    fsdp_group = fsdp_mesh.get_group()
    force_sum = fsdp_mesh.size() > 1 and dist.get_backend(fsdp_group) == "gloo"
    blocks = getattr(model, block_attr)
    placed = set()  # a MoE shared by several blocks is one FSDP unit, sharded and marked once
    for block in blocks:
        for moe in (m for m in block.modules() if isinstance(m, MoE) and id(m) not in placed):
            placed.add(id(moe))
            # The router first, so the MoE's own unit holds only the expert banks.
            fully_shard(moe.router, mesh=world_mesh, **options)
            fully_shard(moe, mesh=fsdp_mesh, **options)
            if ep > 1:
                moe.set_gradient_divide_factor(float(world_size))
                if force_sum:
                    moe.set_force_sum_reduction_for_comms(True)
            for name in ("w_in", "w_out"):
                p = getattr(moe, name)
                p._ep_rank, p._ep_size, p._num_global_experts = ep_rank, ep, moe.num_experts
                num_local = moe.num_experts // ep
                p._global_experts = range(ep_rank * num_local, (ep_rank + 1) * num_local)
        fully_shard(block, mesh=world_mesh, **options)
    fully_shard(model, mesh=world_mesh, **options)
    return model
