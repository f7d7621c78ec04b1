"""The plan of a Muon step: which matrices go together, on which path, at what cost.

``plan_batches`` reads only ``MatrixSpec`` metadata (global shapes, layouts, group sizes), so every
rank computes the same plan, and a simulation at thousands of ranks runs the very same function.
Bytes are the logical bytes that leave (``bytes_sent``) and enter (``bytes_recv``) each rank, in
the wire dtype, excluding a rank's copy to itself; the collectives count the same at the call.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace

from ..kernels.newton_schulz import ns_flops
from .layout import GroupKey, MatrixSpec

PATHS = ("local", "rebalance", "all_to_all", "agrs", "subgroup", "owner", "gather_all")
REMAINDER_PATHS = ("auto", "all_to_all", "agrs")
# "muonlab": the planner below. "redundant": the baseline every distributed Muon is measured
# against, in which every rank gathers and orthogonalizes every matrix.
STRATEGIES = ("muonlab", "redundant")


@dataclass
class BatchPlan:
    """One batch of same-shape matrices moved and orthogonalized together."""

    index: int
    path: str
    names: tuple[str, ...]
    param_indices: tuple[int, ...]
    matrix_shape: tuple[int, int]
    num_matrices: int
    group: GroupKey | None
    ns_key: Hashable
    ranks: tuple[int, ...]
    """Group-local ranks that take part (send, receive or compute)."""
    owners: tuple[int, ...] = ()
    """Group-local rank that orthogonalizes each parameter of the batch (empty for local)."""
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
    moves: tuple[tuple[int, int, int, int], ...] = ()
    """Whole matrices moved for balance (rebalance path): (parameter position in the batch,
    matrix index in that parameter's group-wide matrices, source rank, owner rank)."""
    shard_dim: int = 0
    notes: str = ""

    @property
    def param_numels(self) -> tuple[int, ...]:
        return tuple(_numel(s) for s in self.param_shapes)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_sent)

    def as_row(self) -> dict:
        return dict(batch=self.index, path=self.path, shape=self.matrix_shape, matrices=self.num_matrices,
                    names=", ".join(self.names), ranks=len(self.ranks),
                    max_bytes_sent=max(self.bytes_sent, default=0), total_bytes=self.total_bytes,
                    max_flops=max(self.flops, default=0), notes=self.notes)


@dataclass
class Plan:
    batches: list[BatchPlan] = field(default_factory=list)

    def __iter__(self):
        return iter(self.batches)

    def __len__(self):
        return len(self.batches)

    def bytes_by_path(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for b in self.batches:
            out[b.path] = out.get(b.path, 0) + b.total_bytes
        return out

    def per_rank(self, world: int) -> dict[str, list[int]]:
        """Newton-Schulz FLOPs, bytes sent and received per GLOBAL rank 0..world-1."""
        out = {"flops": _zeros(world), "sent": _zeros(world), "recv": _zeros(world)}
        index: dict = {None: {0: 0}}
        for b in self.batches:
            if b.group not in index:
                index[b.group] = b.group.local_ranks()
            for g, r in index[b.group].items():
                if g >= world or r >= len(b.flops):
                    continue
                out["flops"][g] += b.flops[r]
                out["sent"][g] += b.bytes_sent[r] if b.bytes_sent else 0
                out["recv"][g] += b.bytes_recv[r] if b.bytes_recv else 0
        return out

    def flops_per_rank(self) -> list[int]:
        size = max((b.group.size if b.group else 1) for b in self.batches) if self.batches else 1
        out = [0] * size
        for b in self.batches:
            for r, f in enumerate(b.flops):
                out[r] += f
        return out

    def table(self) -> str:
        head = f"{'#':>3} {'path':<11}{'shape':<13}{'mats':>5}{'ranks':>6}{'max sent B':>12}{'max NS GFLOP':>13}  names"
        lines = [head]
        for b in self.batches:
            r = b.as_row()
            lines.append(f"{r['batch']:>3} {r['path']:<11}{str(r['shape']):<13}{r['matrices']:>5}{r['ranks']:>6}"
                         f"{r['max_bytes_sent']:>12}{r['max_flops'] / 1e9:>13.4f}  {r['names']}")
        return "\n".join(lines)


def _zeros(n: int) -> list[int]:
    return [0] * n


def _all_to_all_bytes(rows: Sequence[int], cols: int, owners: Sequence[int], itemsize: int):
    """Out: each rank sends its rows of matrix i to owner i; back: owner i returns each rank's rows.

    With chunk_q = rows[q] * cols * itemsize, T = sum of chunks and K distinct owners, rank q sends
    chunk_q to every owner but itself on the way out, and an owner sends T - chunk_o back (and
    receives as much on the way out): closed forms, so a 2048-rank batch costs O(W).
    """
    owned = set(owners)
    chunks = [r * cols * itemsize for r in rows]
    total, k = sum(chunks), len(owned)
    sent = [c * (k - (q in owned)) + ((total - c) if q in owned else 0) for q, c in enumerate(chunks)]
    return sent, list(sent)


def _agrs_bytes(rows: Sequence[int], cols: int, owners: Sequence[int], itemsize: int):
    """Out: all-gather of every rank's rows of all k matrices; back: as all_to_all."""
    size, k = len(rows), len(owners)
    owned = set(owners)
    chunks = [r * cols * itemsize for r in rows]
    total = sum(chunks)
    sent = [(size - 1) * k * c for c in chunks]
    recv = [k * (total - c) for c in chunks]
    for q, c in enumerate(chunks):  # the way back: owners return each rank its rows
        if q in owned:
            sent[q] += total - c
        recv[q] += c * (len(owned) - (q in owned))
    return sent, recv


def _gather_bytes(payload: Sequence[int]):
    """An all-gather where rank q contributes payload[q] bytes."""
    size, total = len(payload), sum(payload)
    return [(size - 1) * p for p in payload], [total - p for p in payload]


class _RankLoads:
    """Newton-Schulz FLOPs per GLOBAL rank, seen through any group.

    Two groups may cover the same ranks (a dense "dp" mesh and an expert ("fsdp", "ep") mesh over
    one world), so balance is kept per global rank, not per group. A group-local rank r stands
    for every global rank at index r of the group's axis (one per slice of a bigger mesh); its
    load is the largest of theirs, and work given to r lands on all of them.
    """

    def __init__(self):
        self.by_rank: dict[int, int] = {}
        self._members: dict[GroupKey | None, list[list[int]]] = {}

    def view(self, group: GroupKey | None) -> "_GroupLoad":
        if group not in self._members:
            if group is None:
                self._members[group] = [[0]]
            else:
                members: list[list[int]] = [[] for _ in range(group.size)]
                for g, r in group.local_ranks().items():
                    members[r].append(g)
                self._members[group] = members
        return _GroupLoad(self, self._members[group])


class _GroupLoad:
    """One group's view of the loads: a snapshot taken when the view is made, kept current by
    its own ``add`` (a rank's members are disjoint from the other ranks' of the same group). Take
    a fresh view after adding through another group's view."""

    def __init__(self, loads: _RankLoads, members: list[list[int]]):
        self.loads, self.members = loads, members
        self.values = [max(loads.by_rank.get(g, 0) for g in m) for m in members]

    def __len__(self):
        return len(self.values)

    def __getitem__(self, r: int) -> int:
        return self.values[r]

    def __iter__(self):
        return iter(list(self.values))

    def add(self, r: int, flops: int) -> None:
        self.values[r] += flops
        for g in self.members[r]:
            self.loads.by_rank[g] = self.loads.by_rank.get(g, 0) + flops


def _least_loaded(load, candidates: Sequence[int], prefer: Sequence[int] | None = None) -> int:
    # ties go to the rank holding more rows (fewer bytes move), then the lowest rank
    return min(candidates, key=lambda r: (load[r], -(prefer[r] if prefer else 0), r))


def plan_batches(
    specs: Sequence[MatrixSpec],
    ns_keys: Sequence[Hashable],
    *,
    comm_itemsize: int = 2,
    ns_steps: Callable[[Hashable], int] = lambda key: 5,
    ns_form: str = "plain",
    remainder_path: str = "auto",
    strategy: str = "muonlab",
    profile=None,
    row_assignment: str = "best",
    rebalance: bool | None = None,
) -> Plan:
    """Group matrices into batches and give each a path, owners, bytes and FLOPs.

    Args:
        specs: one MatrixSpec per Muon parameter, in the optimizer's order (same on every rank).
        ns_keys: Newton-Schulz settings per parameter; only equal keys share a batch.
        comm_itemsize: bytes per element on the wire (2 for bf16, 4 for fp32).
        ns_steps: iterations for a key (FLOP counts).
        remainder_path: path of a row-sharded batch with fewer matrices than ranks; "auto"
            takes whichever of all_to_all and agrs has the lower modelled time under ``profile``.
        strategy: "muonlab" or "redundant" (see STRATEGIES).
        profile: a cost.HardwareProfile or its name (default "cpu_gloo"), for "auto" and "best".
        row_assignment: "best", "structured" or "lpt": how row-sharded matrices get owners.
        rebalance: move whole matrices off overloaded ranks (None: plan both ways under "best").
    """
    from .cost import batch_seconds, get_profile, step_seconds

    profile = get_profile(profile or "cpu_gloo")
    if row_assignment == "best":
        def flops_of_spec(spec):
            return ns_flops(spec.matrix_shape, ns_steps(ns_keys[specs.index(spec)]), form=ns_form)

        moves = (True, False) if rebalance is None else (rebalance,)
        options = [plan_batches(specs, ns_keys, comm_itemsize=comm_itemsize, ns_steps=ns_steps, ns_form=ns_form,
                                remainder_path=remainder_path, strategy=strategy, profile=profile,
                                row_assignment=rule, rebalance=move)
                   for rule in ("structured", "capped", "lpt") for move in moves]
        return min(options, key=lambda p: (max(_imbalance(p, specs, flops_of_spec), 1.1), step_seconds(p, profile)))
    if row_assignment not in ("structured", "capped", "lpt"):
        raise ValueError(f"row_assignment must be 'best', 'structured', 'capped' or 'lpt', got {row_assignment!r}")
    if remainder_path not in REMAINDER_PATHS:
        raise ValueError(f"remainder_path must be one of {REMAINDER_PATHS}, got {remainder_path!r}")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if strategy == "redundant":
        specs = [_redundant(s) for s in specs]
    # same group, layout, matrix shape and NS settings -> one bucket, in first-seen order
    buckets: dict[tuple, list[int]] = {}
    for i, (spec, key) in enumerate(zip(specs, ns_keys)):
        buckets.setdefault((spec.group, spec.layout, spec.matrix_shape, key), []).append(i)

    plan = Plan()
    loads = _RankLoads()

    flops_cache: dict[int, int] = {}

    def flops_of(i: int) -> int:
        if i not in flops_cache:
            flops_cache[i] = ns_flops(specs[i].matrix_shape, ns_steps(ns_keys[i]), form=ns_form)
        return flops_cache[i]

    def make(path, idx, group, key, ranks, owners=(), sent=(), recv=(), flops=(), notes=""):
        return BatchPlan(
            index=len(plan.batches), path=path, names=tuple(specs[i].name for i in idx),
            param_indices=tuple(specs[i].index for i in idx), matrix_shape=specs[idx[0]].matrix_shape,
            num_matrices=sum(specs[i].num_matrices for i in idx), group=group, ns_key=key,
            ranks=tuple(ranks), owners=tuple(owners), bytes_sent=tuple(sent), bytes_recv=tuple(recv),
            flops=tuple(flops), rows=specs[idx[0]].rows, param_shapes=tuple(specs[i].shape for i in idx),
            shard_dim=specs[idx[0]].shard_dim, notes=notes)

    def add(*args, **kwargs):
        plan.batches.append(make(*args, **kwargs))

    row_sharded = []  # (group, key, indices) of row-sharded buckets
    whole = []  # (group, key, indices) of buckets whose matrices are whole where they lie
    replicated: dict[GroupKey, list[tuple]] = {}
    for (group, layout, shape, key), idx in buckets.items():
        size = group.size if group else 1
        load = loads.view(group)
        if layout == "whole":
            per_matrix = flops_of(idx[0])
            for i in idx:
                for r, count in Counter(specs[i].matrix_sources()).items():
                    load.add(r, count * per_matrix)
            whole.append((group, key, idx))
        elif layout == "row_shard":
            row_sharded.append((group, key, idx))
        elif layout == "subgroup":
            # each of the E experts spans k = W / E ranks; every rank all-gathers its expert within
            # its sub-group and orthogonalizes it (the k ranks of a sub-group compute the same one)
            k = size // specs[idx[0]].num_fused
            rows = specs[idx[0]].rows
            per_rank = [(k - 1) * rows[r] * shape[1] * comm_itemsize * len(idx) for r in range(size)]
            flops = [flops_of(idx[0]) * len(idx)] * size
            for r in range(size):
                load.add(r, flops[r])
            add("subgroup", idx, group, key, range(size), sent=per_rank, recv=per_rank, flops=flops,
                notes=f"sub-groups of {k} ranks rebuild one expert each")
        elif layout == "replicated":
            replicated.setdefault(group, []).extend((i, key) for i in idx)
        elif layout == "gather_all":
            for i in idx:
                spec = specs[i]
                dim_size = spec.shape[spec.shard_dim]
                padded = -(-dim_size // size) * (_numel(spec.shape) // max(dim_size, 1)) * comm_itemsize
                sent, recv = _gather_bytes([padded] * size)
                add("gather_all", [i], group, key, range(size), sent=sent, recv=recv,
                    flops=[flops_of(i) * spec.num_matrices] * size,
                    notes=f"fallback for Shard({spec.shard_dim}): padded all-gather, every rank computes it")
        else:  # pragma: no cover - MatrixSpec validates layouts
            raise AssertionError(layout)

    # Row-sharded matrices get one owner each, by one of two rules (``row_assignment``):
    #   "structured": each (shape, settings) bucket in rounds of W, one matrix per rank (balanced
    #                 batch by batch, fewest collectives); each bucket's leftovers on distinct,
    #                 least-loaded ranks (one remainder batch per bucket);
    #   "capped":     as structured, but no rank goes past the LPT makespan: a bucket whose
    #                 leftovers don't fit on distinct ranks under it takes a second round;
    #   "lpt":        every matrix of the group, largest first, to the least-loaded rank (max-rank
    #                 FLOPs <= 4/3 of the optimum, but more, smaller batches).
    # "best" plans both and keeps the lower modelled time. Then each bucket is packed into batches
    # in which every owner appears once: W matrices make a full all_to_all batch (each rank receives
    # one whole matrix), fewer a remainder batch on ``remainder_path``.
    by_group: dict[GroupKey, list[tuple[int, Hashable]]] = {}
    for group, key, idx in row_sharded:
        by_group.setdefault(group, []).extend((i, key) for i in idx)
    for group, items in by_group.items():
        size, load = group.size, loads.view(group)
        owner_of = {}
        free = items
        if row_assignment in ("structured", "capped"):
            free = []
            buckets_of: dict[tuple, list[int]] = {}
            for i, key in items:
                buckets_of.setdefault((specs[i].matrix_shape, key), []).append(i)
            leftovers = []
            for (_, key), idx in buckets_of.items():
                full = len(idx) - len(idx) % size
                for pos, i in enumerate(idx[:full]):
                    owner_of[i] = pos % size
                    load.add(pos % size, flops_of(i))
                if full < len(idx):
                    leftovers.append(idx[full:])
            # each bucket's leftovers on distinct ranks (one remainder batch), largest buckets first;
            # "capped" keeps every rank under the LPT makespan, opening another round if needed
            cap = _lpt_makespan(list(load), [flops_of(i) for idx in leftovers for i in idx])
            for idx in sorted(leftovers, key=lambda idx: (-flops_of(idx[0]), idx[0])):
                taken: set[int] = set()
                for i in idx:
                    f = flops_of(i)
                    candidates = [r for r in range(size) if r not in taken]
                    if row_assignment == "capped":
                        under = [r for r in candidates if load[r] + f <= cap]
                        if not under:  # this round is full: start the next one
                            taken.clear()
                            under = [r for r in range(size) if load[r] + f <= cap] or list(range(size))
                        candidates = under
                    o = _least_loaded(load, candidates, specs[i].rows)
                    taken.add(o)
                    owner_of[i] = o
                    load.add(o, flops_of(i))
        for i, _ in sorted(free, key=lambda t: (-flops_of(t[0]), t[0])):
            o = _least_loaded(load, range(size), specs[i].rows)
            owner_of[i] = o
            load.add(o, flops_of(i))
        sub_batches: dict[tuple, list[list[int]]] = {}
        for i, key in items:
            batches = sub_batches.setdefault((specs[i].matrix_shape, key), [])
            free = next((b for b in batches if owner_of[i] not in {owner_of[j] for j in b}), None)
            if free is None:
                batches.append([i])
            else:
                free.append(i)
        for (shape, key), batches in sub_batches.items():
            for idx in batches:
                rows = specs[idx[0]].rows
                owners = [owner_of[i] for i in idx]
                flops = _zeros(size)
                for i, o in zip(idx, owners):
                    flops[o] += flops_of(i)
                if len(idx) == size:
                    candidates, notes = ["all_to_all"], ""
                else:
                    candidates = ["all_to_all", "agrs"] if remainder_path == "auto" else [remainder_path]
                    notes = f"remainder: {len(idx)} < {size} matrices"
                options = []
                for path in candidates:
                    bytes_fn = _agrs_bytes if path == "agrs" else _all_to_all_bytes
                    sent, recv = bytes_fn(rows, shape[1], owners, comm_itemsize)
                    options.append(make(path, idx, group, key, range(size), owners, sent, recv, flops, notes))
                plan.batches.append(min(options, key=lambda b: batch_seconds(b, profile)))

    _plan_whole(whole, specs, loads, flops_of, make, plan, comm_itemsize, rebalance is not False)

    # Replicated (DDP): each parameter gets one owner, by LPT over the whole group.
    for group, items in replicated.items():
        size = group.size
        load = loads.view(group)
        cost = {i: flops_of(i) * specs[i].num_matrices for i, _ in items}
        owner_of = {}
        for i, _ in sorted(items, key=lambda t: (-cost[t[0]], t[0])):
            o = _least_loaded(load, range(size))
            owner_of[i] = o
            load.add(o, cost[i])
        by_shape: dict[tuple, list[int]] = {}
        for i, key in items:
            by_shape.setdefault((specs[i].matrix_shape, key), []).append(i)
        for (shape, key), idx in by_shape.items():
            payload = _zeros(size)
            flops = _zeros(size)
            for i in idx:
                payload[owner_of[i]] += specs[i].num_matrices * shape[0] * shape[1] * comm_itemsize
                flops[owner_of[i]] += cost[i]
            sent, recv = _gather_bytes(payload)
            add("owner", idx, group, key, range(size), [owner_of[i] for i in idx], sent, recv, flops)
    # Order: batches that move nothing first (they compute while the first transfer travels), then
    # the heaviest compute first (more time to hide the transfers queued behind it). The order is
    # a function of the plan alone, so every rank runs the same sequence.
    plan.batches.sort(key=lambda b: (b.total_bytes > 0, -max(b.flops, default=0)))
    for n, b in enumerate(plan.batches):
        b.index = n
    return plan


def _lpt_makespan(loads: list[int], work: list[int]) -> int:
    """Largest load after placing ``work`` largest first on the least-loaded of ``loads``."""
    heap = [(x, r) for r, x in enumerate(loads)]
    heapq.heapify(heap)
    for f in sorted(work, reverse=True):
        x, r = heapq.heappop(heap)
        heapq.heappush(heap, (x + f, r))
    return max(x for x, _ in heap) if heap else 0


def _imbalance(plan: Plan, specs, flops_of_spec) -> float:
    """Max-rank FLOPs / max(mean, largest single matrix), per group-local rank."""
    loads = plan.flops_per_rank()
    largest = max((flops_of_spec(s) for s in specs), default=0)
    target = max(sum(loads) / max(len(loads), 1), largest) or 1
    return max(loads, default=0) / target


def _plan_whole(whole, specs, loads, flops_of, make, plan, comm_itemsize, rebalance):
    """Whole matrices stay where they lie unless their rank is overloaded; then the largest ones
    move to the least-loaded ranks (path "rebalance": out to the owner and back), until no rank
    exceeds what an LPT placement would reach. Experts of a MoE layer sharded over more ranks than
    experts would otherwise leave most ranks idle."""
    by_group: dict = {}
    for group, key, idx in whole:
        by_group.setdefault(group, []).append((key, idx))
    for group, buckets in by_group.items():
        size = group.size if group else 1
        load = loads.view(group)
        sources = {i: specs[i].matrix_sources() for _, idx in buckets for i in idx}
        items = [(i, j, src) for _, idx in buckets for i in idx for j, src in enumerate(sources[i])]
        # the target: the makespan LPT reaches placing these matrices freely on top of the rest
        base = list(load)
        for i, _, src in items:
            base[src] -= flops_of(i)
        heap = [(b, r) for r, b in enumerate(base)]
        heapq.heapify(heap)
        for i, _, _ in sorted(items, key=lambda t: -flops_of(t[0])):
            b, r = heapq.heappop(heap)
            heapq.heappush(heap, (b + flops_of(i), r))
        cap = max(b for b, _ in heap)
        owner = {(i, j): src for i, j, src in items}
        # least-loaded rank by a heap with lazy deletion: an entry is current if it matches the load
        heap = [(load[r], r) for r in range(size)]
        heapq.heapify(heap)
        for i, j, src in [] if not rebalance else sorted(items, key=lambda t: (-flops_of(t[0]), t[0], t[1])):
            f = flops_of(i)
            if load[src] <= cap:
                continue
            while heap[0][0] != load[heap[0][1]]:
                heapq.heappop(heap)
            target = heap[0][1]
            if load[target] + f <= cap:
                owner[(i, j)] = target
                load.add(src, -f)
                load.add(target, f)
                heapq.heappush(heap, (load[src], src))
                heapq.heappush(heap, (load[target], target))
        for key, idx in buckets:
            moves, flops = [], _zeros(size)
            sent, recv = _zeros(size), _zeros(size)
            for pos, i in enumerate(idx):
                A, B = specs[i].matrix_shape
                for j, src in enumerate(sources[i]):
                    o = owner[(i, j)]
                    flops[o] += flops_of(i)
                    if o != src:
                        moves.append((pos, j, src, o))
                        nbytes = A * B * comm_itemsize
                        sent[src] += nbytes
                        recv[o] += nbytes
                        sent[o] += nbytes
                        recv[src] += nbytes
            path = "rebalance" if moves else "local"
            batch = make(path, idx, group, key, [r for r in range(size) if flops[r]] or [0], sent=sent,
                         recv=recv, flops=flops, notes=f"{len(moves)} matrices moved for balance" if moves else "")
            batch.moves = tuple(moves)
            batch.sources = tuple(tuple(sources[i]) for i in idx)
            batch.index = len(plan.batches)
            plan.batches.append(batch)


def _redundant(spec: MatrixSpec) -> MatrixSpec:
    if spec.layout == "row_shard":
        return replace(spec, layout="gather_all")
    if spec.layout == "replicated":
        return replace(spec, layout="whole", group=None, rows=())
    return spec


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
