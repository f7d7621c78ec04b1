"""The optimizer step's buffer memory per rank: planned from the plan, counted by the engine.

What is counted: the buffers a batch's path allocates beyond its momentum inputs and holds while
the batch is in flight, at the places the engine sees them (muonlab.comm.engine):

- "start": what the batch has when its way out is issued (its send and receive buffers), or, on a
  path without one (local, owner), the matrices it hands to Newton-Schulz;
- "compute": after Newton-Schulz (the stacked matrices, Newton-Schulz's output, the way back's
  send and receive buffers, or the outputs of a batch without a way back);
- "finish": outputs the path makes after its way back (e.g. the blocks path's concatenations).

A buffer that is a view of the inputs or of a buffer already counted (a single matrix already in
the wire dtype is sent as it is) allocates nothing and counts nothing. A receive buffer counts
when its collective is issued. Every counted buffer is taken to live until the batch is applied
(a generator's locals do; a path that drops one earlier frees it earlier: an upper bound there);
temporaries made and freed inside one copy (a cast before a pad) are not counted. The
Newton-Schulz workspace (one arena, reused by every batch and kept between steps,
muonlab.kernels.workspace) is a separate term: at most ``workspace_bytes``.

Each path's formula lives in its module (``CommPath.buffer_bytes``); ``buffer_peaks`` replays
the engine's order of batches on the plan (the same order the engine runs, so the same batches
are in flight at once), and ``BufferCounter`` is what the engine counts into.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from .paths import PATHS
from .paths.base import Itemsizes, Phases
from .records import BatchPlan, group_rank_maps


def batch_buffers(batch: BatchPlan, sizes: Itemsizes) -> list[Phases]:
    """Per group-local rank, the bytes ``batch`` allocates at each phase (its path's formula)."""
    hook = PATHS[batch.path].buffer_bytes
    if hook is None:  # pragma: no cover - every registered path has one
        raise NotImplementedError(f"path {batch.path!r} has no buffer formula")
    return hook(batch, sizes)


def wave_extra(batch: BatchPlan, sizes: Itemsizes) -> list[tuple[int, int]]:
    """Per group-local rank, the (out, back) bytes a wave's combined buffers add for ``batch``: a
    wave's send and receive buffers hold every member's send and receive buffer again."""
    hook = PATHS[batch.path].wire_buffers
    return [((os + orc) * sizes.wire, (bs + br) * sizes.wire) for (os, orc), (bs, br) in hook(batch)]


def _runs(batches) -> list[list[int]]:
    """The engine's runs: a batch alone, or a wave's members (``execute_plan``)."""
    runs: list[list[int]] = []
    for i, b in enumerate(batches):
        if b.travels_with is not None and not b.pays_latency:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def engine_order(batches) -> list[tuple[str, int]]:
    """("start" | "compute" | "finish", run) in the order ``execute_plan`` calls them."""
    runs = _runs(batches)
    ops: list[tuple[str, int]] = [("start", 0)] if runs else []
    started = {0}
    for i in range(len(runs)):
        nxt = i + 1 if i + 1 < len(runs) else None
        if nxt is not None and PATHS[batches[runs[nxt][0]].path].out_share > 0:
            ops.append(("start", nxt))
            started.add(nxt)
        ops.append(("compute", i))
        if i >= 1:
            ops.append(("finish", i - 1))
        if nxt is not None and nxt not in started:
            ops.append(("start", nxt))
            started.add(nxt)
    if runs:
        ops.append(("finish", len(runs) - 1))
    return ops


@dataclass
class RankMemory:
    """One rank's planned buffer bytes over a step."""

    peak: int = 0
    """The most bytes held at once by the batches in flight (their counted buffers)."""
    peak_batches: tuple[int, ...] = ()
    """The batches in flight at that moment."""
    by_batch: dict[int, int] = field(default_factory=dict)
    """Each batch's bytes over its life (batches allocating nothing here left out)."""


def buffer_peaks(batches, world: int, itemsizes) -> list[RankMemory]:
    """Per GLOBAL rank 0..world-1, the planned buffer bytes of a step running ``batches`` in the
    engine's order. ``itemsizes(batch)``: its ``Itemsizes``. A group-local rank of an axis stands
    for every global rank at that index (as ``records.per_rank`` charges them)."""
    batches = list(batches)
    maps = group_rank_maps(batches)
    runs = _runs(batches)
    # per batch: {global rank: Phases}, only ranks where it allocates something
    phases: list[dict[int, Phases]] = []
    extra: list[dict[int, tuple[int, int]]] = []
    for b in batches:
        sizes = itemsizes(b)
        per_local = batch_buffers(b, sizes)
        wave = wave_extra(b, sizes) if b.travels_with is not None else None
        got, more = {}, {}
        for g, r in maps[b.group].items():
            if g >= world or r >= len(per_local):
                continue
            if any(per_local[r][:2]) or per_local[r].finish:
                got[g] = per_local[r]
            if wave is not None and any(wave[r]):
                more[g] = wave[r]
        phases.append(got)
        extra.append(more)
    out = [RankMemory() for _ in range(world)]
    touched = sorted({g for d in phases for g in d} | {g for d in extra for g in d})
    ops = engine_order(batches)
    for g in touched:
        mem = out[g]
        live: dict[int, int] = {}  # run -> bytes held

        def hold(run: int, nbytes: int) -> None:
            if nbytes:
                live[run] = live.get(run, 0) + nbytes
                total = sum(live.values())
                if total > mem.peak:
                    mem.peak, mem.peak_batches = total, tuple(batches[runs[k][0]].index for k in sorted(live))
        for op, k in ops:
            members = runs[k]
            if op == "start":
                for i in members:
                    hold(k, phases[i].get(g, Phases()).start)
                hold(k, sum(extra[i].get(g, (0, 0))[0] for i in members))
            elif op == "compute":
                applied = True
                for i in members:
                    p = phases[i].get(g, Phases(finish=None if not _way_back(batches[i]) else 0))
                    hold(k, p.compute)
                    applied = applied and p.finish is None
                hold(k, sum(extra[i].get(g, (0, 0))[1] for i in members))
                if applied:
                    live.pop(k, None)
            else:
                for i in members:
                    hold(k, phases[i].get(g, Phases()).finish or 0)
                live.pop(k, None)
        for i, d in enumerate(phases):
            p = d.get(g)
            total = (p.start + p.compute + (p.finish or 0)) if p else 0
            total += sum(extra[i].get(g, (0, 0)))
            if total:
                mem.by_batch[batches[i].index] = total
    return out


def _way_back(batch: BatchPlan) -> bool:
    """Whether the batch's path has a way back (else the engine applies it at its compute)."""
    path = PATHS[batch.path]
    return path.collectives > (1 if path.out_share > 0 else 0)


class BufferCounter:
    """What the engine counts on this rank over one step: bytes of the buffers each batch
    allocates (a tensor counts once per storage, and not when it is a view of the batch's
    inputs or of a buffer it already counted), the bytes held by the batches in flight, and
    their most at once (``peak``)."""

    def __init__(self):
        self.by_batch: dict[int, int] = {}
        self.peak = 0
        self.peak_batches: tuple[int, ...] = ()
        self._live: dict[object, int] = {}  # run -> bytes held
        self._known: dict[object, dict[int, weakref.ref]] = {}  # run -> {storage address: its storage}

    def know(self, run, tensors) -> None:
        """Storages of ``run`` that are not its allocations (its inputs)."""
        known = self._known.setdefault(run, {})
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.numel():
                s = t.untyped_storage()
                known[s.data_ptr()] = weakref.ref(s)

    def count(self, run, index: int, tensors) -> None:
        """Count the new storages among ``tensors`` (a tensor, a list, None) as ``run``'s, for
        batch ``index``."""
        if tensors is None:
            return
        if isinstance(tensors, torch.Tensor):
            tensors = (tensors,)
        known = self._known.setdefault(run, {})
        nbytes = 0
        for t in tensors:
            if not isinstance(t, torch.Tensor) or not t.numel():
                continue
            s = t.untyped_storage()
            ref = known.get(s.data_ptr())
            if ref is not None and ref() is not None:  # a view of something held: no allocation
                continue
            known[s.data_ptr()] = weakref.ref(s)
            nbytes += s.nbytes()
        self.add(run, index, nbytes)

    def add(self, run, index: int, nbytes: int) -> None:
        """``nbytes`` more held by ``run`` (batch ``index``'s)."""
        if not nbytes:
            return
        self.by_batch[index] = self.by_batch.get(index, 0) + nbytes
        self._live[run] = self._live.get(run, 0) + nbytes
        total = sum(self._live.values())
        if total > self.peak:
            self.peak = total
            self.peak_batches = tuple(sorted(min(r.indices) for r in self._live))

    def release(self, run) -> None:
        """``run`` was applied: its buffers are gone."""
        self._live.pop(run, None)
        self._known.pop(run, None)


def workspace_bound(batches, budget_bytes: int, per_matrix) -> int:
    """The Newton-Schulz workspace's most bytes: the runner cuts every call to fit
    ``budget_bytes``, but takes one matrix whatever its size (``per_matrix(batch)``: one matrix's
    bytes in a call, ``muonlab.kernels.workspace.batch_bytes_per_matrix``)."""
    return max([budget_bytes, *(per_matrix(b) for b in batches)])


@dataclass(frozen=True)
class PlanMemory:
    """A plan's memory per rank for one optimizer step: the buffers of the batches in flight at
    their most (``RankMemory``, per global rank) and the Newton-Schulz workspace's bound."""

    ranks: tuple[RankMemory, ...]
    workspace: int
    batches: tuple[BatchPlan, ...] = ()
    state: int | None = None
    """This rank's Muon state held between steps (momentum where it lives here, the update rule's
    state), apart from the step's peak: it exists before and after the step. None: not planned."""

    def peak(self, rank: int) -> int:
        """Planned step bytes of ``rank``: its buffers' peak plus the workspace."""
        return self.ranks[rank].peak + self.workspace

    @property
    def worst_rank(self) -> int:
        return max(range(len(self.ranks)), key=lambda g: self.ranks[g].peak, default=0)

    def rows(self) -> list[dict]:
        """One dict per global rank: its buffers' peak, the batches then in flight, the workspace
        bound and their sum (the step's peak), and its largest batch."""
        out = []
        for g, mem in enumerate(self.ranks):
            top = max(mem.by_batch, key=mem.by_batch.get, default=None)
            out.append(dict(rank=g, buffer_peak=mem.peak, in_flight=mem.peak_batches, workspace=self.workspace,
                            step_peak=self.peak(g), largest_batch=top, largest_batch_bytes=mem.by_batch.get(top, 0)))
        return out

    def largest_buffer(self) -> tuple[int, int, int]:
        """(bytes, batch index, global rank) of the batch holding the most bytes on one rank."""
        best = (0, -1, -1)
        for g, mem in enumerate(self.ranks):
            for i, n in mem.by_batch.items():
                best = max(best, (n, i, g))
        return best

    def describe(self, index: int) -> str:
        """A batch in words: its path, matrix shape and parameters."""
        for b in self.batches:
            if b.index == index:
                names = ", ".join(b.names[:3]) + (f" and {len(b.names) - 3} more" if len(b.names) > 3 else "")
                return f"batch {index} ({b.path}, {b.num_matrices} x {b.matrix_shape}: {names})"
        return f"batch {index}"


def plan_memory(batches, world: int, itemsizes, budget_bytes: int, per_matrix) -> PlanMemory:
    """``buffer_peaks`` and ``workspace_bound`` of a plan, as one ``PlanMemory``."""
    batches = tuple(batches)
    return PlanMemory(tuple(buffer_peaks(batches, world, itemsizes)),
                      workspace_bound(batches, budget_bytes, per_matrix), batches)


def with_buffer_bytes(batches, itemsizes) -> list[BatchPlan]:
    """The batches with ``BatchPlan.buffer_bytes``: per group-local rank, its own buffers' bytes (a
    wave's combined buffers, which ``buffer_peaks`` adds, left out: a batch is the same in a wave)."""
    from dataclasses import replace

    out = []
    for b in batches:
        total = [p.start + p.compute + (p.finish or 0) for p in batch_buffers(b, itemsizes(b))]
        out.append(replace(b, buffer_bytes=tuple(total)))
    return out


def over_budget(memory: PlanMemory, budget: int) -> str | None:
    """Why ``memory`` exceeds ``budget`` bytes per rank (None: it fits): the rank, its peak, the
    batches in flight then and the largest of them."""
    g = memory.worst_rank
    if not memory.ranks or memory.peak(g) <= budget:
        return None
    mem = memory.ranks[g]
    if mem.peak_batches:
        largest = max(mem.peak_batches, key=lambda i: mem.by_batch.get(i, 0))
        held = (f"buffers {mem.peak} bytes while batches {list(mem.peak_batches)} are in flight, the largest "
                f"{memory.describe(largest)} with {mem.by_batch.get(largest, 0)} bytes")
    else:  # nothing moves: the workspace is the step's memory, and the largest batch fills it
        largest = max(memory.batches, key=lambda b: b.num_matrices * b.matrix_shape[0] * b.matrix_shape[1],
                      default=None)
        held = "no communication buffers" + (f"; the largest Newton-Schulz call is {memory.describe(largest.index)}"
                                             if largest is not None else "")
    return (f"the plan's optimizer step needs {memory.peak(g)} bytes on rank {g} ({held}; Newton-Schulz workspace "
            f"{memory.workspace} bytes), over memory_budget={budget}")
