"""Per-rank spans (what ran, when, how many bytes, on which path) and their Chrome-trace export.

Workers record; visualisation only reads. Times are seconds on the host's wall clock
(``time.time()``), so spans of ranks on one machine line up on one axis; Perfetto and
chrome://tracing open the exported JSON.

The clock. On CPU a mark is ``time.time()``: the work is done when the call returns. On CUDA,
kernels and NCCL collectives return before they run, so host clocks around them measure launches.
There a mark is a CUDA event recorded on the current stream (the compute stream) beside the host
time of the record (a ``GpuMark``): the event completes when the stream reaches it, i.e. when
the work queued before it is done. For a collective the engine marks after ``Pending.wait()``,
which makes the current stream wait for the collective, so that mark completes when the data has
arrived. Nothing synchronises during the step: spans hold provisional host (launch) times until
``resolve()``, which runs the first time spans or totals are read (``Tracer.spans``,
``tallies()``, ``Muon.last_step_spans()`` / ``last_step_stats()``). It synchronises the device
once, records an anchor event, waits for it and reads ``time.time()``; an event's time is then
``t_anchor - event.elapsed_time(anchor) / 1e3``, so GPU-timed spans stay on the host axis and
ranks on one machine still line up. A step whose spans are never read is never synchronised:
``reset()`` drops them.

Why events and not torch.profiler: a profiler session per step (Kineto/CUPTI activity tracing,
then post-processing every kernel and op) costs far more than the ~12 event records a batch needs
(a few microseconds each), needs a Kineto build, and cannot stay on in training; events are
always there, and name exactly the intervals the timeline shows. The profiler remains the tool
for kernel-level detail (tests/unit/test_gpu_spans.py checks the two agree on Newton-Schulz).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, is_dataclass
from typing import NamedTuple, Union

import torch
import torch.distributed as dist

from .._base import dist_on
from ..kernels.precision import is_number

# Which timeline row a phase belongs to.
LANES = {"momentum": "compute", "newton_schulz": "compute", "update": "compute", "adamw": "compute",
         "comm": "comm", "comm_out": "comm", "comm_back": "comm",
         # whole training steps (muonlab.trace.whole_step): the model's phases and FSDP2's collectives
         "forward": "compute", "backward": "compute", "optimizer": "compute",
         "all_gather": "comm", "reduce_scatter": "comm"}

OPTIMIZER_COMM = ("comm", "comm_out", "comm_back")
"""The optimizer's communication phases: each batch's own, with the bytes counted at its collectives."""


@dataclass
class Span:
    name: str
    """Phase: momentum, comm_out, newton_schulz, comm_back, update, adamw."""
    start: float
    end: float
    rank: int = 0
    path: str = ""
    """Communication path of the batch (local, all_to_all, agrs, owner, gather_all), if any."""
    batch: int = -1
    """Index of the batch in the plan, or -1 for whole-step phases."""
    bytes_sent: int = 0
    bytes_recv: int = 0
    step: int = -1
    """Index of the optimizer step the span belongs to (``muonlab.trace.StepRecorder`` numbers the
    steps it records), or -1: one step, not numbered (``Muon.last_step_spans()``)."""

    @property
    def duration(self) -> float:
        return self.end - self.start


class GpuMark(NamedTuple):
    """A point in a CUDA stream: its event, and the host time at which it was recorded."""

    host: float
    event: "torch.cuda.Event"


Mark = Union[float, GpuMark]
"""What ``Tracer.mark()`` returns: wall-clock seconds on CPU, a ``GpuMark`` on CUDA."""


class Tracer:
    """Collects the spans of one optimizer step on one rank.

    ``device``: where the step's work runs; a CUDA device times spans with CUDA events (see the
    module docstring), anything else (None, CPU) with the host wall clock.
    """

    def __init__(self, rank: int = 0, device: torch.device | str | None = None):
        self.rank = rank
        self.log: list[tuple] = []
        """The hot step's record, appended to as it runs (a list append, no Python call: the step
        records a dozen marks a batch), folded into spans and totals when read: per span
        ``(name, start mark, end mark, fields)``, per tally ``(key, start mark, end mark, None)``.
        On the CPU a new list starts a new step on the same clock (``reset`` also sets the clock;
        on CUDA it recycles the step's events too)."""
        self._seen, self._read = self.log, 0  # the log folded so far, and how much of it
        self._spans: list[Span] = []
        self._totals: dict[str, float] = {}
        self._pending: list[tuple[Span | str, Mark, Mark]] = []
        self._pool: list = []  # events of resolved or dropped steps, recorded again
        self.device = device

    @property
    def device(self) -> torch.device | None:
        """The clock's device (``clock`` is the same, a plain attribute the step reads)."""
        return self._device

    @device.setter
    def device(self, device: torch.device | str | None) -> None:
        device = None if device is None else torch.device(device)
        if device is not None and device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device != getattr(self, "_device", None):
            self._pool = []  # an event belongs to the device it was first recorded on
        self._device = self.clock = device
        self._gpu = device is not None and device.type == "cuda"
        # on the CPU a mark is the wall clock itself, a C call: a step marks about ten times a batch
        if self._gpu:
            self.__dict__.pop("mark", None)
        else:
            self.mark = time.time

    # ---------------------------------------------------------------- marks

    def mark(self) -> Mark:
        """Now: a float (wall clock) on CPU (where ``time.time`` itself stands in for this method);
        on CUDA an event recorded on the current stream."""
        if not self._gpu:
            return time.time()
        event = self._pool.pop() if self._pool else torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self._device))
        return GpuMark(time.time(), event)

    def add(self, name: str, start: Mark, end: Mark, **fields) -> Span:
        """A span between two marks (or wall-clock floats). On CUDA its times are the marks' host
        times until ``resolve()``."""
        self._fold()  # after what the log holds: spans stay in recording order
        return self._add(name, start, end, fields)

    def _add(self, name: str, start: Mark, end: Mark, fields: dict) -> Span:
        record = Span(name, start.host if type(start) is GpuMark else start,
                      end.host if type(end) is GpuMark else end, rank=self.rank, **fields)
        self._spans.append(record)
        if type(start) is GpuMark or type(end) is GpuMark:
            self._pending.append((record, start, end))
        return record

    def span(self, name: str, **fields) -> "_OpenSpan":
        """A context: the span from entering it to leaving it (recorded however it is left)."""
        opened = _OpenSpan.__new__(_OpenSpan)  # no __init__: one Python call less per span
        opened._tracer, opened._name, opened._fields = self, name, fields
        return opened

    def tally(self, key: str, start: Mark, end: Mark, *more: Mark) -> None:
        """Add the seconds between two marks to the total ``key`` (time that is no span of its own,
        e.g. the engine's exposed communication); ``more``: further (start, end) pairs, added too."""
        self._fold()
        self._tally(key, (start, end, *more))

    def _tally(self, key: str, marks: tuple) -> None:
        for i in range(0, len(marks), 2):
            start, end = marks[i], marks[i + 1]
            if type(start) is GpuMark or type(end) is GpuMark:
                self._totals.setdefault(key, 0.0)
                self._pending.append((key, start, end))
            else:
                self._totals[key] = self._totals.get(key, 0.0) + (end - start)

    # ---------------------------------------------------------------- reading

    @property
    def spans(self) -> list[Span]:
        """The spans recorded since ``reset()``, in recording order, resolved."""
        self.resolve()
        return self._spans

    def tallies(self) -> dict[str, float]:
        """The totals of ``tally()`` since ``reset()``, resolved."""
        self.resolve()
        return dict(self._totals)

    def resolve(self) -> None:
        """Give every span and total its GPU time on the host clock: one device synchronisation,
        then an anchor event read against ``time.time()``. A no-op on CPU or when resolved."""
        self._fold()
        if not self._pending:
            return
        torch.cuda.synchronize(self._device)
        anchor = torch.cuda.Event(enable_timing=True)
        anchor.record(torch.cuda.current_stream(self._device))
        anchor.synchronize()
        # taken after the anchor completed: a later bound, so no event is placed before its launch
        t_anchor = time.time()

        def at(mark: Mark) -> float:
            if isinstance(mark, GpuMark):
                return t_anchor - mark.event.elapsed_time(anchor) / 1e3
            return mark

        for target, start, end in self._pending:
            if isinstance(target, Span):
                target.start, target.end = at(start), at(end)
            elif isinstance(start, GpuMark) and isinstance(end, GpuMark):  # one subtraction fewer
                self._totals[target] += start.event.elapsed_time(end.event) / 1e3
            else:
                self._totals[target] += at(end) - at(start)
        self._recycle()

    def reset(self, device: torch.device | str | None = ...) -> None:
        """Start a new step (on ``device``, if given). Unread spans are dropped, never synchronised."""
        self._recycle()
        self._spans, self._totals = [], {}
        self.log = []
        self._seen, self._read = self.log, 0
        if device is not ...:
            self.device = device

    def _fold(self) -> None:
        """The log's entries not yet read, as spans and totals (a new log: a new step)."""
        log = self.log
        if log is not self._seen:
            self._recycle()
            self._spans, self._totals, self._seen, self._read = [], {}, log, 0
        if self._read < len(log):
            entries, self._read = log[self._read:], len(log)
            for name, start, end, fields in entries:
                if fields is None:
                    self._tally(name, (start, end))
                else:
                    self._add(name, start, end, fields)

    def _recycle(self) -> None:
        # once per event: a mark often ends one span and starts the next (two marks sharing an
        # event would overwrite each other's time); recording an event again overwrites its state.
        # The pending marks, and those of log entries never read (a step whose spans were not read)
        unread = self._seen[self._read:]
        events = {id(m.event): m.event for _, *marks in (*self._pending, *unread) for m in marks
                  if isinstance(m, GpuMark)}
        self._pool.extend(events.values())
        self._pending = []

    # ---------------------------------------------------------------- copies

    def __getstate__(self) -> dict:
        """Resolved spans and totals only: events are live device objects."""
        self.resolve()
        return dict(rank=self.rank, device=self._device, spans=self._spans, totals=self._totals)

    def __setstate__(self, state: dict) -> None:
        # also reads the dataclass Tracer pickled before marks existed (rank and spans only)
        self.__init__(state.get("rank", 0), state.get("device"))
        self._spans = list(state.get("spans", []))
        self._totals = dict(state.get("totals", {}))


class _OpenSpan:
    """``Tracer.span``'s context (a class, not a generator-based context manager: a step opens two
    per batch, and each generator context costs several more Python calls)."""

    __slots__ = ("_tracer", "_name", "_fields", "_start", "_record")  # set by Tracer.span

    def __enter__(self) -> Span:
        tracer = self._tracer
        start = self._start = tracer.mark()
        host = start.host if type(start) is GpuMark else start
        self._record = Span(self._name, host, host, rank=tracer.rank, **self._fields)
        return self._record

    def __exit__(self, *exc) -> bool:
        tracer, record = self._tracer, self._record
        end = tracer.mark()
        tracer._fold()
        record.end = end.host if type(end) is GpuMark else end
        tracer._spans.append(record)
        if type(end) is GpuMark:
            tracer._pending.append((record, self._start, end))
        return False


def gather_spans(spans: list[Span], group=None, dst: int = 0) -> list[Span] | None:
    """All ranks' spans on ``dst`` (None elsewhere); the local list when not distributed."""
    if not dist_on() or dist.get_world_size(group) == 1:
        return list(spans)
    rows = [asdict(s) for s in spans]
    out = [None] * dist.get_world_size(group) if dist.get_rank() == dst else None
    dist.gather_object(rows, out, dst=dst, group=group)
    if out is None:
        return None
    return [Span(**row) for rank_rows in out for row in rank_rows]


class RecordedSpans:
    """What a recorder of spans gives besides its own ``spans()`` (this rank's): the spans as rows
    and every rank's rows on one rank."""

    def spans(self) -> list[Span]:
        raise NotImplementedError

    def rows(self) -> list[dict]:
        """``spans()`` as plain dicts (what a worker returns to the notebook)."""
        return [asdict(s) for s in self.spans()]

    def gather(self, group=None, dst: int = 0) -> list[dict] | None:
        """Every rank's ``rows()`` on ``dst`` (None on the other ranks); a collective, so every rank
        of ``group`` calls it. This rank's rows when not distributed."""
        spans = gather_spans(self.spans(), group=group, dst=dst)
        return None if spans is None else [asdict(s) for s in spans]


_OPTIONAL = dict(path="", batch=-1, bytes_sent=0, bytes_recv=0, step=-1)
"""Span fields a row may leave out, with Span's defaults."""


def span_rows(spans: Iterable) -> list[dict]:
    """``Span``s or their ``asdict`` rows (``train_worker(...)["spans"]``) as dicts with every Span
    field, checked: what the timeline and the Chrome-trace export read. A ValueError names the
    first span without a rank, name, start or end, whose times are not real numbers (None, a
    string, a bool), or whose times are not finite with end not before start (a plot would fail on
    its axis limits, a trace be invalid JSON)."""
    rows = [dict(_OPTIONAL, **(asdict(s) if is_dataclass(s) else s)) for s in spans]
    for i, r in enumerate(rows):
        missing = [k for k in ("rank", "name", "start", "end") if k not in r]
        if missing:
            raise ValueError(f"span {i} ({r}) lacks {missing}")
        start, end = r["start"], r["end"]
        # checked first: math.isfinite would raise a TypeError naming no span (rows read back from a
        # CSV carry strings)
        if not (is_number(start) and is_number(end)):
            raise ValueError(f"span {i} ({r['name']!r} on rank {r['rank']}) runs from {start!r} to {end!r}: "
                             "start and end must be real numbers (seconds)")
        if not (math.isfinite(start) and math.isfinite(end)) or end < start:
            raise ValueError(f"span {i} ({r['name']!r} on rank {r['rank']}) runs from {start} to {end}: "
                             "start and end must be finite, end not before start")
        step = r["step"]
        if isinstance(step, bool) or not isinstance(step, int):  # a step table groups by it
            raise ValueError(f"span {i} ({r['name']!r} on rank {r['rank']}) has step {step!r}: an integer "
                             "(-1: a step not numbered)")
    return rows


def to_chrome_trace(spans: Iterable) -> dict:
    """Chrome trace-event JSON of ``Span``s or their rows (see ``span_rows``): one process per rank;
    compute on one thread, and each batch's communication on a thread of its own (batches overlap,
    and a thread's events must nest); other communication (FSDP2's collectives of a whole step,
    ``muonlab.trace.whole_step``) on a thread per path. Spans of numbered steps (``step`` >= 0, a
    ``StepRecorder``'s or a ``WholeStepRecorder``'s) also give each rank's step an event "step k"
    on a thread of its own, from its first span's start to its last span's end, so Perfetto shows
    where each of many steps begins; a span's args carry its step."""
    rows = span_rows(spans)
    t0 = min((s["start"] for s in rows), default=0.0)

    def comm_key(s: dict) -> tuple:  # an optimizer batch's (no batch: batch -1) thread, or a path's
        return (0, s["batch"], "") if s["name"] in OPTIMIZER_COMM else (1, 0, s["path"] or s["name"])

    # compute on thread 1, each batch's communication on its own, then each other path's
    keys = sorted({comm_key(s) for s in rows if LANES.get(s["name"]) == "comm"})
    comm_thread = {key: 2 + k for k, key in enumerate(keys)}
    events = []
    for s in rows:
        lane = LANES.get(s["name"], "compute")
        events.append(dict(
            name=f"{s['name']}[{s['path']}]" if s["path"] else s["name"], ph="X", pid=s["rank"],
            tid=comm_thread[comm_key(s)] if lane == "comm" else 1, ts=(s["start"] - t0) * 1e6,
            dur=(s["end"] - s["start"]) * 1e6,
            args={k: s[k] for k in ("path", "batch", "bytes_sent", "bytes_recv", "step")},
        ))
    extents: dict[tuple[int, int], list[float]] = {}  # (rank, step) -> [first start, last end]
    for s in rows:
        if s["step"] >= 0:
            ext = extents.setdefault((s["rank"], s["step"]), [s["start"], s["end"]])
            ext[0], ext[1] = min(ext[0], s["start"]), max(ext[1], s["end"])
    for (rank, step), (start, end) in sorted(extents.items()):
        events.append(dict(name=f"step {step}", ph="X", pid=rank, tid=0, ts=(start - t0) * 1e6,
                           dur=(end - start) * 1e6, args=dict(step=step)))
    # whole training steps (muonlab.trace.whole_step) begin at the forward, not the optimizer
    step_thread = "training step" if any(s["name"] in ("forward", "backward") for s in rows) else "optimizer step"
    for r in sorted({s["rank"] for s in rows}):
        events.append(dict(name="process_name", ph="M", pid=r, args=dict(name=f"rank {r}")))
        if any(rank == r for rank, _ in extents):
            events.append(dict(name="thread_name", ph="M", pid=r, tid=0, args=dict(name=step_thread)))
        events.append(dict(name="thread_name", ph="M", pid=r, tid=1, args=dict(name="compute")))
        for key in sorted({comm_key(s) for s in rows if s["rank"] == r and LANES.get(s["name"]) == "comm"}):
            label = f"comm batch {key[1]}" if key[0] == 0 else f"comm {key[2]}"
            events.append(dict(name="thread_name", ph="M", pid=r, tid=comm_thread[key], args=dict(name=label)))
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(spans: Iterable, path) -> None:
    """``to_chrome_trace`` of ``spans`` written to ``path``; a bad span is refused before the file is opened."""
    text = json.dumps(to_chrome_trace(spans), allow_nan=False)  # strict JSON: Perfetto rejects NaN
    with open(path, "w") as f:
        f.write(text)
