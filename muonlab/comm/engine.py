"""Run a plan: move, orthogonalize, move back, with the next batch's communication in flight.

Each batch is one generator of its path (muonlab.comm.paths), which yields its work: the way
out (a collective in flight), its whole matrices, the way back. The engine counts each
collective's bytes once, waits on it, runs Newton-Schulz, and records the spans. The order on
every rank (the plan is identical everywhere, so collectives line up) is

    out(0), out(1), [wait out(0), NS(0), back(0)], out(2), [wait out(1), NS(1), back(1)], ...
    then every batch's wait back, in order,

so batch i+1's transfer travels while batch i's Newton-Schulz runs (async collectives).
"""

from __future__ import annotations

import time

import torch

from ..kernels.newton_schulz import newton_schulz
from ..trace import Tracer
from .collectives import CommCounter, Pending
from .paths import PATHS, PathContext
from .records import BatchPlan, Plan
from .specs import GroupKey


class BatchRun:
    """One batch on one rank: its path's generator, what it yielded last, and its timing."""

    def __init__(self, index: int, batch: BatchPlan, inputs: list, ctx: PathContext, *, tracer: Tracer,
                 counter: CommCounter):
        self.index, self.batch, self.path = index, batch, batch.path
        self._tracer, self._counter = tracer, counter
        self._gen = PATHS[batch.path].run(batch, inputs, ctx)
        self._bytes = {"out": (0, 0), "back": (0, 0)}
        self.comm_seconds = 0.0
        self.ns_seconds = 0.0

    def _advance(self, value, direction: str):
        """Resume the generator with ``value``; a collective it yields is counted here, once."""
        item = self._gen.send(value)
        if isinstance(item, Pending):
            self._counter.add(self.path, item.sent, item.recv)
            self._bytes[direction] = (item.sent, item.recv)
        return item

    def start(self) -> None:
        """Issue the way out (a path with none yields its matrices at once)."""
        self._start = time.time()
        self._item = self._advance(None, "out")
        self.comm_seconds += time.time() - self._start

    def compute(self) -> None:
        """Wait for the way out, orthogonalize, issue the way back."""
        t0 = time.time()
        mats = self._item
        if isinstance(mats, Pending):
            mats = self._advance(mats.wait(), "out")
        t1 = time.time()
        sent, recv = self._bytes["out"]
        self._tracer.add("comm_out", self._start, t1, path=self.path, batch=self.index, bytes_sent=sent,
                         bytes_recv=recv)
        ortho = None
        if mats is not None:
            ortho = newton_schulz(mats, self.batch.ns_config)
            t2 = time.time()
            self._tracer.add("newton_schulz", t1, t2, path=self.path, batch=self.index)
            self.ns_seconds += t2 - t1
        self._back_start = time.time()
        try:
            self._item = self._advance(ortho, "back")
        except StopIteration as done:  # no way back: the outputs are ready
            self._item, self._outputs = None, done.value
        self.comm_seconds += (t1 - t0) + (time.time() - self._back_start)

    def finish(self) -> list[torch.Tensor]:
        """Wait for the way back; this rank's output per parameter of the batch."""
        t0 = time.time()
        if isinstance(self._item, Pending):
            try:
                self._gen.send(self._item.wait())
            except StopIteration as done:
                self._outputs = done.value
            else:  # pragma: no cover - a path that yields after its way back
                raise AssertionError(f"path {self.path!r} yielded after its way back")
        t1 = time.time()
        self.comm_seconds += t1 - t0
        if PATHS[self.path].collectives:  # a path that moves nothing has no way back to show
            sent, recv = self._bytes["back"]
            self._tracer.add("comm_back", self._back_start, t1, path=self.path, batch=self.index,
                             bytes_sent=sent, bytes_recv=recv)
        return self._outputs


def execute_plan(
    plan: Plan,
    inputs: dict[int, torch.Tensor | None],
    groups: dict[GroupKey | None, tuple[object, int]],
    *,
    wire_dtype: torch.dtype,
    tracer: Tracer,
    counter: CommCounter,
) -> tuple[dict[int, torch.Tensor], dict[str, float]]:
    """Returns ({param index: this rank's orthogonalized local tensor}, phase seconds).

    ``groups``: {GroupKey: (torch ProcessGroup, this rank's index in it)} for every batch's group.
    """
    runs = []
    for i, batch in enumerate(plan):
        pg, group_rank = groups[batch.group]
        runs.append(BatchRun(i, batch, [inputs[j] for j in batch.param_indices],
                             PathContext(pg, group_rank, wire_dtype), tracer=tracer, counter=counter))
    if runs:
        runs[0].start()
    for i, run in enumerate(runs):
        if i + 1 < len(runs):
            runs[i + 1].start()
        run.compute()
    outputs: dict[int, torch.Tensor] = {}
    for run in runs:
        outputs.update(zip(run.batch.param_indices, run.finish()))
    phases = {"communication": sum(r.comm_seconds for r in runs),
              "newton_schulz": sum(r.ns_seconds for r in runs)}
    return outputs, phases
