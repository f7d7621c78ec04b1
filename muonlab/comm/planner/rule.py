"""One plan under one owner rule: which batch each matrix joins, on which path, with which owners.

``RulePlanner`` reads only ``MatrixSpec`` metadata (global shapes, layouts, group sizes) and the
Newton-Schulz configs, so every rank computes the same plan, and a simulation at thousands of
ranks runs the very same code. Bytes are the logical bytes that leave and enter each rank, in the
wire dtype, excluding a rank's copy to itself (each path module holds its byte formula); the
collectives count the same at the call. The search over rules is in ``search.py``.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

from ...kernels.config import NSConfig, ns_flops
from ..cost import batch_seconds
from ..paths import PLANNED_BY_PATH, agrs, all_to_all, owner, pieces, rebalance
from ..records import BatchPlan, Plan, part_range
from ..specs import GroupKey, MatrixSpec, piece_numel
from ..wire import ItemsizeRule, itemsize_rule
from .loads import RankLoads, UnpickedLeastLoaded, cheapest_owner, least_loaded, lpt_makespan

ROW_RULES = ("structured", "capped", "lpt")
"""How row-sharded matrices get owners (each (shape, settings) bucket then travels as one batch,
``RulePlanner._plan_row_sharded``, so the rules differ in balance, not in collectives):
  "structured": each bucket in rounds of W, one matrix per rank per round (every rank owns the
                floor or ceiling of k/W of a bucket's k matrices); each bucket's leftovers on
                distinct, least-loaded ranks;
  "capped":     as structured, but no rank goes past the LPT makespan: a bucket whose leftovers
                don't fit on distinct ranks under it takes a second round;
  "lpt":        every matrix of the group, largest first, to the least-loaded rank (max-rank FLOPs
                <= 4/3 of the optimum, but a bucket's matrices less evenly spread)."""


def even_limit(total: int, limit: int) -> int:
    """The smallest per-run cap that still splits ``total`` items into as few runs as ``limit``
    does: ``total`` over the fewest runs, rounded up (24 under 7 -> 6, so 6+6+6+6; 6 under 5 -> 3,
    so 3+3). Each distinct run size is another batch shape for the matmul library."""
    return -(-total // -(-total // limit)) if total else limit


class RulePlanner:
    """The state of one plan being made: specs, configs, per-rank loads, the batches so far."""

    def __init__(self, specs: Sequence[MatrixSpec], configs: Sequence[NSConfig], *, comm_itemsize: int | ItemsizeRule,
                 remainder_path: str, profile, row_assignment: str, rebalance: bool, max_local_matrices=None,
                 sources: dict[int, list[int]] | None = None, pieces_plans: dict | None = None):
        self.specs, self.configs = list(specs), list(configs)
        self.remainder_path, self.profile = remainder_path, profile
        self._itemsize_rule, self._itemsizes = itemsize_rule(comm_itemsize), {}
        self.row_assignment, self.rebalance = row_assignment, rebalance
        self.max_local_matrices = max_local_matrices
        self.loads = RankLoads()
        self.batches: list[BatchPlan] = []
        self._flops: dict[int, int] = {}
        # {parameter: matrix_sources()}, shared by the planners of one search (it depends on the
        # spec alone, and costs O(group size) per parameter)
        self._sources = {} if sources is None else sources
        # {(group, parameters): (batches, load added per rank)} of the "pieces" layout, shared by the
        # planners of one search: planned before any rule-dependent layout, so alike in all of them
        self._pieces_plans = {} if pieces_plans is None else pieces_plans

    def flops_of(self, i: int) -> int:
        """Newton-Schulz FLOPs of ONE matrix of parameter i."""
        if i not in self._flops:
            self._flops[i] = ns_flops(self.specs[i].matrix_shape, self.configs[i])
        return self._flops[i]

    def itemsize_of(self, i: int) -> int:
        """Bytes per element on the wire of parameter i's batch (``comm_itemsize``: one per
        (shape, config, dtype) bucket, so every parameter of a batch has its batch's)."""
        if i not in self._itemsizes:
            self._itemsizes[i] = self._itemsize_rule(self.specs[i], self.configs[i])
        return self._itemsizes[i]

    def sources_of(self, i: int) -> list[int]:
        """Group-local rank holding each matrix of parameter i (``MatrixSpec.matrix_sources``)."""
        if i not in self._sources:
            self._sources[i] = self.specs[i].matrix_sources()
        return self._sources[i]

    def make(self, path: str, idx: Sequence[int], group, ranks, owners=(), sent=(), recv=(), flops=(),
             notes: str = "", param_shapes=None, **extra) -> BatchPlan:
        """A batch of parameters ``idx`` (``param_shapes``: what of each it holds, if not all)."""
        specs = self.specs
        first = specs[idx[0]]
        shapes = tuple(specs[i].shape for i in idx) if param_shapes is None else tuple(param_shapes)
        return BatchPlan(
            index=len(self.batches), path=path, names=tuple(specs[i].name for i in idx),
            param_indices=tuple(specs[i].index for i in idx), matrix_shape=first.matrix_shape,
            num_matrices=sum(specs[i].num_matrices for i in idx) if param_shapes is None
            else sum(math.prod(s[:-2]) for s in shapes), group=group, ns_config=self.configs[idx[0]],
            ranks=tuple(ranks), owners=tuple(owners), bytes_sent=tuple(sent), bytes_recv=tuple(recv),
            flops=tuple(flops), rows=first.rows, param_shapes=shapes,
            shard_dim=first.shard_dim, notes=notes, comm_itemsize=self.itemsize_of(idx[0]), **extra)

    def part_members(self, i: int, part: tuple[int, int] | None) -> list[int]:
        """Matrices of parameter i (indices into ``sources_of(i)``) in ``part`` (None: all): on
        each rank, that part's run of the matrices it holds (``part_range``)."""
        sources = self.sources_of(i)
        if part is None:
            return list(range(len(sources)))
        held: dict[int, list[int]] = {}
        for j, src in enumerate(sources):
            held.setdefault(src, []).append(j)
        members = []
        for js in held.values():
            lo, hi = part_range(len(js), part)
            members.extend(js[lo:hi])
        return sorted(members)

    def plan(self) -> Plan:
        row_sharded, whole, replicated, pieced = self._by_layout()
        for group, items in pieced.items():
            self._plan_pieces(group, items)
        for group, items in row_sharded.items():
            self._plan_row_sharded(group, items)
        for group, buckets in whole.items():
            self._plan_whole(group, buckets)
        for group, items in replicated.items():
            self._plan_replicated(group, items)
        # Order: batches that move nothing first (they compute while the first transfer travels),
        # then the heaviest compute first (more time to hide the transfers queued behind it). The
        # order is a function of the plan alone, so every rank runs the same sequence.
        ordered = sorted(self.batches, key=lambda b: (b.total_bytes > 0, -max(b.flops, default=0)))
        return Plan(tuple(replace(b, index=n) for n, b in enumerate(ordered)))

    # ------------------------------------------------------------------ layouts

    def _by_layout(self):
        """Buckets of same group, layout, matrix shape, dtype and config (and for sub-group banks,
        expert count: it sets the sub-groups' size), in first-seen order. Sub-group banks and
        fallbacks become batches now; the rest is returned by layout, per group (row-sharded, whole,
        replicated, pieces)."""
        buckets: dict[tuple, list[int]] = {}
        for i, (spec, cfg) in enumerate(zip(self.specs, self.configs)):
            # banks of 2 and 3 experts can't share a batch: the count sets the sub-groups, or the blocks' rows
            experts = spec.num_fused if spec.layout in ("subgroup", "blocks") else None
            buckets.setdefault((spec.group, spec.layout, spec.matrix_shape, spec.dtype, cfg, experts), []).append(i)
        row_sharded: dict[GroupKey, list[int]] = {}
        whole: dict[GroupKey | None, list[list[tuple]]] = {}
        replicated: dict[GroupKey, list[int]] = {}
        pieced: dict[GroupKey, list[int]] = {}
        for (group, layout, *_), idx in buckets.items():
            if layout == "whole":
                load = self.loads.view(group)
                for i in idx:
                    for r, count in Counter(self.sources_of(i)).items():
                        load.add(r, count * self.flops_of(idx[0]))
                whole.setdefault(group, []).extend(self._within_budget(idx))
            elif layout == "row_shard":
                row_sharded.setdefault(group, []).extend(idx)
            elif layout == "replicated":
                replicated.setdefault(group, []).extend(idx)
            elif layout in PLANNED_BY_PATH:  # a path that plans its layout itself (its module says how)
                PLANNED_BY_PATH[layout].plan_bucket(self, group, idx)
            elif layout == "pieces":
                pieced.setdefault(group, []).extend(idx)
            else:  # pragma: no cover - MatrixSpec validates layouts
                raise AssertionError(layout)
        return row_sharded, whole, replicated, pieced

    def _within_budget(self, idx: list[int]) -> list[list[tuple[int, tuple[int, int] | None]]]:
        """A bucket of whole matrices as runs of (parameter, part) whose matrices per rank fit
        ``max_local_matrices``, as even as the parameters allow: 24 matrices under a limit of 7 run
        as 6+6+6+6, not 7+7+7+3 (each distinct batch size is another shape for the matmul library
        to plan and cache kernels for; on a CPU each costs memory). An expert bank (view "bank")
        with more matrices on a rank than that is cut into parts (``BatchPlan.part``), so that its
        momentum inputs too are taken a part at a time; a 2-D parameter (one matrix, or a few
        fused ones) stays one run. Part None: the whole parameter."""
        if self.max_local_matrices is None:
            return [[(i, None) for i in idx]]
        spec = self.specs[idx[0]]
        limit = self.max_local_matrices(spec.matrix_shape, self.configs[idx[0]])
        held_by = [max(Counter(self.sources_of(i)).values()) for i in idx]  # each parameter's most on one rank
        total = sum(held_by)
        limit = even_limit(total, limit)
        runs, run, held = [], [], 0
        for i, here in zip(idx, held_by):
            if here > limit and self.specs[i].view == "bank":
                parts = -(-here // limit)
                runs.extend([(i, (p, parts))] for p in range(parts))
                continue
            if run and held + here > limit:
                runs.append(run)
                run, held = [], 0
            run.append((i, None))
            held += here
        return runs + [run] if run else runs

    # ------------------------------------------------------------------ pieces (tensor parallel x FSDP2)

    def _plan_pieces(self, group: GroupKey, items: list[int]) -> None:
        """Each parameter whole on one owner of the flattened group, largest first (LPT over its
        FLOPs), on the rank whose pick adds least to the modelled step (``cheapest_owner``: the
        makespan's growth and the bytes its pieces move, under ``profile``), so with even pieces
        the least loaded and with uneven ones a rank holding most where balance allows. Each (matrix shape, config, wire dtype) bucket travels as one batch, one
        all-to-all each way, cut where an owner's matrices exceed the workspace budget."""
        size, load = group.size, self.loads.view(group)
        done = self._pieces_plans.get((group, tuple(items)))
        if done is not None:  # the same as another rule's planner made (see __init__)
            batches, added = done
            for r, f in added.items():
                load.add(r, f)
            self.batches.extend(batches)
            return
        first, added = len(self.batches), {}
        # parameters of one shape and placements share their pieces (one object): sized once
        sizes: dict[int, list[int]] = {}
        for i in items:
            if id(self.specs[i].pieces) not in sizes:
                sizes[id(self.specs[i].pieces)] = [piece_numel(pc) for pc in self.specs[i].pieces]
        held = {i: sizes[id(self.specs[i].pieces)] for i in items}
        cost = {i: self.flops_of(i) * self.specs[i].num_matrices for i in items}
        seconds_per_byte = 1 / self._slowest_link(group)
        owner_of, top = {}, max(load, default=0)
        for i in sorted(items, key=lambda i: (-cost[i], i)):
            total, itemsize = sum(held[i]), self.itemsize_of(i)
            moved = [2 * (total - h) * itemsize * seconds_per_byte for h in held[i]]
            o = cheapest_owner(load, top, cost[i], held[i], moved, 1 / self.profile.matmul_flops)
            owner_of[i] = o
            load.add(o, cost[i])
            top = max(top, load[o])
            added[o] = added.get(o, 0) + cost[i]
        buckets: dict[tuple, list[int]] = {}
        for i in items:
            buckets.setdefault(self._row_bucket(i), []).append(i)
        for (shape, cfg, itemsize), bucket in buckets.items():
            runs = [bucket]
            if self.max_local_matrices is not None:
                runs = self._runs_per_owner(bucket, owner_of, [self.specs[i].num_matrices for i in bucket],
                                            self.max_local_matrices(shape, cfg))
            for idx in runs:
                flops = [0] * size
                for i in idx:
                    flops[owner_of[i]] += cost[i]
                owners = [owner_of[i] for i in idx]
                sent, recv = pieces.bytes_per_rank([held[i] for i in idx], owners, itemsize)
                self.batches.append(self.make("pieces", idx, group, range(size), owners, sent, recv, flops,
                                              pieces=tuple(self.specs[i].pieces for i in idx)))
        self._pieces_plans[(group, tuple(items))] = (self.batches[first:], added)

    def _slowest_link(self, group: GroupKey) -> float:
        """Bytes/s of the slower link a batch over ``group`` crosses: the inter-node one where a
        slice of the group spans nodes (``profile.ranks_per_node``), else the intra-node one."""
        per_node = self.profile.ranks_per_node
        spans = any(len({g // per_node for g in members}) > 1 for members in group.axis_slices())
        return self.profile.inter_bw if spans else self.profile.intra_bw

    # ------------------------------------------------------------------ row-sharded (FSDP2)

    def _plan_row_sharded(self, group: GroupKey, items: list[int]) -> None:
        """One owner per matrix (``row_assignment``), then each (shape, config, wire dtype) bucket as one
        batch in which an owner may own several matrices (a megabatch: one collective each way
        per bucket, however many matrices it holds), cut into several only where an owner's share
        exceeds the workspace budget (``_row_runs``). A batch of at least W matrices goes by
        all_to_all; fewer (a bucket smaller than the group) is a remainder on ``remainder_path``."""
        owner_of = self._row_owners(group, items)
        buckets: dict[tuple, list[int]] = {}
        for i in items:
            buckets.setdefault(self._row_bucket(i), []).append(i)
        for (shape, cfg, _), bucket in buckets.items():
            for idx in self._row_runs(bucket, owner_of, shape, cfg):
                self.batches.append(self._row_batch(group, idx, [owner_of[i] for i in idx], shape))

    def _row_bucket(self, i: int) -> tuple:
        """The bucket of row-sharded parameter i: its matrix shape, config and wire itemsize (one
        collective carries one dtype; parameters of one shape and config but other dtypes may
        travel in other ones when ``ns_dtype=None``)."""
        return self.specs[i].matrix_shape, self.configs[i], self.itemsize_of(i)

    def _row_runs(self, idx: list[int], owner_of: dict[int, int], shape, cfg) -> list[list[int]]:
        """A bucket of row-sharded matrices as batches in which no owner holds more matrices than
        ``max_local_matrices`` (what it orthogonalizes at once: its received stack), as even as
        the owners' shares allow; None: the whole bucket, one batch."""
        if self.max_local_matrices is None:
            return [idx]
        return self._runs_per_owner(idx, owner_of, [1] * len(idx), self.max_local_matrices(shape, cfg))

    def _runs_per_owner(self, idx: list[int], owner_of: dict[int, int], counts: list[int],
                        per_owner: int) -> list[list[int]]:
        """``idx`` cut into batches in which each owner holds at most about ``per_owner`` matrices
        (``counts[n]``: matrices of parameter ``idx[n]``; one larger than the cap alone is still an
        owner's share of a batch), evened over the fewest batches the busiest owner needs
        (``even_limit``); each owner's matrices keep their order, its first ones in the first
        batch."""
        held = Counter()
        for i, n in zip(idx, counts):
            held[owner_of[i]] += n
        per_owner = even_limit(max(held.values()), max(1, per_owner))
        taken: Counter = Counter()  # matrices each owner has placed so far
        runs: dict[int, list[int]] = {}
        for i, n in zip(idx, counts):
            o = owner_of[i]
            runs.setdefault(taken[o] // per_owner, []).append(i)
            taken[o] += n
        return [runs[j] for j in sorted(runs)]

    def _row_batch(self, group: GroupKey, idx: list[int], owners: list[int], shape) -> BatchPlan:
        """The batch of row-sharded matrices ``idx`` owned by ``owners``; a remainder (fewer
        matrices than ranks) takes ``remainder_path``, or under "auto" whichever of all_to_all and
        agrs the cost model finds faster."""
        size, rows = group.size, self.specs[idx[0]].rows
        flops = [0] * size
        for i, o in zip(idx, owners):
            flops[o] += self.flops_of(i)
        if len(idx) >= size:
            candidates, notes = ["all_to_all"], ""
        else:
            candidates = ["all_to_all", "agrs"] if self.remainder_path == "auto" else [self.remainder_path]
            notes = f"remainder: {len(idx)} < {size} matrices"
        options = []
        for path in candidates:
            module = agrs if path == "agrs" else all_to_all
            sent, recv = module.bytes_per_rank(rows, shape[1], owners, self.itemsize_of(idx[0]))
            options.append(self.make(path, idx, group, range(size), owners, sent, recv, flops, notes))
        return min(options, key=lambda b: batch_seconds(b, self.profile))

    def _row_owners(self, group: GroupKey, items: list[int]) -> dict[int, int]:
        size, load = group.size, self.loads.view(group)
        owner_of: dict[int, int] = {}
        free = items
        if self.row_assignment in ("structured", "capped"):
            free = []
            by_bucket: dict[tuple, list[int]] = {}
            for i in items:
                by_bucket.setdefault(self._row_bucket(i), []).append(i)
            leftovers = []
            for idx in by_bucket.values():
                full = len(idx) - len(idx) % size
                for pos, i in enumerate(idx[:full]):
                    owner_of[i] = pos % size
                    load.add(pos % size, self.flops_of(i))
                if full < len(idx):
                    leftovers.append(idx[full:])
            self._place_leftovers(leftovers, size, load, owner_of)
        for i in sorted(free, key=lambda i: (-self.flops_of(i), i)):
            o = least_loaded(load, range(size), self.specs[i].rows)
            owner_of[i] = o
            load.add(o, self.flops_of(i))
        return owner_of

    def _place_leftovers(self, leftovers: list[list[int]], size: int, load, owner_of: dict[int, int]) -> None:
        """Each bucket's leftovers on distinct ranks, largest buckets first;
        "capped" keeps every rank under the LPT makespan, opening another round if needed."""
        flops_of = self.flops_of
        cap = lpt_makespan(list(load), [flops_of(i) for idx in leftovers for i in idx])
        for idx in sorted(leftovers, key=lambda idx: (-flops_of(idx[0]), idx[0])):
            untaken = UnpickedLeastLoaded(load, range(size))
            for i in idx:
                f, rows = flops_of(i), self.specs[i].rows
                o = untaken.pick(rows)
                # "capped": the least-loaded untaken rank is the likeliest to fit under the cap; if
                # even it doesn't, none does: this round is full, the next starts over all ranks
                # (where the least-loaded rank is the pick whether it fits or not)
                if self.row_assignment == "capped" and load[o] + f > cap:
                    untaken = UnpickedLeastLoaded(load, range(size))
                    o = untaken.pick(rows)
                owner_of[i] = o
                load.add(o, f)

    # ------------------------------------------------------------------ whole matrices (experts)

    def _plan_whole(self, group: GroupKey | None, buckets: list[list[tuple[int, tuple[int, int] | None]]]) -> None:
        """Whole matrices stay where they lie unless their rank is overloaded; then the largest ones
        move to the least-loaded ranks (path "rebalance": out to the owner and back), while their
        rank exceeds what an LPT placement would reach and a move lowers the busier of the two
        ranks. Experts of a MoE layer sharded over more ranks than experts would otherwise leave
        most ranks idle. A bucket is a run of (parameter, part)."""
        size = group.size if group else 1
        members = {item: self.part_members(*item) for bucket in buckets for item in bucket}
        owner = self._whole_owners(group, members)
        for bucket in buckets:
            moves, flops, sources = [], [0] * size, []
            for pos, (i, part) in enumerate(bucket):
                all_sources = self.sources_of(i)
                sources.append(tuple(all_sources[j] for j in members[(i, part)]))
                for k, j in enumerate(members[(i, part)]):  # k: the matrix's place in the part
                    src, o = all_sources[j], owner[(i, j)]
                    flops[o] += self.flops_of(i)
                    if o != src:
                        moves.append((pos, k, src, o))
            idx = [i for i, _ in bucket]
            part = bucket[0][1]
            A, B = self.specs[idx[0]].matrix_shape
            notes = [f"part {part[0] + 1} of {part[1]}"] if part else []
            notes += [f"{len(moves)} matrices moved for balance"] if moves else []
            sent, recv = rebalance.bytes_per_rank(moves, size, A * B * self.itemsize_of(idx[0]))
            self.batches.append(self.make(
                "rebalance" if moves else "local", idx, group, [r for r in range(size) if flops[r]] or [0],
                sent=sent, recv=recv, flops=flops, notes="; ".join(notes), moves=tuple(moves),
                sources=tuple(sources), part=part,
                param_shapes=[(len(s), A, B) for s in sources] if part else None))

    def _whole_owners(self, group, members: dict) -> dict[tuple[int, int], int]:
        """{(parameter, matrix): rank that orthogonalizes it}: where it lies, or a move for balance.
        ``members``: {(parameter, part): its matrices}."""
        size = group.size if group else 1
        load = self.loads.view(group)
        flops_of = self.flops_of
        items = [(i, j, self.sources_of(i)[j]) for (i, _), js in members.items() for j in js]
        # the target: the makespan LPT reaches placing these matrices freely on top of the rest
        base = list(load)
        for i, _, src in items:
            base[src] -= flops_of(i)
        cap = lpt_makespan(base, [flops_of(i) for i, _, _ in items])
        owner = {(i, j): src for i, j, src in items}
        if not self.rebalance:
            return owner
        # least-loaded rank by a heap with lazy deletion: an entry is current if it matches the load
        heap = [(load[r], r) for r in range(size)]
        heapq.heapify(heap)
        order = sorted(items, key=lambda t: (-flops_of(t[0]), t[0], t[1]))

        def move_while(fits) -> None:
            """Largest first, each matrix of a rank over the cap to the least-loaded rank, if
            ``fits(that rank's load with it, its own rank's load)``."""
            for i, j, _ in order:
                src, f = owner[(i, j)], flops_of(i)
                if load[src] <= cap:
                    continue
                while heap[0][0] != load[heap[0][1]]:
                    heapq.heappop(heap)
                target = heap[0][1]
                if fits(load[target] + f, load[src]):
                    owner[(i, j)] = target
                    load.add(src, -f)
                    load.add(target, f)
                    heapq.heappush(heap, (load[src], src))
                    heapq.heappush(heap, (load[target], target))

        move_while(lambda moved, _: moved <= cap)
        # matrices that never move (their rank is under the cap) may keep every rank from staying
        # under it: then moves that at least lower the busier rank of the two
        move_while(lambda moved, src_load: moved < src_load)
        return owner

    # ------------------------------------------------------------------ replicated (DDP)

    def _plan_replicated(self, group: GroupKey, items: list[int]) -> None:
        """Each parameter gets one owner, by LPT over the whole group; updates are all-gathered."""
        size, load = group.size, self.loads.view(group)
        cost = {i: self.flops_of(i) * self.specs[i].num_matrices for i in items}
        owner_of = {}
        for i in sorted(items, key=lambda i: (-cost[i], i)):
            o = least_loaded(load, range(size))
            owner_of[i] = o
            load.add(o, cost[i])
        by_bucket: dict[tuple, list[int]] = {}
        for i in items:  # one dtype per batch: the owner reads its matrices from momentum, not a wire buffer
            by_bucket.setdefault((self.specs[i].matrix_shape, self.specs[i].dtype, self.configs[i]), []).append(i)
        for (shape, _, cfg), bucket in by_bucket.items():
            for idx in self._owner_runs(bucket, owner_of, shape, cfg, size):
                payload, flops = [0] * size, [0] * size
                for i in idx:
                    payload[owner_of[i]] += self.specs[i].num_matrices * shape[0] * shape[1] * self.itemsize_of(i)
                    flops[owner_of[i]] += cost[i]
                sent, recv = owner.gather_bytes(payload)
                self.batches.append(self.make("owner", idx, group, range(size), [owner_of[i] for i in idx],
                                              sent, recv, flops))

    def _owner_runs(self, idx: list[int], owner_of: dict[int, int], shape, cfg, size: int) -> list[list[int]]:
        """A bucket of replicated parameters as batches within the workspace budget. Every rank
        receives a batch's whole all-gather, so a batch holds about ``max_local_matrices``
        matrices in all: k = that / W per owner (at least one), so that each batch still keeps
        every owner busy, and as even as the owners' loads allow. A parameter larger than k alone
        is still one owner's share of a batch. Without a budget: the whole bucket, one batch."""
        if self.max_local_matrices is None:
            return [idx]
        per_owner = self.max_local_matrices(shape, cfg) // size
        return self._runs_per_owner(idx, owner_of, [self.specs[i].num_matrices for i in idx], per_owner)
