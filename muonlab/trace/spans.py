"""Per-rank spans (what ran, when, how many bytes, on which path) and their Chrome-trace export.

Workers record; visualisation only reads. Times are wall-clock seconds (time.time()), so spans of
ranks on one machine line up on one axis; Perfetto and chrome://tracing open the exported JSON.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch.distributed as dist

# Which timeline row a phase belongs to.
LANES = {"momentum": "compute", "newton_schulz": "compute", "update": "compute", "adamw": "compute",
         "comm": "comm", "comm_out": "comm", "comm_back": "comm"}


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

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class Tracer:
    """Collects the spans of one optimizer step on one rank."""

    rank: int = 0
    spans: list[Span] = field(default_factory=list)

    def reset(self) -> None:
        self.spans = []

    @contextmanager
    def span(self, name: str, **fields):
        start = time.time()
        record = Span(name, start, start, rank=self.rank, **fields)
        try:
            yield record
        finally:
            record.end = time.time()
            self.spans.append(record)

    def add(self, name: str, start: float, end: float, **fields) -> Span:
        record = Span(name, start, end, rank=self.rank, **fields)
        self.spans.append(record)
        return record


def gather_spans(spans: list[Span], group=None, dst: int = 0) -> list[Span] | None:
    """All ranks' spans on ``dst`` (None elsewhere); the local list when not distributed."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return list(spans)
    rows = [asdict(s) for s in spans]
    out = [None] * dist.get_world_size(group) if dist.get_rank() == dst else None
    dist.gather_object(rows, out, dst=dst, group=group)
    if out is None:
        return None
    return [Span(**row) for rank_rows in out for row in rank_rows]


def to_chrome_trace(spans: list[Span]) -> dict:
    """Chrome trace-event JSON: one process per rank; compute on one thread, and each batch's
    communication on a thread of its own (batches overlap, and a thread's events must nest)."""
    t0 = min((s.start for s in spans), default=0.0)
    events = []
    for s in spans:
        lane = LANES.get(s.name, "compute")
        events.append(dict(
            name=f"{s.name}[{s.path}]" if s.path else s.name, ph="X", pid=s.rank,
            tid=2 + max(s.batch, 0) if lane == "comm" else 1, ts=(s.start - t0) * 1e6, dur=max(s.duration, 0.0) * 1e6,
            args=dict(path=s.path, batch=s.batch, bytes_sent=s.bytes_sent, bytes_recv=s.bytes_recv),
        ))
    for r in sorted({s.rank for s in spans}):
        events.append(dict(name="process_name", ph="M", pid=r, args=dict(name=f"rank {r}")))
        events.append(dict(name="thread_name", ph="M", pid=r, tid=1, args=dict(name="compute")))
        for b in sorted({s.batch for s in spans if s.rank == r and LANES.get(s.name) == "comm"}):
            events.append(dict(name="thread_name", ph="M", pid=r, tid=2 + max(b, 0),
                               args=dict(name=f"comm batch {b}")))
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(spans: list[Span], path) -> None:
    with open(path, "w") as f:
        json.dump(to_chrome_trace(spans), f)
