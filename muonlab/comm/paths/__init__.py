"""The communication paths: one module each, and ``PATHS``, the only registry of them.

The engine runs ``PATHS[name].run``, the cost model reads ``collectives`` and ``out_share``, viz
reads ``color``; the order here is the order tables and legends use.
"""

from . import agrs, all_to_all, blocks, gather_all, local, owner, padded_all_to_all, pieces, rebalance, subgroup
from .base import CommPath, PathContext

PATHS: dict[str, CommPath] = {m.PATH.name: m.PATH for m in (
    local, rebalance, all_to_all, agrs, subgroup, blocks, pieces, owner, gather_all, padded_all_to_all)}
PLANNED_BY_PATH: dict[str, CommPath] = {p.plans_layout: p for p in PATHS.values() if p.plans_layout}
"""{layout: the path that plans that layout's buckets itself} (``CommPath.plan_bucket``)."""

__all__ = ["PATHS", "PLANNED_BY_PATH", "CommPath", "PathContext"]
