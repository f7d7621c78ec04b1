"""The one training loop of muonlab's distributed workers: ``distributed_steps`` runs the steps of
``train_worker`` (experiments/train.py), ``train_model`` (any_model.py) and the checkpoint workers
(checkpoint.py), and returns one record of them, :class:`StepsRecord`. ``optimizer_report`` gives
the keys the workers' results share about the optimizer (plan, spans, choices).

Each rank trains on its own batch of a step; the loss of the global batch is the mean of the ranks'
losses (one all-reduce a step), which is what a one-process run on the whole batch would see.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .._base import dist_on
from ..comm.records import table
from ..distributed.device import rank_device, wait_for
from ..launcher.progress import report_progress
from ..trace import gather_spans
from ..train import model_loss, to_device

__all__ = ["StepsRecord", "distributed_steps", "optimizer_report", "plan_rows"]


@dataclass
class StepsRecord:
    """What ``distributed_steps`` ran on this rank, one entry per step in each list."""

    steps: list[int] = field(default_factory=list)
    """The step numbers as reported to the launcher (``report_progress``)."""
    losses: list[float] = field(default_factory=list)
    """This rank's loss on its own batch."""
    mean_losses: list[float] = field(default_factory=list)
    """The mean of the ranks' losses: the global batch's loss (this rank's own in one process)."""
    step_seconds: list[float] = field(default_factory=list)
    """From the forward to the end of the optimizer step (on a GPU, until its kernels end)."""
    opt_seconds: list[float] = field(default_factory=list)
    """The optimizer step alone, backward's kernels finished before its clock starts."""


def distributed_steps(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    source: Callable[[Any], Any],
    steps: Iterable,
    *,
    loss_fn: Callable | None = None,
    first_reported: int = 1,
    total: int | None = None,
    device: torch.device | None = None,
) -> StepsRecord:
    """Train ``model`` with ``opt`` for each of ``steps``; return the :class:`StepsRecord`.

    ``source(step)`` gives this rank's batch of that step (a tensor, or tuples, lists, dicts of
    them), moved to ``device`` (default: the rank's, by the device rule); its loss is
    :func:`muonlab.train.model_loss` (``loss_fn(model(inputs), target)``, or the model's own loss
    without ``loss_fn``). The i-th step (from 0) is reported to the launcher as step
    ``first_reported + i`` of ``total`` (default: the number of steps) with the mean loss. Works in
    one process too (no process group: the mean is this process's loss).
    """
    steps = list(steps)
    total = len(steps) if total is None else total
    device = rank_device() if device is None else device
    world = dist.get_world_size() if dist_on() else 1
    record = StepsRecord()
    for i, step in enumerate(steps):
        t0 = time.perf_counter()
        loss = model_loss(model, to_device(source(step), device), loss_fn)
        loss.backward()
        wait_for(device)  # backward's kernels before the optimizer's clock starts
        t1 = time.perf_counter()
        opt.step()
        wait_for(device)  # and the step's before it stops
        t2 = time.perf_counter()
        opt.zero_grad()
        mean = loss.detach().clone()
        if world > 1:
            dist.all_reduce(mean)
        record.steps.append(first_reported + i)
        record.losses.append(loss.item())
        record.mean_losses.append(mean.item() / world)
        record.step_seconds.append(t2 - t0)
        record.opt_seconds.append(t2 - t1)
        report_progress(step=first_reported + i, loss=record.mean_losses[-1], total=total)
    return record


def plan_rows(plan) -> list[dict]:
    """``as_row()`` of each batch plus its per-rank tuples (owners, bytes, FLOPs), for plotting."""
    return [dict(b.as_row(), owners=list(b.owners), bytes_sent=list(b.bytes_sent),
                 bytes_recv=list(b.bytes_recv), flops=list(b.flops)) for b in plan]


def optimizer_report(opt, recorder) -> dict:
    """What the distributed workers return about the optimizer after their steps, the same keys in
    each: ns_choices (``Muon.resolved_choices()``), plan (``plan_rows``), plan_table, stats
    (``last_step_stats()``), spans (every rank's spans of the last step as dicts on rank 0, None on
    the others), step_spans (the ``StepRecorder``'s steps, gathered the same way) and span_clock
    ("gpu" or "host"). Every rank must call it: the spans are gathered."""
    plan = opt.plan()
    spans = gather_spans(opt.last_step_spans())
    step_spans = recorder.gather()
    return dict(ns_choices=opt.resolved_choices(), plan=plan_rows(plan), plan_table=table(plan),
                stats=opt.last_step_stats(), spans=None if spans is None else [asdict(s) for s in spans],
                step_spans=step_spans, span_clock=recorder.clock)
