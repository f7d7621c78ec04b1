"""Waves: consecutive small batches that travel in one collective per direction.

A batch whose transfer and Newton-Schulz each take less time than a collective's fixed cost (the
profile's latency) is latency-bound: many small matrices of different shapes (a narrow model,
small adapters) would otherwise pay one collective pair per shape. Consecutive such batches of
one path (``WAVE_PATHS``: ``all_to_all``, ``pieces``, those whose record says ``waves``) on the same process group form a wave:
every rank packs the wave's send buffers into one all_to_all_single out and one back
(``muonlab.comm.collectives.Coalesced``), so the step's collective count follows its large
batches, not its shapes. A wave
gives up the pipeline inside it (its batches' transfers no longer hide behind each other's
Newton-Schulz), which is why only batches whose work is shorter than the latency they save join.

The bytes are those of the batches alone (a wave adds no padding); the cost model charges a
wave's latency once (``cost.comm_seconds``).
"""

from __future__ import annotations

from dataclasses import replace

from ..cost import HardwareProfile, comm_seconds, compute_seconds
from ..paths import PATHS
from ..records import BatchPlan, Plan

WAVE_PATHS = tuple(name for name, path in PATHS.items() if path.waves)
"""Paths whose collectives a wave can merge (``CommPath.waves``: both ways are one
all_to_all_single with split sizes; a wave holds batches of one path and group)."""


def latency_bound(batch: BatchPlan, profile: HardwareProfile) -> bool:
    """Its transfer (beyond the latency) and its Newton-Schulz each take at most one latency."""
    if batch.path not in WAVE_PATHS or batch.part is not None:
        return False
    latency = profile.latency_s
    transfer = comm_seconds(replace(batch, travels_with=None), profile) - PATHS[batch.path].collectives * latency
    return transfer <= latency and compute_seconds(batch, profile) <= latency


def coalesce(plan: Plan, profile: HardwareProfile) -> Plan:
    """``plan`` with each run of two or more consecutive latency-bound batches on one path, group
    and wire dtype made a wave (``BatchPlan.travels_with``: the index of the run's first batch); other
    batches unchanged."""
    batches = list(plan)
    runs: list[list[int]] = []
    for i, b in enumerate(batches):
        if not latency_bound(b, profile):
            continue
        # one collective carries one dtype: a batch on another wire dtype starts another wave
        joins = runs and runs[-1][-1] == i - 1 and batches[i - 1].group == b.group and batches[i - 1].path == b.path
        if joins and batches[i - 1].comm_itemsize == b.comm_itemsize:
            runs[-1].append(i)
        else:
            runs.append([i])
    for run in runs:
        if len(run) > 1:
            for i in run:
                batches[i] = replace(batches[i], travels_with=batches[run[0]].index)
    return Plan(tuple(batches))
