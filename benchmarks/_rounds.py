"""Alternating rounds and their statistics, shared by the benchmarks that compare optimizers side
by side on a shared machine: balanced orders within a round, and the median of per-round ratios
with a bootstrap interval.

    from _rounds import balanced_orders, median_interval, ratio_summary
"""

from __future__ import annotations

import random
import statistics


def balanced_orders(n: int) -> list[list[int]]:
    """Orders of n items in which each item directly follows every other equally often (a Williams
    design: n orders for even n, 2n for odd). A plain rotation of [a, b, c, d] puts b after a in
    three rounds of four, so b always runs on what a left behind (allocator, caches): an A/A run of
    two identical muonlab optimizers in that rotation measured the second 1.5% faster."""
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    orders = [[(x + i) % n for x in first] for i in range(n)]
    return orders if n % 2 == 0 else orders + [o[::-1] for o in orders]


def median_interval(values: list[float], level: float = 0.95, resamples: int = 2000, seed: int = 0):
    """A percentile-bootstrap interval for the median of ``values`` (resampled with replacement):
    how far this run's median ratio could move with other rounds of the same noise."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return medians[int((1 - level) / 2 * resamples)], medians[int((1 + level) / 2 * resamples) - 1]


def ratio_summary(times: list[float], base: list[float]) -> tuple[float, float, float, list[float]]:
    """Per-round ratios times[i] / base[i]: (their median, the 95% bootstrap interval of it, the ratios)."""
    ratios = [t / b for t, b in zip(times, base)]
    return (statistics.median(ratios), *median_interval(ratios), ratios)
