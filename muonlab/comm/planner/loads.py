"""Newton-Schulz FLOPs per rank while a plan is being made, and the placement helpers on them."""

from __future__ import annotations

import functools
import heapq
from collections.abc import Sequence

from ..specs import GroupKey


class RankLoads:
    """Newton-Schulz FLOPs per GLOBAL rank, seen through any group.

    Two groups may cover the same ranks (a dense "dp" mesh and an expert ("fsdp", "ep") mesh over
    one world), so balance is kept per global rank, not per group. A group-local rank r stands
    for every global rank at index r of the group's axis (one per slice of a bigger mesh); its
    load is the largest of theirs, and work given to r lands on all of them.
    """

    def __init__(self):
        self.by_rank: dict[int, int] = {}
        self._members: dict[GroupKey | None, list[list[int]]] = {}

    def view(self, group: GroupKey | None) -> "GroupLoad":
        if group not in self._members:
            self._members[group] = _members(group)
        return GroupLoad(self, self._members[group])


@functools.lru_cache(maxsize=64)
def _members(group: GroupKey | None) -> list[list[int]]:
    """Global ranks at each group-local rank; kept, as every plan of a search asks again. Callers
    only read it."""
    if group is None:
        return [[0]]
    members: list[list[int]] = [[] for _ in range(group.size)]
    for g, r in group.local_ranks().items():
        members[r].append(g)
    return members


class GroupLoad:
    """One group's view of the loads: a snapshot taken when the view is made, kept current by
    its own ``add`` (a rank's members are disjoint from the other ranks' of the same group). Take
    a fresh view after adding through another group's view."""

    def __init__(self, loads: RankLoads, members: list[list[int]]):
        self.loads, self.members = loads, members
        load_of = loads.by_rank.get
        self.values = [load_of(m[0], 0) if len(m) == 1 else max(load_of(g, 0) for g in m) for m in members]

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


def least_loaded(load, candidates: Sequence[int], prefer: Sequence[int] | None = None) -> int:
    # ties go to the rank holding more rows (fewer bytes move), then the lowest rank; the lowest
    # load is found first without building a key per rank (this runs once per matrix over W ranks)
    candidates = list(candidates)
    at = load.values if isinstance(load, GroupLoad) else load
    values = [at[r] for r in candidates]
    low = min(values)
    tied = [r for r, v in zip(candidates, values) if v == low]
    if len(tied) == 1 or not prefer:
        return min(tied)
    most = max(prefer[r] for r in tied)
    return min(r for r in tied if prefer[r] == most)


def cheapest_owner(load, top: int, cost: int, held: Sequence[int], moved_seconds: Sequence[float],
                   seconds_per_flop: float) -> int:
    """The owner of a parameter gathered whole from pieces on every rank (layout "pieces"): the rank
    whose pick adds least to the modelled step, its Newton-Schulz time (the makespan's growth:
    ``max(top, load + cost)``, in FLOPs, ``top`` the largest load so far) plus the time of the
    bytes its pick moves (``moved_seconds[r]``: every piece but rank r's, out and back). Where the
    pieces are even the bytes are alike and this is ``least_loaded``; where they are not (uneven and
    empty pieces), a small matrix goes to a rank holding most of it and a large one keeps the
    balance. Ties: the least loaded, then the one holding most, then the lowest."""
    at = load.values if isinstance(load, GroupLoad) else load
    return min(range(len(held)),
               key=lambda r: (max(top, at[r] + cost) * seconds_per_flop + moved_seconds[r], at[r], -held[r], r))


class UnpickedLeastLoaded:
    """``least_loaded`` over the ranks not yet picked, as one picking loop asks it again and again:
    a heap of (load, -rows held, rank), so a pick costs O(log W), not O(W). Exact as long as only a
    picked rank's load changes while it is in use (the picked rank leaves the heap), which is how
    a bucket's matrices are spread over distinct ranks."""

    def __init__(self, load, ranks: Sequence[int]):
        self._at = load.values if isinstance(load, GroupLoad) else load
        self._ranks, self._prefer, self._heap = list(ranks), None, None

    def pick(self, prefer: Sequence[int] | None = None) -> int:
        """The least-loaded unpicked rank, ties to the one holding more rows, then the lowest."""
        if self._heap is None or (prefer is not self._prefer and prefer != self._prefer):
            ranks = self._ranks if self._heap is None else [r for *_, r in self._heap]
            self._prefer = prefer
            self._heap = [(self._at[r], -prefer[r] if prefer else 0, r) for r in ranks]
            heapq.heapify(self._heap)
        return heapq.heappop(self._heap)[2]


def lpt_makespan(loads: list[int], work: list[int]) -> int:
    """Largest load after placing ``work`` largest first on the least-loaded of ``loads``."""
    heap = [(x, r) for r, x in enumerate(loads)]
    heapq.heapify(heap)
    for f in sorted(work, reverse=True):
        x, r = heapq.heappop(heap)
        heapq.heappush(heap, (x + f, r))
    return max(x for x, _ in heap) if heap else 0
