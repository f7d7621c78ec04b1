"""The plan of a Muon step as frozen records, and the one per-rank aggregation of them.

A ``BatchPlan`` is one batch of same-shape matrices moved and orthogonalized together; a ``Plan``
is the ordered batches of a step. The planner (``muonlab.comm.planner``) makes them, the engine
runs them, the cost model prices them, and viz, workers and tests read them through ``per_rank``,
``bytes_for_rank`` and ``table`` below. Per-rank tuples are indexed by GROUP-LOCAL rank (the
batch's ``GroupKey`` maps global ranks to them); the functions here do that mapping once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ..kernels.config import NSConfig
from .specs import GroupKey
from .wire import of_itemsize


@dataclass(frozen=True, kw_only=True)
class BatchPlan:
    """One batch of same-shape matrices moved and orthogonalized together."""

    index: int
    """Position in the plan's order (every rank runs batches in this order)."""
    path: str
    """Name of the communication path (a key of muonlab.comm.paths.PATHS)."""
    names: tuple[str, ...]
    param_indices: tuple[int, ...]
    """Position of each parameter in the optimizer's Muon parameter order."""
    matrix_shape: tuple[int, int]
    num_matrices: int
    group: GroupKey | None
    ns_config: NSConfig
    """The Newton-Schulz settings every matrix of the batch shares."""
    ranks: tuple[int, ...]
    """Group-local ranks that take part (send, receive or compute)."""
    owners: tuple[int, ...] = ()
    """Group-local rank that orthogonalizes each parameter of the batch (empty for local). A rank
    may own several (all_to_all and agrs gather all of a rank's matrices of a batch in one
    collective, orthogonalize them as one stack, and return them in one). On the blocks path: one
    per block, parameter by parameter (a fused bank's matrices may have different owners)."""
    bytes_sent: tuple[int, ...] = ()
    bytes_recv: tuple[int, ...] = ()
    flops: tuple[int, ...] = ()
    """Newton-Schulz FLOPs per group-local rank."""
    rows: tuple[int, ...] = ()
    """Sharded-dim entries per group-local rank (same for every parameter of the batch)."""
    param_shapes: tuple[tuple[int, ...], ...] = ()
    """Global shape of each parameter of the batch."""
    sources: tuple[tuple[int, ...], ...] = ()
    """Whole layouts: the group-local rank holding each matrix of each parameter."""
    pieces: tuple = ()
    """Layout "pieces": per parameter of the batch, what each group-local rank holds of it
    (``MatrixSpec.pieces``)."""
    moves: tuple[tuple[int, int, int, int], ...] = ()
    """Whole matrices moved for balance (rebalance path): (parameter position in the batch,
    matrix index in that parameter's group-wide matrices, source rank, owner rank)."""
    shard_dim: int = 0
    part: tuple[int, int] | None = None
    """(p, P): the batch holds part p of P of its one parameter's matrices (an expert bank whose
    matrices on a rank exceed the workspace budget): on every rank, run p of the P even runs
    (``part_range``) of the matrices that rank holds. ``param_shapes``, ``sources`` and ``moves``
    then describe the part's matrices alone. None: every matrix of each parameter."""
    notes: str = ""
    comm_itemsize: int = 2
    """Bytes per element on the wire (its wire dtype's itemsize, ``wire_dtype``) that
    ``bytes_sent``/``bytes_recv`` count: the lower bound of ``muonlab.simulate`` is counted at the
    same size. Per batch: under ``comm_dtype="auto"`` it follows the batch's Newton-Schulz dtype
    (``muonlab.comm.wire``)."""
    travels_with: int | None = None
    """Index of the first batch of its wave: the small batches of one wave travel in one collective
    per direction, issued together (``muonlab.comm.planner.coalesce``). None: it travels alone."""
    rule_sums: int = 0
    """fp32 numbers the batch's update rule adds across its group once it is back (NorMuon: two
    norms per matrix whose rows lie on several ranks, or a stored (in, out) matrix's column sums),
    in one all-reduce of its own (``muonlab.optim.rule_step.with_rule_sums``); 0: none."""
    buffer_bytes: tuple[int, ...] = ()
    """Bytes of the buffers the batch allocates per group-local rank over its life (send and
    receive buffers, stacked matrices, Newton-Schulz's output: ``muonlab.comm.memory``; a wave's
    combined buffers come on top, in ``memory.buffer_peaks``); empty where not planned."""

    @property
    def pays_latency(self) -> bool:
        """Whether its collectives are its own: alone, or the wave's first batch."""
        return self.travels_with is None or self.travels_with == self.index

    @property
    def wire_dtype(self) -> torch.dtype:
        """The dtype its matrices travel in (the engine's ``PathContext.wire_dtype``)."""
        return of_itemsize(self.comm_itemsize)

    @property
    def param_numels(self) -> tuple[int, ...]:
        return tuple(math.prod(s) for s in self.param_shapes)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_sent)

    def as_row(self) -> dict:
        return dict(batch=self.index, path=self.path, shape=self.matrix_shape, matrices=self.num_matrices,
                    names=", ".join(self.names), ranks=len(self.ranks),
                    max_bytes_sent=max(self.bytes_sent, default=0), total_bytes=self.total_bytes,
                    max_flops=max(self.flops, default=0), max_buffer_bytes=max(self.buffer_bytes, default=0),
                    notes=self.notes)


def part_range(held: int, part: tuple[int, int]) -> tuple[int, int]:
    """[lo, hi) of run p of P even runs over ``held`` matrices (``BatchPlan.part``); every rank
    cuts the matrices it holds this way, so the planner and the optimizer agree."""
    p, parts = part
    return held * p // parts, held * (p + 1) // parts


@dataclass(frozen=True)
class Plan:
    """The batches of one step, in the order every rank runs them."""

    batches: tuple[BatchPlan, ...] = ()

    def __iter__(self):
        return iter(self.batches)

    def __len__(self):
        return len(self.batches)

    def __getitem__(self, i: int) -> BatchPlan:
        return self.batches[i]

    def bytes_by_path(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for b in self.batches:
            out[b.path] = out.get(b.path, 0) + b.total_bytes
        return out

    def per_rank(self, world: int) -> dict[str, list[int]]:
        return per_rank(self.batches, world)

    def table(self) -> str:
        return table(self.batches)


def group_rank_maps(batches: Iterable[BatchPlan]) -> dict:
    """{GroupKey or None: {global rank: group-local rank}}; a plan has few groups, so map once."""
    maps: dict = {None: {0: 0}}
    for b in batches:
        if b.group not in maps:
            maps[b.group] = b.group.local_ranks()
    return maps


def per_rank(batches: Iterable[BatchPlan], world: int, *, by_path: bool = False) -> dict:
    """Newton-Schulz FLOPs, bytes sent and received per GLOBAL rank 0..world-1:
    {"flops", "sent", "recv": list}, or with ``by_path`` {path: that dict}.

    A group-local rank of an axis stands for every global rank at that index of the axis (one
    per slice of a bigger mesh), so each of them is charged its batch's entry. A ``world`` smaller
    than the plan's mesh is refused: the ranks past it would be left out of every total.
    """
    batches = list(batches)
    maps = group_rank_maps(batches)
    needed = _ranks_spanned(maps)
    if world < needed:
        raise ValueError(f"world={world} is smaller than the plan, which spans {needed} ranks (global ranks "
                         f"0..{needed - 1}): pass world >= {needed}")
    out: dict = {}
    for b in batches:
        key = b.path if by_path else None
        totals = out.setdefault(key, {"flops": [0] * world, "sent": [0] * world, "recv": [0] * world})
        for g, r in maps[b.group].items():
            if r >= len(b.flops):  # no entry for this rank (a batch without per-rank lists): nothing to charge
                continue
            totals["flops"][g] += b.flops[r]
            totals["sent"][g] += b.bytes_sent[r] if b.bytes_sent else 0
            totals["recv"][g] += b.bytes_recv[r] if b.bytes_recv else 0
    if by_path:
        return out
    return out.get(None, {"flops": [0] * world, "sent": [0] * world, "recv": [0] * world})


def _ranks_spanned(maps: dict) -> int:
    """Global ranks 0..n-1 that a plan's groups (``group_rank_maps``) span: n."""
    return 1 + max(g for ranks in maps.values() for g in ranks)


def flops_per_rank(batches: Iterable[BatchPlan]) -> list[int]:
    """Newton-Schulz FLOPs per GLOBAL rank over the ranks the plan spans (the planner's balance
    view: a dense group and an expert mesh's axis may cover the same ranks, so their group-local
    ranks can't be added up index by index)."""
    batches = list(batches)
    return per_rank(batches, _ranks_spanned(group_rank_maps(batches)))["flops"]


def bytes_for_rank(batches: Iterable[BatchPlan], rank: int) -> tuple[dict[str, int], dict[str, int]]:
    """What the plan says global ``rank`` sends and receives per path, leaving out paths that
    move nothing on it (as the collectives' counters do), e.g. to compare with
    ``Muon.last_step_stats()``."""
    batches = list(batches)
    maps = group_rank_maps(batches)
    sent: dict[str, int] = {}
    recv: dict[str, int] = {}
    for b in batches:
        if not b.bytes_sent:
            continue
        r = maps[b.group][rank] if b.group is not None else 0
        sent[b.path] = sent.get(b.path, 0) + b.bytes_sent[r]
        recv[b.path] = recv.get(b.path, 0) + b.bytes_recv[r]
    return {p: n for p, n in sent.items() if n}, {p: n for p, n in recv.items() if n}


def table(batches: Iterable[BatchPlan]) -> str:
    """A fixed-width text table of a plan, one row per batch."""
    head = f"{'#':>3} {'path':<11}{'shape':<13}{'mats':>5}{'ranks':>6}{'max sent B':>12}{'max NS GFLOP':>13}  names"
    lines = [head]
    for b in batches:
        r = b.as_row()
        lines.append(f"{r['batch']:>3} {r['path']:<11}{str(r['shape']):<13}{r['matrices']:>5}{r['ranks']:>6}"
                     f"{r['max_bytes_sent']:>12}{r['max_flops'] / 1e9:>13.4f}  {r['names']}")
    return "\n".join(lines)
