"""Planned against counted optimizer-step buffer bytes on this rank (muonlab.comm.memory), for
the workers that already run each layout: a worker returns ``memory_check(opt)`` with its
results, and its test asserts ``planned == counted``."""

from __future__ import annotations

import torch

from muonlab.comm.collectives import rank_or_zero
from muonlab.comm.specs import local_shard
from muonlab.optim.planning import memory_of


def memory_check(opt) -> dict:
    """This rank's (peak, batches in flight at it, {batch: bytes}, Muon state bytes) as the plan says
    and as the last step counted (the state: the tensors in ``opt.state``), and (the Newton-Schulz
    arena held, the plan's bound on it)."""
    mem, stats = memory_of(opt), opt.last_step_stats()
    mine = mem.ranks[rank_or_zero()]
    runner = opt._runner
    held = sum(local_shard(t).nbytes for _, p in opt._muon_entries() for t in opt.state.get(p, {}).values()
               if isinstance(t, torch.Tensor))
    return dict(planned=(mine.peak, tuple(mine.peak_batches), dict(mine.by_batch), mem.state),
                counted=(stats["buffer_peak_bytes"], tuple(stats["buffer_peak_batches"]), stats["buffer_bytes"], held),
                workspace=(0 if runner is None else runner.nbytes, mem.workspace))


def assert_counted(res: dict, label) -> None:
    """The worker's ``memory`` entry: planned == counted exactly, the arena within its bound."""
    m = res["memory"]
    assert m["planned"] == m["counted"], (label, m)
    assert m["workspace"][0] <= m["workspace"][1], (label, m)
