"""The planner spreads each bucket's leftover matrices (fewer than the ranks) over distinct ranks
with a heap (``UnpickedLeastLoaded``): the same owners as the plain O(ranks)-per-matrix loop it
replaced, kept here as the reference, on loads with many ties, uneven and empty shards, and both
row rules that use it."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from muonlab.comm.planner.loads import GroupLoad, RankLoads, least_loaded, lpt_makespan
from muonlab.comm.planner.rule import RulePlanner
from muonlab.comm.specs import chunk_sizes


def reference_place_leftovers(row_assignment, specs, flops, leftovers, size, load, owner_of):
    """The loop as first written: candidates rebuilt and scanned for every matrix."""
    cap = lpt_makespan(list(load), [flops[i] for idx in leftovers for i in idx])
    for idx in sorted(leftovers, key=lambda idx: (-flops[idx[0]], idx[0])):
        taken: set[int] = set()
        for i in idx:
            f = flops[i]
            candidates = [r for r in range(size) if r not in taken]
            if row_assignment == "capped":
                under = [r for r in candidates if load[r] + f <= cap]
                if not under:  # this round is full: start the next one
                    taken.clear()
                    under = [r for r in range(size) if load[r] + f <= cap] or list(range(size))
                candidates = under
            o = least_loaded(load, candidates, specs[i].rows)
            taken.add(o)
            owner_of[i] = o
            load.add(o, f)


def _case(seed: int, size: int):
    rng = random.Random(seed)
    shapes = [(rng.choice([3, 8, 64, 96, size * 2 + 1]), 16) for _ in range(rng.randint(1, 5))]
    specs, flops, leftovers, i = {}, {}, [], 0
    for rows, _ in shapes:
        idx = []
        for _ in range(rng.randint(1, max(1, size - 1))):
            specs[i] = SimpleNamespace(rows=chunk_sizes(rows, size))  # trailing ranks short or empty
            flops[i] = rng.choice([10, 10, 20, 35]) * 1000
            idx.append(i)
            i += 1
        leftovers.append(idx)
    start = [rng.choice([0, 0, 0, 10_000, 20_000]) for _ in range(size)]  # many ties
    return specs, flops, leftovers, start


def _loads(size, start):
    view = GroupLoad(RankLoads(), [[r] for r in range(size)])
    for r, x in enumerate(start):
        if x:
            view.add(r, x)
    return view


@pytest.mark.parametrize("row_assignment", ["structured", "capped"])
@pytest.mark.parametrize("size", [1, 2, 3, 7, 16, 64, 257])
def test_leftovers_take_the_owners_of_the_reference_loop(row_assignment, size):
    for seed in range(20):
        specs, flops, leftovers, start = _case(seed, size)
        want: dict[int, int] = {}
        want_load = _loads(size, start)
        reference_place_leftovers(row_assignment, specs, flops, leftovers, size, want_load, want)
        planner = SimpleNamespace(flops_of=flops.__getitem__, specs=specs, row_assignment=row_assignment)
        got: dict[int, int] = {}
        got_load = _loads(size, start)
        RulePlanner._place_leftovers(planner, leftovers, size, got_load, got)
        assert got == want, (seed, size)
        assert list(got_load) == list(want_load)
