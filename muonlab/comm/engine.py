"""Run a plan: move, orthogonalize, move back, with the next batch's communication in flight.

Order on every rank (the plan is identical everywhere, so collectives line up):

    out(0), out(1), wait out(0), NS(0), back(0), out(2), wait out(1), NS(1), back(1), ...

so batch i+1's all-to-all travels while batch i's Newton-Schulz runs (async collectives).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

import torch

from ..trace import Tracer
from .agrs import AgrsRun
from .all_to_all import AllToAllRun
from .base import PathContext, PathRun
from .collectives import CommCounter
from .gather_all import GatherAllRun
from .layout import GroupKey
from .local import LocalRun
from .owner import OwnerRun
from .rebalance import RebalanceRun
from .subgroup import SubgroupRun
from .plan import Plan

RUNS: dict[str, type[PathRun]] = {
    "local": LocalRun, "rebalance": RebalanceRun, "all_to_all": AllToAllRun, "agrs": AgrsRun, "owner": OwnerRun, "gather_all": GatherAllRun,
    "subgroup": SubgroupRun,
}


def execute_plan(
    plan: Plan,
    inputs: dict[int, torch.Tensor | None],
    groups: dict[GroupKey | None, tuple[object, int]],
    orthogonalize: Callable[[Hashable, torch.Tensor], torch.Tensor],
    *,
    wire_dtype: torch.dtype,
    tracer: Tracer,
    counter: CommCounter,
) -> tuple[dict[int, torch.Tensor], dict[str, float]]:
    """Returns ({param index: this rank's orthogonalized local tensor}, phase seconds)."""
    runs = []
    for batch in plan:
        pg, group_rank = groups[batch.group]
        ctx = PathContext(pg, group_rank, wire_dtype, counter)
        runs.append(RUNS[batch.path](batch, [inputs[i] for i in batch.param_indices], ctx))
    phase = {"communication": 0.0, "newton_schulz": 0.0}
    starts: dict[int, float] = {}

    def start_out(i):
        starts[i] = time.time()
        runs[i].send_out()

    if runs:
        start_out(0)
    back_started = []
    for i, run in enumerate(runs):
        if i + 1 < len(runs):
            start_out(i + 1)
        t0 = time.time()
        mats = run.wait_out()
        t1 = time.time()
        tracer.add("comm_out", starts[i], t1, path=run.path, batch=i, bytes_sent=run.bytes_sent,
                   bytes_recv=run.bytes_recv)
        phase["communication"] += t1 - t0
        ortho = None
        if mats is not None:
            ortho = orthogonalize(run.batch.ns_key, mats)
            t2 = time.time()
            tracer.add("newton_schulz", t1, t2, path=run.path, batch=i)
            phase["newton_schulz"] += t2 - t1
        sent, recv = run.bytes_sent, run.bytes_recv
        starts[i] = time.time()
        run.send_back(ortho)
        back_started.append((i, sent, recv))
    outputs: dict[int, torch.Tensor] = {}
    for i, sent, recv in back_started:
        run = runs[i]
        t0 = time.time()
        results = run.wait_back()
        t1 = time.time()
        phase["communication"] += t1 - t0
        if run.path != "local":  # local moves nothing
            tracer.add("comm_back", starts[i], t1, path=run.path, batch=i,
                       bytes_sent=run.bytes_sent - sent, bytes_recv=run.bytes_recv - recv)
        outputs.update(zip(run.batch.param_indices, results))
    return outputs, phase
