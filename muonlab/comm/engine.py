"""Run a plan batch by batch: momentum in, move, orthogonalize, move back, update, with the
next batch's communication in flight.

Each batch is one generator of its path (muonlab.comm.paths), which yields its work: the way
out (a collective in flight), its whole matrices, the way back. The engine counts each
collective's bytes once, waits on it, runs Newton-Schulz (the optimizer's ``orthogonalize``), and
records the spans. The optimizer hands in two callbacks, ``prepare(batch)`` (this rank's momentum
inputs of the batch) and ``apply(batch, outputs)`` (its update), so a batch's inputs, matrices and
outputs exist only while the batch is in flight: a step's transient memory is a few batches, not
the whole model. The order on every rank (the plan is identical everywhere, so collectives line up) is

    out(0), out(1), [wait out(0), NS(0), back(0)], out(2), [wait out(1), NS(1), back(1)],
    [wait back(0), apply(0)], out(3), [wait out(2), NS(2), back(2)], [wait back(1), apply(1)], ...

so batch i+1's transfer travels while batch i's Newton-Schulz runs, and batch i's way back travels
while batch i+1's runs (async collectives). A batch without a way back is applied at once. A batch
without a way out (the local and owner paths) starts only after the previous batch's Newton-Schulz:
taking its inputs early would overlap nothing and hold two batches' inputs at once. A wave of
small batches (``WaveRun``, planned by muonlab.comm.planner.coalesce) takes one place in that
order: all its ways out in one collective, all its ways back in another.

Memory: with a ``BufferCounter`` (muonlab.comm.memory) the engine counts the buffers each batch
allocates where it sees them (a collective's send and receive buffers, the matrices handed to
Newton-Schulz, its output, the outputs), each new storage once, held until the batch is applied;
the plan's ``buffer_peaks`` replays this order with each path's formula.

Times are the tracer's marks (muonlab.trace): wall clock on CPU, CUDA events on the compute stream
on a GPU, so nothing here synchronises; ``phase_seconds(tracer)`` reads the totals after the step.
Spans and tallies go straight into the tracer's ``log`` (appends, no call into the tracer), which
the tracer folds when they are read.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..kernels.newton_schulz import newton_schulz
from ..trace import Tracer
from .collectives import Coalesced, CommCounter, Pending
from .memory import BufferCounter
from .paths import PATHS, PathContext
from .records import BatchPlan, Plan
from .specs import GroupKey

COMMUNICATION = "communication"
"""The tracer tally of the time a rank spends issuing, waiting for and (un)packing collectives."""


class BatchRun:
    """One batch on one rank: its path's generator, what it yielded last, and its marks.

    Time spent issuing a collective, waiting for it and (un)packing around it is tallied as
    "communication"; with Newton-Schulz it is measured with the tracer's marks, so on CUDA it is
    GPU time of the compute stream (how long it stalled on a collective), resolved after the step.
    """

    def __init__(self, index: int, batch: BatchPlan, ctx: PathContext, *, prepare, apply, orthogonalize,
                 tracer: Tracer, counter: CommCounter, memory: BufferCounter | None = None):
        self.index, self.batch, self.path = index, batch, batch.path
        self._ctx, self._prepare, self._apply, self._orthogonalize = ctx, prepare, apply, orthogonalize
        self._tracer, self._counter, self._memory = tracer, counter, memory
        self.owner = self  # what its buffers are held by: itself, or its wave
        self.indices = (batch.index,)
        self._bytes = {"out": (0, 0), "back": (0, 0)}
        self._item = None
        self._start = self._back_start = None  # marks: the way out issued, the way back issued
        self.started = self.done = False

    def _advance(self, value, direction: str):
        """Resume the generator with ``value``; a collective it yields is counted here, once."""
        item = self._gen.send(value)
        if isinstance(item, Pending):
            self._counter.add(self.path, item.sent, item.recv, calls=item.calls)
            self._bytes[direction] = (item.sent, item.recv)
            self._count(item.buffers)
            if item.out is not None:
                self._count(item.out)
            else:  # deferred: its wave makes it (``_received`` knows it then)
                self._count_bytes(item.recv_nbytes)
            item.buffers = ()  # counted: the collective holds what it still needs
        else:
            self._count(item)  # the matrices handed to Newton-Schulz
        return item

    def _count(self, tensors) -> None:
        if self._memory is not None:
            self._memory.count(self.owner, self.batch.index, tensors)

    def _received(self, pending: Pending) -> torch.Tensor:
        """Wait for ``pending``; its output is a buffer counted already (views of it are no more)."""
        out = pending.wait()
        if self._memory is not None:
            self._memory.know(self.owner, (out,))
        return out

    def _count_bytes(self, nbytes: int) -> None:
        if self._memory is not None:
            self._memory.add(self.owner, self.batch.index, nbytes)

    def start(self) -> None:
        """Take the batch's inputs and issue the way out (a path with none yields its matrices at once)."""
        self.started = True
        inputs = self._prepare(self.batch)
        if self._memory is not None:
            self._memory.know(self.owner, inputs)  # the momentum inputs: not the path's allocations
        self._gen = PATHS[self.path].run(self.batch, inputs, self._ctx)
        del inputs  # the path holds what it still needs
        tracer = self._tracer
        self._start = tracer.mark()
        self._item = self._advance(None, "out")
        tracer.log.append((COMMUNICATION, self._start, tracer.mark(), None))

    def _record_comm(self, direction: str, end) -> None:
        """The span of the way ``direction`` ("out" or "back"), from its issue to ``end``."""
        sent, recv = self._bytes[direction]
        start = self._start if direction == "out" else self._back_start
        self._tracer.log.append((f"comm_{direction}", start, end, dict(path=self.path, batch=self.index,
                                                                      bytes_sent=sent, bytes_recv=recv)))

    def compute(self) -> None:
        """Wait for the way out, orthogonalize, issue the way back (or apply, without one)."""
        tracer = self._tracer
        t0 = tracer.mark()
        mats, self._item = self._item, None
        if isinstance(mats, Pending):
            mats = self._advance(self._received(mats), "out")
        t1 = tracer.mark()  # on CUDA after wait(): the current stream has waited for the data
        exposed = (t0, t1)  # tallied with the way back's issue below, in one call
        self._record_comm("out", t1)
        self._back_start = t1
        ortho = None
        if mats is not None:
            ortho = self._orthogonalize(mats, self.batch.ns_config)
            self._count(ortho)
            del mats
            self._back_start = tracer.mark()
            tracer.log.append(("newton_schulz", t1, self._back_start, dict(path=self.path, batch=self.index)))
        outputs = None
        try:
            self._item = self._advance(ortho, "back")
        except StopIteration as done:  # no way back: the outputs are ready
            outputs = done.value
        tracer.log.extend(((COMMUNICATION, *exposed, None), (COMMUNICATION, self._back_start, tracer.mark(), None)))
        if outputs is not None:
            self._apply_outputs(outputs)

    def _apply_outputs(self, outputs: list) -> None:
        self._count(outputs)
        self._apply(self.batch, outputs)
        self.done = True
        if self._memory is not None and self.owner is self:
            self._memory.release(self)

    def finish(self) -> None:
        """Wait for the way back, then apply this rank's output per parameter of the batch."""
        if self.done:
            return
        tracer = self._tracer
        t0 = tracer.mark()
        if not isinstance(self._item, Pending):  # pragma: no cover - the path broke the protocol
            raise AssertionError(f"path {self.path!r} yielded {type(self._item).__name__} as its way back")
        try:
            self._gen.send(self._received(self._item))
        except StopIteration as done:
            outputs = done.value
        else:  # pragma: no cover - a path that yields after its way back
            raise AssertionError(f"path {self.path!r} yielded after its way back")
        self._item = None
        t1 = tracer.mark()
        tracer.log.append((COMMUNICATION, t0, t1, None))
        self._record_comm("back", t1)
        self._apply_outputs(outputs)


class WaveRun:
    """The batches of one wave (``BatchPlan.travels_with``) run as one: every batch takes its
    inputs and packs its way out, the wave sends them in one collective (``Coalesced``), then
    every batch orthogonalizes and packs its way back, sent in one more; each batch applies its
    own outputs. Its members' spans and bytes are their own; the wave counts each collective once.
    """

    def __init__(self, runs: list[BatchRun], *, group, group_rank: int, tracer: Tracer, counter: CommCounter,
                 memory: BufferCounter | None = None):
        self.runs, self.path = runs, runs[0].path
        self._group, self._group_rank, self._tracer, self._counter = group, group_rank, tracer, counter
        self._memory = memory
        for run in runs:
            run.owner = self
        self.started = self.done = False

    @property
    def indices(self) -> tuple[int, ...]:
        return tuple(run.batch.index for run in self.runs)

    def _send_together(self) -> None:
        """Issue the members' deferred collectives (the way they are at) as one."""
        t0 = self._tracer.mark()
        if self._memory is not None:  # the wave's buffers hold each member's send and receive buffers again
            for run in self.runs:
                self._memory.add(self, run.batch.index, run._item.request[0].nbytes + run._item.recv_nbytes)
        Coalesced([run._item for run in self.runs], group=self._group, group_rank=self._group_rank)
        self._counter.add(self.path, 0, 0)
        self._tracer.log.append((COMMUNICATION, t0, self._tracer.mark(), None))

    def start(self) -> None:
        self.started = True
        for run in self.runs:
            run.start()
        self._send_together()

    def compute(self) -> None:
        for run in self.runs:
            run.compute()
        self._send_together()

    def finish(self) -> None:
        for run in self.runs:
            run.finish()
        self.done = True
        if self._memory is not None:
            self._memory.release(self)


def phase_seconds(tracer: Tracer) -> dict[str, float]:
    """The communication and Newton-Schulz seconds of the plan(s) ``tracer`` recorded since its
    reset: the sum of the tallied communication intervals (issue, wait, (un)pack) and of the
    newton_schulz spans. Reading them resolves the tracer (one synchronisation on CUDA)."""
    return {"communication": tracer.tallies().get(COMMUNICATION, 0.0),
            "newton_schulz": sum(s.duration for s in tracer.spans if s.name == "newton_schulz")}


def path_contexts(plan: Plan, groups: dict, device: torch.device | None = None) -> list[PathContext]:
    """Each batch's ``PathContext`` on this rank (its group, wire dtype and device): the same at
    every step of a plan, so a caller that runs one plan many times makes them once."""
    return [PathContext(*groups[b.group], b.wire_dtype, device, defer=b.travels_with is not None) for b in plan.batches]


def execute_plan(
    plan: Plan,
    groups: dict[GroupKey | None, tuple[object, int]],
    *,
    prepare: Callable[[BatchPlan], list],
    apply: Callable[[BatchPlan, list], None],
    orthogonalize: Callable[[torch.Tensor, object], torch.Tensor] = newton_schulz,
    tracer: Tracer,
    counter: CommCounter,
    device: torch.device | None = None,
    contexts: list[PathContext] | None = None,
    memory: BufferCounter | None = None,
) -> None:
    """Run every batch of ``plan`` on this rank, recording its spans and communication time in
    ``tracer`` (read them with ``phase_seconds(tracer)``; the callbacks time themselves).

    ``groups``: {GroupKey: (torch ProcessGroup, this rank's index in it)} for every batch's group.
    ``prepare(batch)``: this rank's input per parameter of the batch (None where it has none).
    ``apply(batch, outputs)``: consume this rank's orthogonalized output per parameter.
    ``orthogonalize(mats, ns_config)``: Newton-Schulz on what a path yields, a stack of whole
    matrices or a list of pieces (``Overwrite`` pieces take the result in place).
    ``device``: where this rank's tensors live (``PathContext.device``).
    Each batch's matrices travel in its own wire dtype (``BatchPlan.wire_dtype``).
    ``contexts``: ``path_contexts(plan, groups, device)``, where the caller keeps them (else made here).
    ``memory``: counts the buffers each batch allocates (muonlab.comm.memory); None: ``counter.memory``.
    """
    if contexts is None:
        contexts = path_contexts(plan, groups, device)
    if memory is None:
        if counter.memory is None:
            counter.memory = BufferCounter()
        memory = counter.memory
    runs: list[BatchRun | WaveRun] = []
    for i, (batch, ctx) in enumerate(zip(plan.batches, contexts)):  # the tuple: iterating a Plan is a call
        run = BatchRun(i, batch, ctx, prepare=prepare, apply=apply, orthogonalize=orthogonalize, tracer=tracer,
                       counter=counter, memory=memory)
        if ctx.defer and not batch.pays_latency:  # a later member of the wave just before it
            runs[-1].runs.append(run)
            run.owner = runs[-1]
        elif ctx.defer:  # the first member of a wave
            runs.append(WaveRun([run], group=ctx.group, group_rank=ctx.group_rank, tracer=tracer, counter=counter,
                                memory=memory))
        else:
            runs.append(run)
    if not runs:
        return
    runs[0].start()
    for i, run in enumerate(runs):
        following = runs[i + 1] if i + 1 < len(runs) else None
        if following is not None and PATHS[following.path].out_share > 0:
            following.start()  # its way out travels behind this batch's Newton-Schulz
        run.compute()
        if i >= 1:
            runs[i - 1].finish()  # its way back travelled behind this batch's Newton-Schulz
        if following is not None and not following.started:
            following.start()
    runs[-1].finish()
