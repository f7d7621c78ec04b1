"""Parallelism as small apply_* functions, composed in one place: :func:`parallelize`
(torchtitan's style).

``apply_fsdp`` shards with FSDP2 (``fully_shard``): parameters become DTensors with ``Shard(0)``
over the mesh (``(Replicate(), Shard(0))`` on a 2-D ``MeshAxis.REPLICATE`` x ``MeshAxis.SHARD``
mesh: HSDP). Local shards follow ``torch.chunk``: 3 rows on 2 ranks are 2 + 1, 6 rows on 4 ranks
2 + 2 + 2 + 0, so a trailing rank may hold an empty shard. ``apply_ddp`` replicates with
DistributedDataParallel. ``apply_ep`` (expert_parallel.py) places experts and shards the rest.
``apply_tp`` splits Linear layers over a TP axis (torch's ColwiseParallel / RowwiseParallel, by a
plan :func:`default_tp_plan` knows for muonlab's GPT and Llama/Qwen-style decoders), before FSDP2
over the other axis. Each modifies and returns the model; ``parallelize`` picks one by mode, builds the default mesh,
and says which module's parameters the optimizer should see.

FSDP units of any ``nn.Module`` (:func:`fsdp_units`): the model's repeated blocks, found by
:func:`find_blocks` (``model.blocks`` for muonlab's GPT; the largest nn.ModuleList or nn.Sequential
of same-type children elsewhere, e.g. the Linear layers of an nn.Sequential MLP or a transformer's
``model.layers``), or, where a model repeats nothing, FSDP's size-based auto-wrap policy: bottom up,
every module holding at least ``min_unit_params`` parameters not already in a unit. The root takes
what no unit holds.
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

__all__ = ["AUTO", "MIN_UNIT_PARAMS", "MODES", "Parallelized", "apply_ddp", "apply_fsdp", "apply_tp",
           "default_tp_plan", "find_blocks", "fsdp_units", "parallelize"]

MODES = ("fsdp", "hsdp", "ddp", "ep", "fsdp+tp")
"""The modes of :func:`parallelize`."""
COLWISE_NAMES = ("fc", "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROWWISE_NAMES = ("out", "o_proj", "down_proj")
"""Linear modules :func:`default_tp_plan` splits column-wise (their output features) and row-wise
(their input features): muonlab's GPT's MLP (fc, out) and a Llama/Qwen-style decoder's attention
and MLP projections. A column-wise layer must feed a row-wise one, as each pair here does."""
AUTO = "auto"
"""``block_attr=AUTO``: find the repeated blocks (:func:`find_blocks`)."""
MIN_UNIT_PARAMS = 100_000_000
"""The default size of a unit of the size-based policy, torch's ``size_based_auto_wrap_policy``'s
``min_num_params``: a model with no repeated blocks and fewer parameters is one unit, the root."""
_CONTAINERS = (nn.ModuleList, nn.Sequential)


def _num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _with_params(container: nn.Module) -> list[nn.Module]:
    """A container's children that hold parameters, each once (a module listed twice is one unit)."""
    return list({id(c): c for c in container.children() if _num_params(c)}.values())


def find_blocks(model: nn.Module) -> tuple[str, list[nn.Module]] | None:
    """The model's repeated blocks: ``(name of their container, blocks)``, or None where it has none.

    ``model.blocks`` (muonlab's GPT: a ModuleList of Blocks) when it is an nn.ModuleList or
    nn.Sequential; else, over every nn.ModuleList and nn.Sequential in the model (the model itself
    included, "" its name), the children of one type that hold parameters, at least two: the
    group with the most parameters wins, the first found (the outermost) on a tie. An
    nn.Sequential MLP's blocks are its Linear layers (its activations hold nothing); a transformer's
    its list of layers (a layer's own lists hold fewer parameters)."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, _CONTAINERS) and _with_params(blocks):
        return "blocks", _with_params(blocks)
    best: tuple[int, str, list[nn.Module]] | None = None
    for name, container in model.named_modules():
        if not isinstance(container, _CONTAINERS):
            continue
        by_type: dict[type, list[nn.Module]] = {}
        for child in _with_params(container):
            by_type.setdefault(type(child), []).append(child)
        for group in by_type.values():
            size = sum(_num_params(c) for c in group)
            if len(group) >= 2 and (best is None or size > best[0]):
                best = (size, name, group)
    return None if best is None else (best[1], best[2])


def _size_based_units(model: nn.Module, min_params: int) -> list[tuple[str, nn.Module]]:
    """FSDP's size-based auto-wrap: bottom up, a module (not the root) whose parameters outside the
    units below it number at least ``min_params`` becomes a unit."""
    units: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()

    def visit(name: str, module: nn.Module) -> int:
        if id(module) in seen:  # a shared module counts (and is wrapped) once
            return 0
        seen.add(id(module))
        count = sum(p.numel() for p in module.parameters(recurse=False))
        for child_name, child in module.named_children():
            count += visit(f"{name}.{child_name}" if name else child_name, child)
        if module is not model and count >= min_params:
            units.append((name, module))
            return 0
        return count

    visit("", model)
    return units


def _containers(model: nn.Module) -> list[str]:
    """The names of the model's nn.ModuleList / nn.Sequential with parameters ("" for the model)."""
    return [n for n, m in model.named_modules() if isinstance(m, _CONTAINERS) and _with_params(m)]


def _shown(name: str) -> str:
    return repr(name) if name else '"" (the model itself)'


def check_model(model, where: str) -> None:
    """A TypeError naming ``model`` unless it is an nn.Module (a list of parameters or a
    state_dict would fail later, deep in a wrapper, with an unrelated AttributeError)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{where} needs the model (an nn.Module) as model, got {type(model).__name__}")


def check_mesh(mesh, where: str) -> None:
    """A TypeError naming ``mesh`` unless it is a DeviceMesh."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{where} takes mesh as a DeviceMesh (from build_mesh() or build_ep_mesh()), "
                        f"got {type(mesh).__name__}")


def fsdp_units(model: nn.Module, block_attr: str | None = AUTO, *,
               min_unit_params: int = MIN_UNIT_PARAMS) -> list[tuple[str, nn.Module]]:
    """The modules :func:`apply_fsdp` shards as units of their own before the root, as
    ``(name, module)``; changes nothing.

    ``block_attr``: AUTO (the default) the blocks :func:`find_blocks` finds, else, where the model
    has none, the size-based policy (``min_unit_params``); a name (dotted, e.g. "model.layers"; ""
    for the model itself) the children with parameters of that nn.ModuleList or nn.Sequential; None
    no unit (the root alone).

    Raises:
        TypeError: ``block_attr`` names no nn.ModuleList or nn.Sequential, saying what to pass.
        ValueError: ``min_unit_params`` is not an integer >= 1.
    """
    check_model(model, "fsdp_units")
    if isinstance(min_unit_params, bool) or not isinstance(min_unit_params, int) or min_unit_params < 1:
        raise ValueError(f"min_unit_params must be an integer >= 1 (parameters per FSDP unit of the size-based "
                         f"policy), got {min_unit_params!r}")
    if block_attr is None:
        return []
    if block_attr == AUTO:
        found = find_blocks(model)
        if found is None:
            return _size_based_units(model, min_unit_params)
        name, blocks = found
    else:
        name = block_attr
        try:
            container = model.get_submodule(block_attr) if isinstance(block_attr, str) else None
        except AttributeError:
            container = None
        if not isinstance(container, _CONTAINERS):
            found = find_blocks(model)
            advice = (f"leave block_attr out to shard the blocks found ({_shown(found[0])}: {len(found[1])} x "
                      f"{type(found[1][0]).__name__})" if found is not None else
                      "leave block_attr out to shard it by size (it repeats no block)")
            others = _containers(model)
            if others:
                listed = ", ".join(_shown(n) for n in others[:8])
                advice += f", or name an nn.ModuleList or nn.Sequential of it: {listed}{', ...' if len(others) > 8 else ''}"
            raise TypeError(
                f"apply_fsdp expects model.{block_attr} to be an nn.ModuleList or nn.Sequential of blocks, got "
                f"{type(container).__name__} on {type(model).__name__}; {advice}")
        blocks = _with_params(container)
    prefix = f"{name}." if name else ""
    names: dict[int, str] = {}
    for child_name, child in model.get_submodule(name).named_children():
        names.setdefault(id(child), prefix + child_name)
    return [(names[id(b)], b) for b in blocks]


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    block_attr: str | None = AUTO,
    min_unit_params: int = MIN_UNIT_PARAMS,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> nn.Module:
    """``fully_shard`` each unit of :func:`fsdp_units` (by default the model's repeated blocks:
    ``model.blocks`` for muonlab's GPT), then the root.

    Each unit is sharded on its own (one all-gather and one reduce-scatter per unit); the root
    takes the remaining parameters (embeddings, head, norms). A 1-D mesh gives FSDP, a 2-D
    (``MeshAxis.REPLICATE``, ``MeshAxis.SHARD``) mesh HSDP. ``block_attr``: AUTO (find the
    blocks; a model without any is wrapped by size, ``min_unit_params``), the name of an
    nn.ModuleList or nn.Sequential, or None to shard only the root.
    """
    check_model(model, "apply_fsdp")
    check_mesh(mesh, "apply_fsdp")
    if mesh.ndim not in (1, 2):
        raise ValueError(f"apply_fsdp needs a 1-D or 2-D mesh, got shape {tuple(mesh.shape)}")
    return _shard(model, fsdp_units(model, block_attr, min_unit_params=min_unit_params), mesh,
                  reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)


def _shard(model: nn.Module, units: list[tuple[str, nn.Module]], mesh: DeviceMesh, *, reshard_after_forward: bool,
           mp_policy: MixedPrecisionPolicy | None) -> nn.Module:
    options = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        options["mp_policy"] = mp_policy
    for _, unit in units:
        fully_shard(unit, **options)
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
    check_model(model, "apply_ddp")
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


def default_tp_plan(model: nn.Module, tp: int | None = None) -> dict:
    """{module name: ParallelStyle}: the TP plan of a model muonlab knows, {} for any other.

    * muonlab's GPT: each MLP's fc column-wise and out row-wise; each attention's proj row-wise from
      a replicated input (each TP rank multiplies its block of the heads' outputs, one all-reduce
      after). Its fused qkv (rows q | k | v) stays whole over the TP axis: the attention splits the
      qkv output into q, k and v by the model's full width, so a column block (a contiguous run of
      rows: all of q and part of k on rank 0 of 2) would give a rank queries without their keys,
      and the interleaved placement that would keep each rank's q, k and v heads together
      (``_StridedShard(0, 3)``) is not one FSDP2 shards back correctly (its ``full_tensor()`` after
      ``fully_shard`` is not the weight: checked with torch 2.13).
    * Anything else: its nn.Linear modules whose last name is in ``COLWISE_NAMES`` (column-wise) or
      ``ROWWISE_NAMES`` (row-wise): a Llama/Qwen/Mistral-style decoder's q/k/v/gate/up and o/down.
      Each rank then holds whole heads, as the attention reads them (view(..., -1, head_dim)), when
      ``tp`` divides the query and the key/value heads; given ``tp``, that is checked.

    Raises:
        ValueError: ``tp`` does not divide an attention's query or key/value heads, naming it.
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from ..models.gpt import GPT, Attention
    from ..optim.heads import _head_dim, _separate_projections

    plan = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        last = name.rsplit(".", 1)[-1]
        if isinstance(module, Attention) and isinstance(model, GPT):
            plan[f"{prefix}proj"] = RowwiseParallel(input_layouts=Replicate())
        elif isinstance(module, nn.Linear) and last in COLWISE_NAMES:
            plan[name] = ColwiseParallel()
        elif isinstance(module, nn.Linear) and last in ROWWISE_NAMES:
            plan[name] = RowwiseParallel()
        elif tp is not None and (projections := _separate_projections(module)):
            d = _head_dim(module)
            heads = [getattr(module, proj).weight.shape[0] // d for proj in projections]
            if any(h % tp for h in heads):
                raise ValueError(f"tp={tp} must divide the heads of attention {name!r} ({heads[0]} query, "
                                 f"{heads[1]} key/value heads): a TP rank holds whole heads")
    return plan


def apply_tp(model: nn.Module, mesh: DeviceMesh, parallelize_plan: dict | None = None) -> nn.Module:
    """Tensor parallelism over the 1-D ``mesh`` (a TP axis, ``mesh["tp"]``): torch's
    ``parallelize_module`` with ``parallelize_plan`` (default :func:`default_tp_plan`). The ranks
    of ``mesh`` must be fed the same inputs.

    Raises:
        ValueError: ``mesh`` is not 1-D; no ``parallelize_plan`` and no default plan for ``model``
            (naming its type); the default plan's head checks (:func:`default_tp_plan`).
    """
    check_model(model, "apply_tp")
    check_mesh(mesh, "apply_tp")
    if mesh.ndim != 1:
        raise ValueError(f"apply_tp needs a 1-D mesh (the TP axis), got shape {tuple(mesh.shape)}")
    plan = default_tp_plan(model, mesh.size()) if parallelize_plan is None else parallelize_plan
    if not plan:
        raise ValueError(f"no TP plan known for {type(model).__name__} (muonlab's GPT, or nn.Linear modules named "
                         f"{COLWISE_NAMES + ROWWISE_NAMES}); pass parallelize_plan={{module name: ParallelStyle}}")
    from torch.distributed.tensor.parallel import parallelize_module

    return parallelize_module(model, mesh, plan)


def _tp_mesh_of(model: nn.Module) -> DeviceMesh | None:
    """The mesh of a model that tensor parallelism and FSDP2 have both sharded already (torchtitan's
    style: a parameter on a mesh of 2+ dims, an FSDP module), None for a plain model.

    Raises:
        ValueError: a model distributed in part (DTensor parameters but no FSDP module, or FSDP
            without a 2-D parameter), naming the parameter or module.
    """
    from torch.distributed.tensor import DTensor

    sharded = fsdp_module_in(model)
    dtensors = [(n, p) for n, p in model.named_parameters() if isinstance(p, DTensor)]
    multi = next(((n, p) for n, p in dtensors if p.device_mesh.ndim >= 2), None)
    if sharded is not None and multi is not None:
        return multi[1].device_mesh
    if sharded is not None:
        raise ValueError(f"parallelize(mode 'fsdp+tp') got a model that is already FSDP-sharded ({sharded!r} is an "
                         f"FSDP module) with no parameter on a 2-D mesh; pass the full model, or one with TP and "
                         f"FSDP2 both applied")
    if dtensors:
        name, p = dtensors[0]
        raise ValueError(f"parallelize(mode 'fsdp+tp') got a model with DTensor parameter {name!r} (placements "
                         f"{tuple(p.placements)}) and no FSDP module; pass the full model, or one with TP and FSDP2 "
                         f"both applied")
    return None


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


def parallelize(
    model: nn.Module,
    mode: str,
    mesh: DeviceMesh | None = None,
    *,
    ep: int | None = None,
    block_attr: str | None = None,
    min_unit_params: int | None = None,
    reshard_after_forward: bool | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    tp: int | None = None,
    tp_axis: str | None = None,
    parallelize_plan: dict | None = None,
) -> Parallelized:
    """Apply the parallelism ``mode`` to ``model`` in place; the one place the apply_* meet.

    Modes (``MODES``):

    * "fsdp": :func:`apply_fsdp` on a 1-D mesh (default ``build_mesh()``, all ranks);
    * "hsdp": :func:`apply_fsdp` on a 2-D (``MeshAxis.REPLICATE``, ``MeshAxis.SHARD``) mesh, which
      must be given (``build_mesh(replicate=R)``): there is no default split of the world;
    * "ddp": :func:`apply_ddp` over ``mesh`` (1-D) or, by default, the whole default group;
    * "ep": :func:`apply_ep` on a (``MeshAxis.FSDP``, ``MeshAxis.EP``) mesh, default
      ``build_ep_mesh(ep)``; ``model`` must be the MoE GPT, built from the same seed on every rank;
    * "fsdp+tp": :func:`apply_tp` over ``mesh[tp_axis]`` (``parallelize_plan``, default
      :func:`default_tp_plan`: muonlab's GPT, a Llama/Qwen-style decoder), then :func:`apply_fsdp`
      over the mesh's other axis. The mesh: ``tp=T`` builds ``build_mesh(tp=T)`` (world size / T x T,
      axes ``MeshAxis.DP``, ``MeshAxis.TP``), or pass a 2-D ``mesh`` (``tp_axis`` default
      ``MeshAxis.TP``). The ranks of one TP group must be fed the same batch. A model that TP and
      FSDP2 have already sharded (torchtitan's style) is returned as it is, on its parameters' mesh.
      Muon takes the weights TP and FSDP2 leave sharded on both axes as they are (layout "pieces").

    Every argument is checked first (the default mesh is built then, which checks ``ep``); only
    then is a model on the CPU moved to this rank's device (``cuda:LOCAL_RANK`` for a CUDA rank;
    see :func:`muonlab.distributed.device.to_rank_device`), before any wrapper sees it.

    Any ``nn.Module`` shards in "fsdp" and "hsdp": its FSDP units are its repeated blocks, found
    (:func:`find_blocks`: ``model.blocks`` for muonlab's GPT, the Linear layers of an nn.Sequential
    MLP, a transformer's list of layers), or, in a model that repeats nothing, its modules of at
    least ``min_unit_params`` parameters (default ``MIN_UNIT_PARAMS``, FSDP's size-based
    auto-wrap); the root takes the rest. ``block_attr`` names the container of the blocks instead
    (an nn.ModuleList or nn.Sequential, dotted: "model.layers"); :func:`fsdp_units` lists the units
    a call would shard. (To shard only the root, call ``apply_fsdp(model, mesh, block_attr=None)``.)

    ``ep`` is read in "ep" mode only, to build the default mesh; ``block_attr`` (default: found in
    "fsdp"/"hsdp", "blocks" in "ep") and ``reshard_after_forward`` (default True) go to
    apply_fsdp/apply_ep, so None, "not given", is all "ddp" takes; ``mp_policy`` and
    ``min_unit_params`` go to apply_fsdp only. Every rank must call this with the same arguments (it
    may create process groups).

    Raises:
        TypeError: ``model`` is not an nn.Module, or ``mesh`` not a DeviceMesh, naming its type.
        ValueError: an unknown mode, an option the mode does not read, a model that is already
            parallelized (wrapped in DDP, or FSDP-sharded anywhere, e.g. by a previous call; in
            "fsdp+tp" one that TP and FSDP2 have both sharded passes), a mesh of the wrong dimension
            for the mode (apply_ddp and apply_ep check theirs too), ``tp`` not dividing the world size
            or a model's heads, or a model with no known TP plan and no ``parallelize_plan``, each
            naming the value.
        TypeError: ``model.<block_attr>`` is not an nn.ModuleList or nn.Sequential ("fsdp", "hsdp"; an
            nn.ModuleList in "ep"), saying what to pass.
    """
    check_model(model, "parallelize")
    if mesh is not None:
        check_mesh(mesh, "parallelize")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if ep is not None and mode != "ep":
        raise ValueError(f"ep is read in 'ep' mode only, got ep={ep!r} with mode {mode!r}")
    for name, value in (("mp_policy", mp_policy), ("min_unit_params", min_unit_params)):
        if value is not None and mode not in ("fsdp", "hsdp"):
            raise ValueError(f"{name} is read in 'fsdp' and 'hsdp' modes only, got mode {mode!r}")
    for name, value in (("tp", tp), ("tp_axis", tp_axis), ("parallelize_plan", parallelize_plan)):
        if value is not None and mode != "fsdp+tp":
            raise ValueError(f"{name} is read in 'fsdp+tp' mode only, got mode {mode!r}")
    if mode == "ddp":
        for name, value in (("block_attr", block_attr), ("reshard_after_forward", reshard_after_forward)):
            if value is not None:
                raise ValueError(f"{name} is read in 'fsdp', 'hsdp' and 'ep' modes only, got {name}={value!r} "
                                 f"with mode 'ddp'")
    if mode == "fsdp+tp":
        return _parallelize_tp(model, mesh, tp, tp_axis, parallelize_plan, block_attr, reshard_after_forward)
    _check_not_parallelized(model, mode)
    if block_attr is None:
        block_attr = "blocks" if mode == "ep" else AUTO
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
        units = fsdp_units(model, block_attr, min_unit_params=MIN_UNIT_PARAMS if min_unit_params is None
                           else min_unit_params)
        # moving keeps the modules (Module.to works in place), so the units found stay the model's
        model = _shard(to_rank_device(model), units, mesh, reshard_after_forward=reshard_after_forward,
                       mp_policy=mp_policy)
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


def _parallelize_tp(model: nn.Module, mesh: DeviceMesh | None, tp, tp_axis: str | None, parallelize_plan: dict | None,
                    block_attr: str | None, reshard_after_forward: bool | None) -> Parallelized:
    """:func:`parallelize`'s "fsdp+tp" mode (its arguments already checked against the mode)."""
    from torch.distributed.tensor.parallel import ParallelStyle

    from .mesh import MeshAxis

    if isinstance(model, DistributedDataParallel):
        raise ValueError("parallelize(mode 'fsdp+tp') got a model that is already wrapped in DistributedDataParallel; "
                         "pass the full model (its .module, or a fresh one)")
    done = _tp_mesh_of(model)
    if done is not None:  # torchtitan's style: TP and FSDP2 applied by the caller
        given = [n for n, v in (("mesh", mesh), ("tp", tp), ("tp_axis", tp_axis), ("parallelize_plan", parallelize_plan),
                                ("block_attr", block_attr)) if v is not None]
        if given:
            raise ValueError(f"parallelize(mode 'fsdp+tp') got a model that TP and FSDP2 have already sharded (on a "
                             f"mesh of shape {tuple(done.shape)}): it passes as it is, so {given[0]} is not read")
        return Parallelized(model, model, done)
    if parallelize_plan is not None and not (isinstance(parallelize_plan, dict) and all(
            isinstance(k, str) and isinstance(v, ParallelStyle) for k, v in parallelize_plan.items())):
        raise TypeError(f"parallelize_plan must be a dict {{module name: ParallelStyle}}, got {parallelize_plan!r}")
    if mesh is None:
        if tp is None:
            raise ValueError("mode 'fsdp+tp' needs tp (the tensor-parallel size) or a 2-D mesh and tp_axis")
        if tp_axis is not None:
            raise ValueError(f"tp_axis names an axis of a given mesh; with tp={tp!r} the mesh's TP axis is "
                             f"{MeshAxis.TP.value!r}, got tp_axis={tp_axis!r}")
        mesh = build_mesh(tp=tp)  # checks tp: a whole number dividing the world size
    elif tp is not None:
        raise ValueError(f"pass either tp or mesh in mode 'fsdp+tp', not both (got tp={tp!r} and a mesh of shape "
                         f"{tuple(mesh.shape)})")
    names = tuple(mesh.mesh_dim_names or ())
    tp_axis = MeshAxis.TP.value if tp_axis is None else tp_axis
    if mesh.ndim != 2 or tp_axis not in names:
        raise ValueError(f"mode 'fsdp+tp' needs a 2-D mesh with named axes and tp_axis naming one of them, "
                         f"got tp_axis={tp_axis!r} and axes {list(names)}")
    dp_axis = names[1 - names.index(tp_axis)]
    if parallelize_plan is None and not default_tp_plan(model, mesh[tp_axis].size()):
        raise ValueError(f"no TP plan known for {type(model).__name__} (muonlab's GPT, or nn.Linear modules named "
                         f"{COLWISE_NAMES + ROWWISE_NAMES}); pass parallelize_plan={{module name: ParallelStyle}}")
    model = apply_tp(to_rank_device(model), mesh[tp_axis], parallelize_plan)
    units = fsdp_units(model, AUTO if block_attr is None else block_attr, min_unit_params=MIN_UNIT_PARAMS)
    model = _shard(model, units, mesh[dp_axis], reshard_after_forward=True if reshard_after_forward is None
                   else reshard_after_forward, mp_policy=None)
    return Parallelized(model, model, mesh)
