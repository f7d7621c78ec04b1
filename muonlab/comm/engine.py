"""Run a plan: move, orthogonalize, move back, with the next batch's communication in flight.

Each batch is one generator of its path (muonlab.comm.paths), driven in three resumptions. The
order on every rank (the plan is identical everywhere, so collectives line up) is

    out(0), out(1), [wait out(0), NS(0), back(0)], out(2), [wait out(1), NS(1), back(1)], ...
    then every batch's wait back, in order,

so batch i+1's transfer travels while batch i's Newton-Schulz runs (async collectives). The
``BatchRun`` handed to the generator counts each collective's bytes once and records the spans.
"""

from __future__ import annotations

import time

import torch

from ..kernels.newton_schulz import newton_schulz
from ..trace import Tracer
from .collectives import CommCounter, Pending
from .paths import PATHS
from .records import BatchPlan, Plan
from .specs import GroupKey


class BatchRun:
    """One batch on one rank: the context its path's generator runs in, and its timing."""

    def __init__(self, index: int, batch: BatchPlan, inputs: list, pg, group_rank: int, *,
                 wire_dtype: torch.dtype, tracer: Tracer, counter: CommCounter):
        self.index, self.batch, self.path = index, batch, batch.path
        self.group, self.group_rank, self.wire_dtype = pg, group_rank, wire_dtype
        self._tracer, self._counter = tracer, counter
        self._gen = PATHS[batch.path].run(batch, inputs, self)
        self._bytes = {"out": [0, 0], "back": [0, 0]}
        self._direction = "out"
        self.comm_seconds = 0.0
        self.ns_seconds = 0.0

    # ---- what a path's generator calls

    def send(self, pending: Pending) -> Pending:
        """A collective was started: count its bytes (once, here) for this direction."""
        self._counter.add(self.path, pending.sent, pending.recv)
        counts = self._bytes[self._direction]
        counts[0] += pending.sent
        counts[1] += pending.recv
        return pending

    def wait(self, pending: Pending) -> torch.Tensor:
        return pending.wait()

    def orthogonalize(self, mats: torch.Tensor | None) -> torch.Tensor | None:
        """Newton-Schulz on this rank's whole matrices (None: it has none in this batch). Ends the
        way out: what the path sends after this is the way back."""
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
        self._direction = "back"
        self._back_start = time.time()
        return ortho

    # ---- what the engine calls

    def start(self) -> None:
        """Issue the way out."""
        self._start = time.time()
        next(self._gen)
        self.comm_seconds += time.time() - self._start

    def compute(self) -> None:
        """Wait for the way out, orthogonalize, issue the way back."""
        t0 = time.time()
        next(self._gen)
        assert self._direction == "back", f"path {self.path!r} never called ctx.orthogonalize"
        self.comm_seconds += time.time() - t0 - self.ns_seconds

    def finish(self) -> list[torch.Tensor]:
        """Wait for the way back; this rank's output per parameter of the batch."""
        t0 = time.time()
        try:
            next(self._gen)
        except StopIteration as done:
            outputs = done.value
        else:  # pragma: no cover - a path with a third yield
            raise AssertionError(f"path {self.path!r} yielded more than twice")
        t1 = time.time()
        self.comm_seconds += t1 - t0
        if PATHS[self.path].collectives:  # a path that moves nothing has no way back to show
            sent, recv = self._bytes["back"]
            self._tracer.add("comm_back", self._back_start, t1, path=self.path, batch=self.index,
                             bytes_sent=sent, bytes_recv=recv)
        return outputs


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
        runs.append(BatchRun(i, batch, [inputs[j] for j in batch.param_indices], pg, group_rank,
                             wire_dtype=wire_dtype, tracer=tracer, counter=counter))
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
