"""Plans without processes: what Muon would move and compute at any world size.

``simulate`` builds the same ``MatrixSpec`` records a real run reads off its DTensors, from shapes
alone, and hands them to the same ``plan_batches`` the optimizer uses (muonlab.comm.planner): one
code path for the real step and for a 2048-rank plan.

    from muonlab.simulate import simulate, summarize
    plan = simulate(model, 2048, profile="h100_node")          # or a list of (name, shape)
    print(summarize(plan, 2048, "h100_node"))
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Iterable, Sequence

import torch

from .comm.cost import get_profile, step_seconds
from .comm.memory import PlanMemory, plan_memory, with_buffer_bytes
from .comm.paths import PATHS
from .comm.paths.base import Itemsizes
from .comm.planner import REFERENCE_STRATEGIES, plan_batches, reference_plan
from .comm.records import Plan, per_rank
from .comm.specs import (GroupKey, MatrixSpec, check_view, chunk_sizes, default_view, fused_row_layout,
                          group_pieces, row_layout)
from .comm.wire import wire_itemsizes
from .distributed.mesh import MeshAxis
from .kernels.config import NSConfig, ns_flops
from .kernels.newton_schulz import resolve_dtype, resolve_form
from .kernels.runner import matrices_within
from .kernels.workspace import batch_bytes_per_matrix
from .optim.routing import muon_param_groups
from .optim.rule_step import refuse_unfit_for, with_rule_sums
from .optim.rules import RULES
from .optim.validation import check_comm_dtype, check_workspace_bytes, checked_fused_banks, whole_number

SIMULATED_STRATEGIES = ("muonlab",) + REFERENCE_STRATEGIES
TP_STYLES = ("colwise", "rowwise")
"""How tensor parallelism splits a Linear weight (out, in): "colwise" its out dim (torch's
ColwiseParallel), "rowwise" its in dim (RowwiseParallel)."""
ROWWISE_NAMES = ("o_proj", "down_proj", "out_proj", "c_proj", "proj", "out", "wo", "w2")
"""Module names whose weight a TP plan splits row-wise by default (the output projections of
attention and of the MLP in muonlab's GPT and the Llama/Qwen/GPT-2 families); others column-wise."""
SIMULATED_BACKENDS = ("torch", "triton")
"""Newton-Schulz backends a simulation can size batches for (see ``simulate``'s ``ns_backend``)."""
LAYOUTS = ("fsdp", "ddp")


def muon_shapes(model: torch.nn.Module, **routing) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, matrix view) of the parameters ``muon_param_groups(model, **routing)``
    routes to Muon (``routing``: its exclude, include and conv options)."""
    groups = muon_param_groups(model, **routing)
    return [(r.name, r.shape, r.view) for r in groups.routes if r.algorithm == "muon"]


def _positive_int(value, what: str) -> int:
    """``value`` as an int >= 1 (``whole_number``); anything else a ValueError/TypeError naming ``what``."""
    number = whole_number(value)
    if number is None:
        raise TypeError(f"{what} must be ints, got {value!r}")
    if number < 1:
        raise ValueError(f"{what} must be >= 1, got {number}")
    return number


def _named_shapes(params_or_shapes, matrix_views: dict[str, str] | None = None
                  ) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, view) triples from a model, or from shapes, (name, shape) or (name, shape, view)."""
    if isinstance(params_or_shapes, torch.nn.Module):
        items = muon_shapes(params_or_shapes)
    elif isinstance(params_or_shapes, dict):
        items = list(params_or_shapes.items())
    else:
        items = list(params_or_shapes)
    if not isinstance(matrix_views or {}, dict):
        raise TypeError(f"matrix_views must be a dict {{name: view}}, got {type(matrix_views).__name__}")
    views = dict(matrix_views or {})
    out, seen = [], set()
    for i, item in enumerate(items):
        named = isinstance(item, tuple) and len(item) in (2, 3) and isinstance(item[0], str)
        name, shape, view = (item + ("",))[:3] if named else (f"param{i}", item, "")
        if name in seen:  # views, fused banks and plan rows are keyed by name, as in Muon
            raise ValueError(f"parameter name {name!r} appears twice; names must be unique")
        seen.add(name)
        shape = tuple(_positive_int(d, f"'{name}' has shape {tuple(shape)}: its dims") for d in shape)
        if len(shape) < 2:
            raise ValueError(f"Muon parameters need at least 2 dims; '{name}' has shape {shape}")
        view = views.pop(name, view) or default_view(shape)
        check_view(name, shape, view)
        out.append((name, shape, view))
    if views:
        raise ValueError(f"matrix_views names {sorted(views)}, which are not among the Muon parameters")
    return out


def tp_style(name: str) -> str:
    """The default TP style of parameter ``name``: "rowwise" where its module is named in
    ``ROWWISE_NAMES``, else "colwise"."""
    parts = name.split(".")
    module = parts[-2] if len(parts) > 1 else parts[0]
    return "rowwise" if module in ROWWISE_NAMES else "colwise"


def tp_specs(named_shapes: Iterable[tuple], world: int, tp: int, tp_styles: dict[str, str] | None = None,
             fused_banks: dict[str, int] | None = None, tp_slices: bool = True) -> list[MatrixSpec]:
    """The MatrixSpecs of FSDP2 over tensor parallelism on a ("dp", "tp") mesh of ``world // tp`` x
    ``tp`` ranks: a column-wise weight ``(_StridedShard(0, tp), Shard(0))``, a row-wise one
    ``(Shard(0), Shard(1))``, as torch's TP and ``fully_shard`` place them; layout "pieces" over
    the flattened mesh. ``tp_styles``: {name: style} overriding ``tp_style``.

    ``fused_banks``: {name: blocks} (``attention_blocks(model)``: heads), as Muon's. A column-wise
    bank whose blocks ``tp`` divides leaves whole blocks on every TP rank: with ``tp_slices`` (an
    update rule without per-row state, as ``matrix_spec`` decides) it is planned as a run plans it,
    its TP slice (rows / tp, blocks / tp) row-sharded over "dp" alone, one slice per TP rank doing
    the same on other heads (the plan's rows are one slice's). Any other bank stays on "pieces"."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    styles = dict(tp_styles or {})
    for name, style in styles.items():
        if style not in TP_STYLES:
            raise ValueError(f"tp_styles[{name!r}] must be one of {TP_STYLES}, got {style!r}")
    named_shapes = list(named_shapes)
    fused = checked_fused_banks(fused_banks)
    unknown = sorted(set(fused) - {item[0] for item in named_shapes})
    if unknown:
        raise ValueError(f"fused_banks names {unknown}, which are not among the Muon parameters")
    mesh_shape = (world // tp, tp)
    key = GroupKey(mesh_ranks=tuple(range(world)), mesh_shape=(1, world),
                   axis_name=f"{MeshAxis.DP}+tp", axis_index=1)
    dp = GroupKey(mesh_ranks=tuple(range(world)), mesh_shape=mesh_shape, axis_name=MeshAxis.DP, axis_index=0)
    placements = {"colwise": (_StridedShard(0, split_factor=tp), Shard(0)), "rowwise": (Shard(0), Shard(1))}
    specs = []
    for i, item in enumerate(named_shapes):
        name, shape = item[0], tuple(item[1])
        view = (item[2] if len(item) > 2 else "") or default_view(shape)
        if view not in ("matrix", "transpose"):
            raise ValueError(f"tp > 1 plans 2-D weights; '{name}' of shape {shape} has matrix view {view!r}")
        num_fused = fused.get(name, 1)
        check_view(name, shape, view, num_fused)
        style = styles.pop(name, None) or tp_style(name)
        dim = 0 if style == "colwise" else 1
        if shape[dim] % tp:
            raise ValueError(f"'{name}' of shape {shape} is split {style} over tp={tp}: its dim {dim} "
                             f"({shape[dim]}) must divide by tp")
        if tp_slices and num_fused > 1 and style == "colwise" and num_fused % tp == 0:
            sliced, blocks = (shape[0] // tp, shape[1]), num_fused // tp
            layout, group, rows, _ = row_layout(dp, sliced, blocks, view)  # as matrix_spec lays a run's out
            specs.append(MatrixSpec(i, name, sliced, layout, group, rows, 0, blocks, view))
            continue
        pieces = group_pieces(shape, mesh_shape, placements[style])
        specs.append(MatrixSpec(i, name, shape, "pieces", key, num_fused=num_fused, view=view, pieces=pieces))
    if styles:
        raise ValueError(f"tp_styles names {sorted(styles)}, which are not among the Muon parameters")
    return specs


def mesh_specs(named_shapes: Iterable[tuple], world: int, *, ep: int = 1,
               layout: str = "fsdp", expert_mesh: bool | None = None,
               fused_banks: dict[str, int] | None = None) -> list[MatrixSpec]:
    """The MatrixSpecs of a run: matrices sharded on dim 0 (fsdp) or replicated (ddp) over the
    world; banks (experts) split over ``ep`` ranks and sharded on the expert dim over the fsdp axis.

    ``named_shapes``: (name, shape) or (name, shape, view) (default view: ``default_view``). Axis
    names and order follow muonlab.distributed (build_mesh, build_ep_mesh): the dense mesh is 1-D
    "dp"; the expert mesh is ("fsdp", "ep") with ep innermost. ``expert_mesh`` (default: ep > 1)
    puts the banks on that expert mesh even for ep=1, as apply_ep does.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if world < 1 or ep < 1 or world % ep:
        raise ValueError(f"world size {world} must be a positive multiple of ep={ep}")
    fsdp = world // ep
    fused = checked_fused_banks(fused_banks)
    named_shapes = list(named_shapes)
    unknown = sorted(set(fused) - {item[0] for item in named_shapes})
    if unknown:
        raise ValueError(f"fused_banks names {unknown}, which are not among the Muon parameters")
    ranks = tuple(range(world))
    dense = GroupKey(mesh_ranks=ranks, mesh_shape=(world,), axis_name=MeshAxis.DP)
    expert_mesh = ep > 1 if expert_mesh is None else expert_mesh
    experts = GroupKey(mesh_ranks=ranks, mesh_shape=(fsdp, ep), axis_name=MeshAxis.FSDP) if expert_mesh else dense
    specs = []
    shard_sizes = functools.lru_cache(maxsize=None)(chunk_sizes)  # layers repeat a few shapes
    for i, item in enumerate(named_shapes):
        name, shape = item[0], tuple(item[1])
        view = (item[2] if len(item) > 2 else "") or default_view(shape)
        if view == "bank":
            if shape[0] % ep:
                raise ValueError(f"'{name}' has {shape[0]} experts, not divisible by ep={ep}")
            local = (shape[0] // ep,) + shape[1:]
            group = experts if layout == "fsdp" or ep > 1 else dense
            if world == 1:  # one process: every expert here, as Muon plans it
                specs.append(MatrixSpec(i, name, local, "whole", None, view=view))
            elif layout == "ddp" and ep == 1:
                specs.append(MatrixSpec(i, name, local, "replicated", dense, view=view))
            else:
                specs.append(MatrixSpec(i, name, local, "whole", group, shard_sizes(local[0], group.size), view=view))
            continue
        num_fused = fused.get(name, 1)
        if world == 1:
            specs.append(MatrixSpec(i, name, shape, "whole", None, num_fused=num_fused, view=view))
        elif layout == "ddp":
            specs.append(MatrixSpec(i, name, shape, "replicated", dense, num_fused=num_fused, view=view))
        else:
            row_layout = fused_row_layout(shape[0], num_fused, world) if num_fused > 1 else "row_shard"
            specs.append(MatrixSpec(i, name, shape, row_layout, dense, shard_sizes(shape[0], world),
                                    num_fused=num_fused, view=view))
    return specs


def simulate(
    params_or_shapes,
    mesh_shape: int | Sequence[int],
    *,
    layout: str = "fsdp",
    strategy: str = "muonlab",
    profile="h100_node",
    comm_dtype: torch.dtype | str = "auto",
    ns_steps: int = 5,
    ns_form: str = "auto",
    remainder_path: str = "auto",
    fused_banks: dict[str, int] | None = None,
    matrix_views: dict[str, str] | None = None,
    workspace_bytes: int | None = None,
    ns_dtype: torch.dtype | str = torch.bfloat16,
    ns_backend: str = "torch",
    device: torch.device | str | None = None,
    update_rule: str = "muon",
    tp: int = 1,
    tp_styles: dict[str, str] | None = None,
) -> Plan:
    """The plan (records as ``Muon.plan()``) for these Muon matrices on a mesh.

    Args:
        params_or_shapes: a model (its Muon-routed parameters), or (name, shape) pairs / shapes.
            A run batches matrices of each dtype apart: a model's dtypes are read from it; shapes
            are taken to share one dtype.
        mesh_shape: world size W (or (W,)), or (fsdp, ep) for expert parallel (build_ep_mesh's shape).
        layout: "fsdp" (sharded) or "ddp" (replicated) for the dense matrices.
        strategy: "muonlab", or a reference strategy: "padded_all_to_all", "xtuner".
        profile: hardware profile name or HardwareProfile (path choice under "auto").
        comm_dtype: as Muon's: "auto" (each batch on the wire in its Newton-Schulz dtype, as
            ``ns_dtype`` resolves on ``device``: bf16 for bf16, fp32 otherwise; with
            ``ns_dtype=None``, in the parameters' dtype's), torch.bfloat16 or torch.float32.
        ns_form: "plain", "gram", or "auto" (Muon's default: the gram form where it saves 20% of
            the FLOPs and runs no wider than ``ns_dtype``), as Muon's ``ns_form``.
        fused_banks: {name: E} for 2-D parameters stacking E matrices on dim 0 (as in Muon).
        matrix_views: {name: view} overriding a parameter's matrix view (as in Muon).
        workspace_bytes: Muon's Newton-Schulz budget per rank, which splits buckets of whole
            matrices into batches and cuts expert banks larger than it into parts, as the run
            does; None: no budget (one batch per bucket). ``ns_dtype`` (Newton-Schulz, and the
            momentum as in the parameters' dtype) sizes the matrices against it.
        ns_backend: "torch" or "triton", the Newton-Schulz backend of the run: under a budget,
            "triton" holds one more iterate per matrix (``batch_bytes_per_matrix``), so fewer
            matrices per local batch, as Muon(ns_backend="triton") plans on a GPU. Muon's "auto"
            picks per batch shape from timings taken on the device itself, which a simulation
            doesn't have: pass the backend it chose ("torch" off CUDA).
        device: the device the run is on, for the choices that follow it as Muon's do
            (``ns_dtype="auto"``, and where ``ns_form="auto"`` keeps the plain form: a 16-bit
            dtype on a CPU without fp16 matmul); None: a GPU's. A plan to compare with a run
            passes the run's device (its workers' ``rank_device()``) and its ``ns_dtype``.
        update_rule: every matrix's update rule (a key of muonlab.optim.rules.RULES), as Muon's:
            "normuon" adds, per batch whose matrices' rows lie on several ranks, the all-reduce of
            its norms (``BatchPlan.rule_sums``, priced by the cost model), and refuses the layouts
            a run refuses.
        tp: tensor-parallel size: FSDP2 over TP on a (W // tp, tp) mesh, every 2-D weight split
            column-wise or row-wise (``tp_specs``: layout "pieces"; with ``fused_banks``, a
            column-wise bank whose heads lie whole on each TP rank is planned over "dp" alone, as
            a run with ``split_heads`` plans it); 1: none.
        tp_styles: {name: "colwise" or "rowwise"} overriding the style ``tp_style`` reads from a name.
    """
    if update_rule not in RULES:
        raise ValueError(f"unknown update_rule {update_rule!r}; choose one of {sorted(RULES)}")
    if strategy not in SIMULATED_STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {SIMULATED_STRATEGIES}")
    check_workspace_bytes(workspace_bytes)
    check_comm_dtype(comm_dtype)  # as Muon checks them
    NSConfig(dtype=ns_dtype)
    run_device = device if device is not None else "cuda"  # without a device, the GPU rule
    compute_dtype = resolve_dtype(ns_dtype, run_device)
    if ns_backend not in SIMULATED_BACKENDS:
        raise ValueError(f"simulate's ns_backend must be one of {SIMULATED_BACKENDS}, got {ns_backend!r}"
                         + ("; 'auto' is timed on the device itself: pass the backend it chose"
                            if ns_backend == "auto" else ""))
    if not isinstance(mesh_shape, (int, tuple, list)):
        raise TypeError(f"mesh_shape must be W, (W,) or (fsdp, ep) like build_ep_mesh, got {mesh_shape!r}")
    if not isinstance(mesh_shape, int) and len(mesh_shape) == 1:  # (W,), as init_device_mesh takes it
        (mesh_shape,) = mesh_shape
    expert_mesh = not isinstance(mesh_shape, int)
    if isinstance(mesh_shape, int):
        world, ep = _positive_int(mesh_shape, "the world size"), 1
    else:
        if len(mesh_shape) != 2:
            raise ValueError(f"mesh_shape must be W, (W,) or (fsdp, ep) like build_ep_mesh, got {tuple(mesh_shape)}")
        fsdp, ep = (_positive_int(d, f"mesh_shape {tuple(mesh_shape)}: its sizes") for d in mesh_shape)
        world = ep * fsdp
    tp = _positive_int(tp, "tp")
    if tp > 1:
        if expert_mesh or layout != "fsdp":
            raise ValueError(f"tp={tp} plans FSDP2 over TP on a (W // tp, tp) mesh: pass an int world size "
                             f"and layout 'fsdp' (got mesh_shape {mesh_shape!r}, layout {layout!r})")
        if world % tp:
            raise ValueError(f"world size {world} must be a multiple of tp={tp}")
        specs = tp_specs(_named_shapes(params_or_shapes, matrix_views), world, tp, tp_styles, fused_banks,
                         tp_slices=not RULES[update_rule].state_keys)
    elif tp_styles:
        raise ValueError("tp_styles is read with tp > 1 only")
    else:
        specs = mesh_specs(_named_shapes(params_or_shapes, matrix_views), world, ep=ep, layout=layout,
                           expert_mesh=expert_mesh, fused_banks=fused_banks)
    if isinstance(params_or_shapes, torch.nn.Module):  # a run batches each dtype apart
        dtypes = {name: str(p.dtype) for name, p in params_or_shapes.named_parameters()}
        specs = [dataclasses.replace(s, dtype=dtypes[s.name]) for s in specs]
    form = resolve_form(ns_form, compute_dtype, device)
    configs = [NSConfig(steps=ns_steps, dtype=ns_dtype, **form, backend=ns_backend)] * len(specs)  # as Muon's
    def momentum_dtype(spec: MatrixSpec) -> torch.dtype:  # ns_dtype=None: the parameter's (fp32 for bare shapes)
        return getattr(torch, spec.dtype.removeprefix("torch.")) if spec.dtype else torch.float32

    itemsize = wire_itemsizes(comm_dtype, device=device, input_dtype=momentum_dtype)
    if strategy == "muonlab":
        limit = None
        if workspace_bytes is not None:  # what optim.planning.max_local_matrices gives a run with this budget
            def limit(shape, cfg):
                dtype = resolve_dtype(ns_dtype, run_device, shape)
                return matrices_within(workspace_bytes, shape, dtype, cfg, reuses_input=True)
        rule = RULES[update_rule]
        for spec in specs:
            refuse_unfit_for(rule, spec)
        plan = plan_batches(specs, configs, comm_itemsize=itemsize, remainder_path=remainder_path, profile=profile,
                            max_local_matrices=limit)
        plan = with_rule_sums(plan, {s.index: s for s in specs}, lambda i: rule)
        momentum = {s.index: momentum_dtype(s).itemsize for s in specs}
        return Plan(tuple(with_buffer_bytes(plan, _itemsizes(ns_dtype, run_device, momentum.__getitem__))))
    return reference_plan(strategy, specs, configs, comm_itemsize=itemsize)


def lower_bound_bytes(plan: Plan, comm_itemsize: int | None = None) -> int:
    """The fewest bytes any plan moves for these matrices. A sharded matrix is gathered to one
    rank and scattered back: at best to the rank holding its largest shard, 2 (1 - largest/rows)
    of its bytes (2 (W-1)/W for even shards; less where trailing ranks hold empty shards); or,
    cheaper for a matrix of a fused bank that spans few ranks, all-gathered by the h ranks
    holding it, each orthogonalizing it, nothing sent back: h - 1 of its bytes
    (``_least_moved_share``). Replicated ones: one all-gather of the updates, (W-1)/W of their
    bytes on each rank. A tensor-parallel parameter (layout "pieces"): gathered whole on the rank
    holding its largest piece and sent back, 2 (1 - largest/all) of its bytes (the bound of owner
    compute). Matrices already whole on a rank (experts in a bank) and on a one-rank
    group count nothing: a plan that moves them (for balance) moves more than the bound.
    ``comm_itemsize``: bytes per element on the wire; None: each batch's own (the comm dtype its
    byte counts were made with, ``BatchPlan.comm_itemsize``), so a plan at the bound scores 1.0
    whatever its comm dtype."""
    total = 0.0
    for b in plan:
        if b.group is None or b.group.size == 1 or b.sources:  # sources: whole matrices, in place
            continue
        W = b.group.size
        copies = len(b.group.mesh_ranks) // W  # an axis of a bigger mesh repeats per slice
        itemsize = b.comm_itemsize if comm_itemsize is None else comm_itemsize
        least = PATHS[b.path].least_bytes
        if least is not None:  # a layout whose path module knows its bound (pieces, owner)
            total += copies * least(b, itemsize)
            continue
        for shape in b.param_shapes:  # row-sharded: the least of gathering and all-gathering each matrix
            extent = shape[b.shard_dim]
            # a fused bank's sharded dim 0 holds its matrices one after another
            span = b.matrix_shape[0] if b.shard_dim == 0 and extent % b.matrix_shape[0] == 0 else extent
            total += copies * _least_moved_share(chunk_sizes(extent, W), span) * math.prod(shape) * itemsize
    return int(round(total))


@functools.lru_cache(maxsize=1024)
def _least_moved_share(rows: tuple[int, ...], span: int) -> float:
    """The least share of a sharded parameter's bytes any plan moves: its sharded dim, ``rows``
    entries per rank, holds matrices of ``span`` entries each. Each matrix is either gathered to
    the rank holding most of it and sent back, 2 (1 - largest/span) of it, or all-gathered by the
    h ranks holding part of it, h - 1 of it: the smaller of the two. Cached: O(matrices x ranks) a
    call, and the same shape and world repeat in every layer."""
    ends = list(itertools.accumulate(rows))
    starts = [end - r for end, r in zip(ends, rows)]
    moved = 0.0
    for lo in range(0, ends[-1], span):
        pieces = [p for a, e in zip(starts, ends) if (p := min(e, lo + span) - max(a, lo)) > 0]
        moved += min(2 * (1 - max(pieces) / span), len(pieces) - 1)
    return moved * span / ends[-1]


def _itemsizes(ns_dtype, device, momentum_itemsize):
    """``batch -> Itemsizes`` of a simulated run (``momentum_itemsize(param index)``)."""
    def sizes(batch) -> Itemsizes:
        ns = resolve_dtype(ns_dtype, device, batch.matrix_shape)
        return Itemsizes(momentum_itemsize(batch.param_indices[0]), None if ns is None else ns.itemsize,
                         batch.comm_itemsize)
    return sizes


def step_memory(plan: Plan, world: int, *, workspace_bytes: int, momentum_dtype: torch.dtype = torch.float32,
                ns_dtype: torch.dtype | str = torch.bfloat16, device: torch.device | str | None = None) -> PlanMemory:
    """The optimizer step's memory per rank of a ``simulate`` plan, as ``Muon``'s plan reports it
    for a run (muonlab.comm.memory: the same formulas, the engine's order of batches): per global
    rank the buffers' peak and the batches then in flight, each batch's bytes, and the
    Newton-Schulz workspace's bound (``workspace_bytes``: the run's budget, which ``simulate``
    should be given too). ``momentum_dtype``: the momentum's (fp32 for bare shapes, as ``simulate``
    takes them); ``ns_dtype`` and ``device`` as given to ``simulate``."""
    check_workspace_bytes(workspace_bytes)
    sizes = _itemsizes(ns_dtype, device if device is not None else "cuda", lambda i: momentum_dtype.itemsize)

    def one_matrix(batch) -> int:
        m, n = sorted(batch.matrix_shape)
        return batch_bytes_per_matrix(m, n, sizes(batch).ns or momentum_dtype.itemsize)
    return plan_memory(plan, world, sizes, workspace_bytes, one_matrix)


def summarize(plan: Plan, world: int, profile="h100_node", comm_itemsize: int | None = None) -> dict:
    """Totals a researcher compares across strategies: bytes vs bound, balance, modelled time.
    ``world``: the plan's world size (simulate's W, or fsdp * ep; 1 for a plan of one process).
    ``comm_itemsize``: see ``lower_bound_bytes`` (None: the plan's own)."""
    spans = max((max(b.group.mesh_ranks) + 1 for b in plan if b.group is not None), default=None)
    if spans is None and len(plan):  # every batch on this process alone
        spans = 1
    if isinstance(world, bool) or not isinstance(world, int) or world < 1 or spans not in (None, world):
        raise ValueError(f"summarize: world must be the plan's world size ({spans or 'an int >= 1'}), got {world!r}")
    per = per_rank(plan, world)
    total_flops = sum(per["flops"])
    largest = max((ns_flops(b.matrix_shape, b.ns_config) for b in plan), default=0)
    target = max(total_flops / world, largest) or 1
    bound = lower_bound_bytes(plan, comm_itemsize)
    total = sum(per["sent"])
    return dict(
        total_bytes=total,
        bound_bytes=bound,
        bytes_over_bound=total / bound if bound else (1.0 if total == 0 else float("inf")),
        max_rank_bytes=max(max(per["sent"]), max(per["recv"])),
        max_rank_flops=max(per["flops"]),
        flop_imbalance=max(per["flops"]) / target,
        modelled_s=step_seconds(plan, get_profile(profile)),
        batches=len(plan),
        paths=sorted({b.path for b in plan}),
    )
