"""Where a parameter's matrices live: read once from GLOBAL metadata, identical on every rank.

A ``MatrixSpec`` says, for one Muon parameter, what the planner needs and nothing that differs
between ranks: the global shape, how it is laid out over which group of ranks, and how many rows
(dim-0 entries) each rank of that group holds. Layouts:

* ``whole``: every rank that holds data holds whole matrices. A single process, or a DTensor of 3+
  dims sharded on dim 0 (experts): no communication.
* ``row_shard``: a 2-D DTensor sharded on dim 0 (FSDP2): rank i holds rows of every matrix, as
  ``torch.chunk`` splits them (so trailing ranks may hold none).
* ``replicated``: a plain tensor replicated over a process group (DDP): one owner per matrix.
* ``subgroup``: a fused expert bank (E*M, N) row-sharded so that each expert spans W/E ranks:
  each sub-group of W/E ranks all-gathers its expert.
* ``blocks``: a fused bank (E*M, N) row-sharded so that some of its matrices straddle shards (a
  fused QKV split per head): each matrix is gathered on the rank holding most of its rows and
  sent back (muonlab.comm.paths.blocks).
* ``pieces``: a DTensor sharded on two or more mesh axes, as tensor parallelism composed with FSDP2
  makes it (a column-wise Linear ``(_StridedShard(0), Shard(0))``, a row-wise one ``(Shard(0),
  Shard(1))``, HSDP x TP with a Replicate axis more), or on one axis by anything but Shard(0) (a
  row-wise Linear alone, ``Shard(1)``: each rank a column block): each rank of the sharding axes,
  flattened into one group, holds an arbitrary block of each tensor, a product of index runs per dim
  (``MatrixSpec.pieces``; uneven and empty ones included). Each parameter is gathered whole on one
  owner and its update's pieces sent back (muonlab.comm.paths.pieces). A fused bank (heads, with
  ``split_heads``) split column-wise with whole blocks per TP rank is not "pieces": its TP slice is a
  fused bank row-sharded over the FSDP axis alone (``tp_whole_blocks``), no TP peer involved.
* ``gather_all``: no placement takes it; the planner's "redundant" strategy (the baseline) puts
  row-sharded matrices on it, every rank gathering each whole (muonlab.comm.paths.gather_all).

A parameter's MATRIX VIEW says how its tensor is read as matrices (``VIEWS``); the data is always
moved and orthogonalized as stored, so only the lr ratio needs the (out, in) orientation:

* ``matrix``: a 2-D (out, in) weight (nn.Linear).
* ``transpose``: a 2-D weight stored (in, out) (transformers' Conv1D): orth(G^T) = orth(G)^T, so
  it is orthogonalized as stored, but its lr ratio reads the transposed shape.
* ``flatten``: a kernel (out, in, *k) read as ONE (out, in * prod(k)) matrix (Keller Jordan's Muon
  on CIFAR flattens conv filters this way); sharded on dim 0 it is a row-sharded matrix.
* ``bank``: a 3-D+ tensor whose leading dims index independent (out, in) matrices (experts).
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .._base import local_shard, local_shards  # noqa: F401 (their home is the ground floor; read here by the optimizer)

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover - torch without distributed
    DTensor = Replicate = Shard = _StridedShard = None  # type: ignore[assignment,misc]

LAYOUTS = ("whole", "row_shard", "subgroup", "blocks", "replicated", "pieces", "gather_all")

Runs = tuple[tuple[int, int], ...]
"""Index runs along one tensor dim, (first index, length) each, in the order the local tensor
holds them (a Shard gives one run, a _StridedShard several, an empty piece none)."""
Piece = tuple[Runs, ...]
"""What one rank holds of a tensor: the product of one ``Runs`` per dim."""
VIEWS = ("matrix", "transpose", "flatten", "bank")


def even_share_bytes(t: torch.Tensor) -> int:
    """``t``'s bytes divided evenly over the mesh dims that shard it (a plain tensor: all of them).
    The same number on every rank, where a rank's own shard may be a little larger, smaller or
    empty: what a rank-independent setting (the default workspace budget, which shapes the plan)
    is computed from."""
    n = t.numel() * t.element_size()
    if DTensor is not None and isinstance(t, DTensor):
        for dim, placement in enumerate(t.placements):
            if placement.is_shard():
                n //= t.device_mesh.size(dim)
    return n


def default_view(shape: tuple[int, ...]) -> str:
    """The view of a parameter nobody declared one for: 2-D "matrix", 3-D "bank", 4-D+ "flatten"
    (a 4-D parameter is far more often a conv kernel than a bank of banks)."""
    return "matrix" if len(shape) == 2 else "bank" if len(shape) == 3 else "flatten"


def check_view(name: str, shape: tuple[int, ...], view: str, num_fused: int = 1) -> None:
    """ValueError naming the parameter unless ``view`` can read a tensor of ``shape``."""
    if view not in VIEWS:
        raise ValueError(f"parameter '{name}' of shape {shape} has unknown matrix view {view!r}; "
                         f"choose one of {VIEWS}")
    two_d = view in ("matrix", "transpose")
    if (len(shape) != 2) if two_d else (len(shape) < 3):
        raise ValueError(f"parameter '{name}' of shape {shape} can't take matrix view {view!r}, which "
                         f"needs {'exactly 2' if two_d else 'at least 3'} dims")
    if num_fused > 1 and (view != "matrix" or shape[0] % num_fused):
        raise ValueError(f"fused bank '{name}' of shape {shape} must be 2-D with view 'matrix' and rows "
                         f"divisible by {num_fused}, got view {view!r}")


@dataclass(frozen=True, kw_only=True)
class GroupKey:
    """A process group named by its members, never by a Python object's identity.

    The group is one axis of a mesh: ``mesh_ranks`` (global ranks, row-major) and ``mesh_shape``
    describe the whole (root) mesh, ``axis_name`` and ``axis_index`` the axis. A plain process
    group is a 1-D mesh with an empty axis name. Every slice of the axis has the same shape, so
    the plan is written with group-local ranks 0..size-1.
    """

    mesh_ranks: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    axis_name: str
    """The mesh axis' name (a muonlab.distributed.MeshAxis value; "" for a plain process group)."""
    axis_index: int = 0
    """Position of the axis in ``mesh_shape``."""

    def __post_init__(self):
        # a plain str, so keys built from a MeshAxis member and from a mesh's own names hash alike
        # (a str-mixin Enum hashes by member name on Python 3.10)
        object.__setattr__(self, "axis_name", str(self.axis_name))

    @property
    def size(self) -> int:
        """Ranks along the axis (the group's size)."""
        return self.mesh_shape[self.axis_index]

    def local_ranks(self) -> dict[int, int]:
        """{global rank: this axis' index of it} for every rank on the mesh."""
        inner = 1
        for d in self.mesh_shape[self.axis_index + 1:]:
            inner *= d
        return {g: (flat // inner) % self.size for flat, g in enumerate(self.mesh_ranks)}

    def axis_slices(self) -> list[list[int]]:
        """Global ranks of every slice of the axis, each in axis order, slices in mesh order."""
        slices: dict[tuple, list[tuple[int, int]]] = {}
        for flat, g in enumerate(self.mesh_ranks):
            coords, rest = [], flat
            for d in reversed(self.mesh_shape):
                coords.append(rest % d)
                rest //= d
            coords.reverse()
            other = tuple(c for a, c in enumerate(coords) if a != self.axis_index)
            slices.setdefault(other, []).append((coords[self.axis_index], g))
        return [[g for _, g in sorted(members)] for _, members in sorted(slices.items())]


@dataclass(frozen=True)
class MatrixSpec:
    index: int
    """Position of the parameter in the optimizer's parameter order."""
    name: str
    shape: tuple[int, ...]
    """Global shape of the parameter."""
    layout: str
    group: GroupKey | None
    """Group the parameter is sharded or replicated over (None: this process only)."""
    rows: tuple[int, ...] = ()
    """Entries of the sharded dim held by each group-local rank (torch.chunk sizes)."""
    shard_dim: int = 0
    """The tensor dim the group shards: 0 for every single-axis layout (any other dim takes "pieces")."""
    num_fused: int = 1
    """Matrices stacked along dim 0 of a 2-D parameter (a fused expert bank (E*M, N)), else 1."""
    view: str = ""
    """How the tensor reads as matrices (one of ``VIEWS``; empty: ``default_view(shape)``)."""
    dtype: str = ""
    """The parameter's dtype (``str(p.dtype)``; empty: unknown). A batch holds one: its matrices are
    read into one workspace, from momentum in the parameter's dtype by default."""
    pieces: tuple[Piece, ...] = ()
    """Layout "pieces": what each group-local rank holds of the tensor (``Piece``), from global
    metadata alone; empty for every other layout."""

    def __post_init__(self):
        if not self.view:
            object.__setattr__(self, "view", default_view(self.shape))
        check_view(self.name, self.shape, self.view, self.num_fused)

    @property
    def matrix_shape(self) -> tuple[int, int]:
        """One matrix as stored, the shape the paths move and orthogonalize."""
        if self.view == "flatten":
            return self.shape[0], math.prod(self.shape[1:])
        return self.shape[-2] // self.num_fused, self.shape[-1]

    @property
    def lr_shape(self) -> tuple[int, int]:
        """One matrix as (out, in), the shape the lr ratio reads."""
        rows, cols = self.matrix_shape
        return (cols, rows) if self.view == "transpose" else (rows, cols)

    @property
    def num_matrices(self) -> int:
        if self.view == "flatten":
            return 1
        return self.num_fused * math.prod(self.shape[:-2])

    def matrix_sources(self) -> list[int]:
        """Group-local rank holding each matrix, for layouts whose shards are whole matrices."""
        if self.group is None or not self.rows:
            return [0] * self.num_matrices
        holders = [r for r in range(len(self.rows)) if self.rows[r]]
        offsets = list(itertools.accumulate(self.rows, initial=0))  # a running sum: O(ranks), not O(ranks^2)
        starts = [offsets[r] for r in holders]
        out = []
        for m in range(self.num_matrices):
            entry = m * self.shape[0] // self.num_matrices  # the dim-0 entry where matrix m starts
            out.append(holders[bisect.bisect_right(starts, entry) - 1])
        return out


@functools.lru_cache(maxsize=4096)
def chunk_sizes(dim_size: int, parts: int) -> tuple[int, ...]:
    """Sizes ``torch.chunk`` (and so FSDP2's Shard(0)) gives: ceil-sized chunks, trailing ones short or empty.
    Cached: a model repeats its shapes layer after layer, and at thousands of ranks each call is O(parts)."""
    step = -(-dim_size // parts) if dim_size else 0
    return tuple(max(0, min(step, dim_size - i * step)) for i in range(parts))


def group_key_for_mesh(mesh, mesh_dim: int) -> GroupKey:
    """Key of one mesh axis, named on the ROOT mesh so that every rank builds the same key.

    A sub-mesh such as ``mesh2d["fsdp"]`` holds only this rank's slice; its root (the 2-D mesh)
    is the same everywhere.
    """
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    root = root if root is not None else mesh
    root_names = root.mesh_dim_names or tuple(f"dim{i}" for i in range(root.ndim))
    if root is mesh or names[mesh_dim] not in root_names:
        root, root_names = mesh, names
    axis = root_names.index(names[mesh_dim])
    return GroupKey(mesh_ranks=tuple(root.mesh.flatten().tolist()), mesh_shape=tuple(root.mesh.shape),
                    axis_name=names[mesh_dim], axis_index=axis)


def group_key_for_pg(group) -> GroupKey:
    ranks = tuple(dist.get_process_group_ranks(group))
    return GroupKey(mesh_ranks=ranks, mesh_shape=(len(ranks),), axis_name="")


def _runs(index: list[int]) -> Runs:
    """``index`` (global positions, in local order) as runs of consecutive positions."""
    out: list[list[int]] = []
    for g in index:
        if out and out[-1][0] + out[-1][1] == g:
            out[-1][1] += 1
        else:
            out.append([g, 1])
    return tuple((a, n) for a, n in out)


def held_piece(shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate: tuple[int, ...],
               placements: tuple) -> Piece:
    """What the rank at ``coordinate`` of a mesh holds of a tensor of global ``shape`` placed by
    ``placements``: per dim, the global indices it holds as runs, in its local tensor's order.

    A dim sharded by plain Shards, or by FSDP2's ``_StridedShard(d, sf)`` followed by the
    ``Shard(d)`` of sf ranks it was made for (TP first, then FSDP within each TP chunk), holds one
    run, computed here with ``torch.chunk``'s sizes; any other combination is read from torch's own
    sharding arithmetic (``_torch_runs``). tests/unit/test_tp_pieces.py checks both against torch."""
    out, slow = [], None
    for d, size in enumerate(shape):
        steps = [(a, pl) for a, pl in enumerate(placements) if not isinstance(pl, Replicate) and pl.dim == d]
        if len(steps) == 2 and isinstance(steps[0][1], _StridedShard) and not isinstance(steps[1][1], _StridedShard) \
                and steps[0][1].split_factor == mesh_shape[steps[1][0]]:
            steps = [steps[1], steps[0]]  # the later Shard splits first, then the strided one within
        elif any(isinstance(pl, _StridedShard) for _, pl in steps):
            slow = slow or _torch_runs(shape, mesh_shape, coordinate, placements)
            out.append(slow[d])
            continue
        start, n = 0, size
        for a, _ in steps:
            sizes = chunk_sizes(n, mesh_shape[a])
            start, n = start + sum(sizes[:coordinate[a]]), sizes[coordinate[a]]
        out.append(((start, n),) if n else ())
    return tuple(out)


def _torch_runs(shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate: tuple[int, ...],
                placements: tuple) -> Piece:
    """``held_piece`` by torch's own sharding arithmetic (``_get_shard_size_and_offsets``, what
    ``compute_local_shape_and_global_offset`` is made of), mesh dim by mesh dim, keeping every
    offset rather than the first, so any strided or uneven shard comes out as DTensor lays it out."""
    from torch.distributed.tensor._utils import _get_shard_size_and_offsets

    sizes = list(shape)
    offsets: dict[int, object] = {}
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Replicate):
            continue
        dim = placement.dim
        size, index = _get_shard_size_and_offsets(sizes[dim], mesh_shape[mesh_dim], coordinate[mesh_dim],
                                                  placement, offsets.get(dim), shape[dim], False)
        sizes[dim] = size
        offsets[dim] = index[:size]  # an empty shard's offsets hold a placeholder past the end
    return tuple(_runs(offsets[d].tolist()) if d in offsets else ((0, shape[d]),) if shape[d] else ()
                 for d in range(len(shape)))


def piece_numel(piece: Piece) -> int:
    """Elements of a ``Piece``."""
    return math.prod(sum(n for _, n in runs) for runs in piece)


def piece_rows(spec: "MatrixSpec", group_rank: int) -> list[int]:
    """The parameter's rows (read as (rows, cols) by its view: a bank's matrices' rows one after
    another, a flattened kernel's dim 0) that group rank ``group_rank``'s piece holds part of, in its
    local order; for view "transpose", whose rows are its stored columns, those columns."""
    piece = spec.pieces[group_rank]

    def indices(d: int) -> list[int]:
        return [i for start, n in piece[d] for i in range(start, start + n)]

    if spec.view == "transpose":
        return indices(1)
    if spec.view == "flatten":
        return indices(0)
    rows = [0]
    for d in range(len(spec.shape) - 1):  # the leading dims, row-major
        rows = [r * spec.shape[d] + i for r in rows for i in indices(d)]
    return rows


@functools.lru_cache(maxsize=256)
def group_pieces(shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple) -> tuple[Piece, ...]:
    """``held_piece`` of every rank of the flattened sharding axes (the non-Replicate ones, row-major
    in mesh order: a "pieces" group's local ranks). Cached: a model repeats a few (shape,
    placements) pairs, and a simulation asks for thousands of ranks."""
    axes = [a for a, pl in enumerate(placements) if not isinstance(pl, Replicate)]
    out = []
    for flat in range(math.prod(mesh_shape[a] for a in axes)):
        coordinate, rest = [0] * len(mesh_shape), flat
        for a in reversed(axes):
            coordinate[a], rest = rest % mesh_shape[a], rest // mesh_shape[a]
        out.append(held_piece(shape, mesh_shape, tuple(coordinate), placements))
    return tuple(out)


def flattened_key(mesh, placements) -> GroupKey:
    """The key of the group a "pieces" tensor travels in: the mesh axes that shard it (not
    Replicate), flattened in mesh order, one group per slice of the other axes. Named on the
    root mesh as ``group_key_for_mesh`` does (axes of the root that ``mesh`` lacks are other
    slices); the key's mesh is the root's ranks with the sharding axes moved last and flattened."""
    import torch as _torch

    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    root = root if root is not None else mesh
    root_names = root.mesh_dim_names or tuple(f"dim{i}" for i in range(root.ndim))
    if root is mesh or not set(names) <= set(root_names):
        root, root_names = mesh, names
    sharding = [root_names.index(names[a]) for a, pl in enumerate(placements) if not isinstance(pl, Replicate)]
    others = [a for a in range(len(root_names)) if a not in sharding]
    ranks = _torch.as_tensor(root.mesh).permute(*others, *sharding)
    size = math.prod(root.mesh.shape[a] for a in sharding)
    return GroupKey(mesh_ranks=tuple(ranks.flatten().tolist()), mesh_shape=(ranks.numel() // size, size),
                    axis_name="+".join(str(root_names[a]) for a in sharding), axis_index=1)


_FLAT_GROUPS: dict[GroupKey, dict[int, tuple[object, int]]] = {}


def flattened_group(key: GroupKey, create: bool = True) -> tuple[object, int]:
    """(ProcessGroup, this rank's index in it) of this rank's slice of a flattened key.

    A slice that is the whole world in rank order is the default group; otherwise every slice's
    group is made on first use, collectively (every rank enters every ``new_group`` call in the
    same order, as the optimizer does when it first plans on every rank) and kept. ``create=False``
    (a plan one rank may make alone, ``Muon.plan()``) makes none: (None, index) until a step has."""
    me = dist.get_rank()
    if key not in _FLAT_GROUPS:
        slices = key.axis_slices()
        if slices == [list(range(dist.get_world_size()))]:
            _FLAT_GROUPS[key] = {g: (dist.group.WORLD, g) for g in slices[0]}
        elif not create:
            return None, key.local_ranks()[me]
        else:
            mapping = {}
            for members in slices:
                if members != sorted(members):  # torch orders a group's ranks by global rank
                    raise ValueError(f"mesh axes {key.axis_name!r} hold ranks {members} out of rank order; "
                                     "muonlab needs each slice of the sharding axes in increasing rank order")
                pg = dist.new_group(members)
                for i, g in enumerate(members):
                    mapping[g] = (pg, i)
            _FLAT_GROUPS[key] = mapping
    return _FLAT_GROUPS[key][me]


def fused_row_layout(num_rows: int, num_fused: int, size: int) -> str:
    """How a fused bank of ``num_fused`` matrices stacked on dim 0 falls on ``size`` row shards.

    "whole": every matrix lies on one rank (no communication); "subgroup": each matrix spans
    exactly size / num_fused ranks with equal rows (a sub-group all-gather rebuilds it);
    "blocks": anything else (each matrix gathered on the rank holding most of it, and back).
    """
    rows = chunk_sizes(num_rows, size)
    starts = [sum(rows[:r]) for r in range(size)]
    M = num_rows // num_fused

    def rank_of(row):
        return max(r for r in range(size) if starts[r] <= row and rows[r])

    if all(rank_of(m * M) == rank_of((m + 1) * M - 1) for m in range(num_fused)):
        return "whole"
    if size % num_fused == 0 and M % (size // num_fused) == 0 and len(set(rows)) == 1:
        return "subgroup"
    return "blocks"


def matrix_spec(index: int, name: str, p: torch.Tensor, replicate_group=None, num_fused: int = 1,
                view: str = "", tp_slices: bool = True) -> MatrixSpec:
    """The layout of parameter ``p`` from its own metadata.

    ``replicate_group``: the process group a plain tensor is replicated over (None: not
    distributed, or a single rank). ``num_fused``: matrices stacked on dim 0 of a 2-D bank.
    ``view``: how ``p`` reads as matrices (default: ``default_view`` of its shape). ``tp_slices``:
    a bank whose TP ranks hold whole blocks (``tp_whole_blocks``) is planned as its TP slice over
    the FSDP axis alone; False keeps it on "pieces" (an update rule with per-row state: that state
    is laid out for "pieces", every row on every rank).
    """
    shape = tuple(p.shape)
    view = view or default_view(shape)
    check_view(name, shape, view, num_fused)
    within = tp_whole_blocks(p, num_fused) if tp_slices else None
    if within is not None:
        # each TP rank holds whole blocks (heads): its TP slice is a fused bank row-sharded over the
        # FSDP axis alone, planned as FSDP2's fused banks are (the TP ranks run alike, on other heads)
        fsdp_axis, tp = within
        shape = (shape[0] // tp, shape[1])
        layout, group, rows, _ = row_layout(group_key_for_mesh(p.device_mesh, fsdp_axis), shape, num_fused // tp, view)
        return MatrixSpec(index, name, shape, layout, group, rows, 0, num_fused // tp, view, str(p.dtype))
    if DTensor is not None and isinstance(p, DTensor) and is_pieces_placement(p.placements) \
            and not _one_rank_axis(p):
        # sharded on several mesh axes (tensor parallel with FSDP2), or by columns on one: what every
        # rank holds, from the global shape and placements alone
        key = flattened_key(p.device_mesh, p.placements)
        pieces = group_pieces(shape, tuple(p.device_mesh.mesh.shape), tuple(p.placements))
        return MatrixSpec(index, name, shape, "pieces", key, (), 0, num_fused, view, str(p.dtype), pieces)
    layout, group, rows, shard_dim = _layout(name, p, shape, replicate_group, num_fused, view)
    return MatrixSpec(index, name, shape, layout, group, rows, shard_dim, num_fused, view, str(p.dtype))


def tp_whole_blocks(p: torch.Tensor, num_fused: int) -> tuple[int, int] | None:
    """(FSDP2's mesh axis, the TP size) of a fused bank (``num_fused`` blocks of rows: heads, with
    ``split_heads``) that tensor parallelism splits column-wise into whole blocks per TP rank and FSDP2
    then shards within each TP slice: placements ``(_StridedShard(0, T), Shard(0))`` (other axes
    Replicate) with T dividing ``num_fused``. Else None.

    Such a rank's rows all belong to its TP slice's blocks, so those blocks' Newton-Schulz needs the
    FSDP axis only (``matrix_spec`` gives the slice's layout over it), never a TP peer."""
    if DTensor is None or not isinstance(p, DTensor) or num_fused < 2 or p.ndim != 2:
        return None
    sharded = [(a, pl) for a, pl in enumerate(p.placements) if not isinstance(pl, Replicate)]
    if len(sharded) != 2:
        return None
    (fsdp_axis, strided), (tp_axis, tp_shard) = sharded
    tp = p.device_mesh.mesh.shape[tp_axis]
    if not (isinstance(strided, _StridedShard) and strided.dim == 0 and strided.split_factor == tp
            and isinstance(tp_shard, Shard) and tp_shard.dim == 0 and num_fused % tp == 0):
        return None
    return fsdp_axis, tp


def row_layout(key: GroupKey, shape: tuple[int, ...], num_fused: int,
               view: str) -> tuple[str, GroupKey | None, tuple[int, ...], int]:
    """(layout, group, rows, shard dim) of a tensor of ``shape`` sharded ``Shard(0)`` over the axis ``key``."""
    if key.size == 1:  # a one-rank axis holds everything: nothing to move
        # on a bigger mesh (experts on a (1, ep) mesh) its group still says which ranks
        # hold such a matrix, each its own (all of them, not rank 0 alone, do its work)
        return "whole", (None if len(key.mesh_ranks) == 1 else key), (), 0
    rows = chunk_sizes(shape[0], key.size)
    if num_fused > 1:
        return fused_row_layout(shape[0], num_fused, key.size), key, rows, 0
    # a bank's dim 0 indexes whole matrices (experts); any other view's dim 0 is rows of its
    # one matrix, a flattened conv kernel's included
    return ("whole" if view == "bank" else "row_shard"), key, rows, 0


def is_pieces_placement(placements) -> bool:
    """Whether placements take layout "pieces": Shards or _StridedShards (the rest Replicate) on two or
    more mesh axes, or on one axis anything but Shard(0) (a row-wise Linear alone holds a column
    block per rank; owner compute moves it at the bound, where a padded full gather moved it whole to
    every rank). A one-rank axis leaves it whole (``matrix_spec``)."""
    sharded = [pl for pl in placements if not isinstance(pl, Replicate)]
    if not all(isinstance(pl, (Shard, _StridedShard)) for pl in sharded):
        return False  # Partial: refused by _layout
    return len(sharded) >= 2 or (len(sharded) == 1 and (isinstance(sharded[0], _StridedShard) or sharded[0].dim > 0))


def _one_rank_axis(p) -> bool:
    """Whether ``p`` is sharded by one Shard on a single mesh axis of one rank (which holds it whole)."""
    axes = [a for a, pl in enumerate(p.placements) if not isinstance(pl, Replicate)]
    return len(axes) == 1 and isinstance(p.placements[axes[0]], Shard) and p.device_mesh.mesh.shape[axes[0]] == 1


def _layout(name: str, p: torch.Tensor, shape: tuple[int, ...], replicate_group, num_fused: int,
            view: str) -> tuple[str, GroupKey | None, tuple[int, ...], int]:
    """(layout, group, rows, shard dim) of ``p`` on one axis or none: see the module docstring."""
    if DTensor is not None and isinstance(p, DTensor):
        mesh, placements = p.device_mesh, p.placements
        sharded = [(i, pl) for i, pl in enumerate(placements) if not isinstance(pl, Replicate)]
        if not sharded and mesh.ndim == 1:
            # replicated like DDP: each matrix gets one owner instead of redundant NS everywhere
            return "replicated", group_key_for_mesh(mesh, 0), (), 0
        if len(sharded) == 1 and isinstance(sharded[0][1], Shard):
            mesh_dim, dim = sharded[0][0], sharded[0][1].dim
            key = group_key_for_mesh(mesh, mesh_dim)
            assert dim == 0 or key.size == 1, "a single Shard(dim > 0) on a bigger axis takes layout pieces (matrix_spec)"
            return row_layout(key, shape, num_fused, view)
        raise ValueError(
            f"Muon parameter '{name}' of shape {shape} has placements {tuple(placements)} on mesh "
            f"{tuple(mesh.mesh.shape)}; supported: Shard(dim) or _StridedShard(dim) on one or more mesh "
            "axes (others Replicate), or Replicate on a 1-D mesh"
        )
    if replicate_group is not None and dist.get_world_size(replicate_group) > 1:
        return "replicated", group_key_for_pg(replicate_group), (), 0
    return "whole", None, (), 0


def process_group_for(p: torch.Tensor, spec: MatrixSpec, replicate_group, create: bool = True) -> tuple[object, int]:
    """(torch ProcessGroup, this rank's index in it) for a parameter's spec; ``create``: whether a
    flattened group not made yet may be made now (collectively: ``flattened_group``)."""
    if spec.group is None:
        return None, 0
    if spec.layout == "pieces":
        return flattened_group(spec.group, create)
    if DTensor is not None and isinstance(p, DTensor):
        mesh = p.device_mesh
        names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
        dim = names.index(spec.group.axis_name)
        return mesh.get_group(dim), mesh.get_local_rank(dim)
    return replicate_group, dist.get_group_rank(replicate_group, dist.get_rank())
