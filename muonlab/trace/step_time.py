"""Where optimizer step time goes, per rank, path and phase, from the spans of many steps.

The spans are ``Span``s or their rows (``StepRecorder.gather()``, ``train_worker(...)["step_spans"]``),
each with its rank and step. Per rank and step, as Holistic Trace Analysis measures traces:

- compute: the union of the rank's compute spans (momentum, newton_schulz, update, adamw; of a
  whole step, ``muonlab.trace.whole_step``'s, also forward and backward: the "compute" lane of
  ``muonlab.trace.spans.LANES``);
- communication on a path: the union of the rank's comm spans of that path (comm_out, comm_back;
  FSDP2's all-gathers and reduce-scatters are the paths fsdp_all_gather and fsdp_reduce_scatter);
  a comm span runs from the collective's issue to the end of the wait for it. Path "all": the
  union over every path;
- overlapped communication: the part of that union the rank's compute covers, i.e. a collective
  in flight while the rank computed;
- exposed communication: the rest, time in which the rank had a collective in flight and computed
  nothing: issuing, waiting, (un)packing, and host work between spans. Two paths in flight at once
  both count their shared time, so per-path exposed times can add up to more than "all"'s;
- the step's spanned time: from the rank's first span of the step to its last (of an optimizer
  step's spans, forward, backward and the optimizer's control exchange before its first span are
  outside it; of a whole step's, it runs from the forward's start to the optimizer's last span).

Across steps: the median, min and max of each per-step value (the spread is step-to-step
variation), and the overlap share as overlapped / communication summed over the steps. Times are
what the spans hold: GPU time on CUDA (events), the host's wall clock elsewhere.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable

from .spans import LANES, span_rows

__all__ = ["PHASE_ORDER", "exposed_comm_table", "format_table", "intersection", "merge", "per_step",
           "phase_table", "select_steps", "subtract", "total"]

PHASE_ORDER = ("forward", "all_gather", "backward", "reduce_scatter", "optimizer", "adamw", "momentum", "comm_out",
               "newton_schulz", "comm_back", "update")
"""Phases in the order a step runs them (tables list unknown span names after them)."""

Interval = tuple[float, float]


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of ``(start, end)`` intervals as sorted, disjoint intervals; touching ones are
    joined and empty ones dropped."""
    out: list[list[float]] = []
    for start, end in sorted((s, e) for s, e in intervals if e > s):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e) for s, e in out]


def total(merged: Iterable[Interval]) -> float:
    """The length of disjoint intervals (``merge``'s)."""
    return sum(e - s for s, e in merged)


def intersection(a: list[Interval], b: list[Interval]) -> float:
    """The length of the overlap of two lists of sorted, disjoint intervals (``merge``'s)."""
    i = j = 0
    length = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            length += hi - lo
        if a[i][1] < b[j][1]:  # the one that ends first can overlap nothing further
            i += 1
        else:
            j += 1
    return length


def subtract(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """The parts of ``a`` that ``b`` does not cover (both sorted and disjoint, ``merge``'s)."""
    out: list[Interval] = []
    j = 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:  # holes that end before this interval
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            if b[k][0] > start:
                out.append((start, b[k][0]))
            start = max(start, b[k][1])
            k += 1
        if end > start:
            out.append((start, end))
    return out


def _is_comm(row: dict) -> bool:
    return LANES.get(row["name"], "compute") == "comm"


def select_steps(rows: list[dict], steps) -> list[dict]:
    """The span rows (``span_rows``'s) of the steps asked for: None every step, an int the last
    ``steps`` of them, else the step numbers listed (a ValueError names those absent)."""
    present = sorted({r["step"] for r in rows})
    if steps is None:
        return rows
    if isinstance(steps, int) and not isinstance(steps, bool):
        if steps < 1:
            raise ValueError(f"steps must be >= 1 (the last k steps) or a list of step numbers, got {steps}")
        keep = set(present[-steps:])
    else:
        try:
            keep = set(steps)
        except TypeError:
            raise ValueError(f"steps must be None, an int (the last k steps) or a list of step numbers, "
                             f"got {steps!r}") from None
        missing = sorted(keep - set(present))
        if missing:
            raise ValueError(f"steps {missing} have no spans; the spans hold steps {present}")
    return [r for r in rows if r["step"] in keep]


def per_step(spans, steps=None) -> list[dict]:
    """One dict per (step, rank), ordered by step then rank: ``step``, ``rank``, ``spanned``
    (seconds from the first span to the last), ``phases`` ({span name: seconds covered}),
    ``comm`` and ``exposed`` ({path or "all": seconds}, see the module docstring). Spans without a
    path count under "all" only. ``steps``: which steps (``select_steps``)."""
    groups: dict[tuple[int, int], list[dict]] = {}
    for r in select_steps(span_rows(spans), steps):  # checked: a bad span is named before anything is computed
        groups.setdefault((r["step"], r["rank"]), []).append(r)
    out = []
    for (step, rank), rows in sorted(groups.items()):
        compute = merge((r["start"], r["end"]) for r in rows if not _is_comm(r))
        comm_rows = [r for r in rows if _is_comm(r)]
        paths = sorted({r["path"] for r in comm_rows if r["path"]})
        comm, exposed = {}, {}
        for path in [*paths, "all"]:
            mine = merge((r["start"], r["end"]) for r in comm_rows if path == "all" or r["path"] == path)
            comm[path] = total(mine)
            exposed[path] = comm[path] - intersection(mine, compute)
        names = {r["name"] for r in rows}
        phases = {name: total(merge((r["start"], r["end"]) for r in rows if r["name"] == name))
                  for name in [*[p for p in PHASE_ORDER if p in names], *sorted(names - set(PHASE_ORDER))]}
        spanned = max(r["end"] for r in rows) - min(r["start"] for r in rows)
        out.append(dict(step=step, rank=rank, spanned=spanned, phases=phases, comm=comm, exposed=exposed))
    return out


def _spread(values: list[float], scale: float = 1e3) -> tuple[float, float, float]:
    return statistics.median(values) * scale, min(values) * scale, max(values) * scale


def exposed_comm_table(spans, steps=None) -> list[dict]:
    """Per rank and path (then "all", where the rank used several paths), over the steps in which
    the rank used the path: ``steps``,
    ``comm_ms`` (median), ``exposed_ms`` (median), ``exposed_min_ms``, ``exposed_max_ms``,
    ``overlap_share`` (overlapped / communication over those steps; None without communication)
    and ``exposed_share`` (median exposed / the step's spanned time). ``steps``: which steps
    (``select_steps``: e.g. ``range(1, n)`` leaves out a first step that built the plan). See the
    module docstring."""
    stepwise = per_step(spans, steps)
    by_key: dict[tuple[int, str], list[dict]] = {}
    for s in stepwise:
        for path in s["comm"]:
            by_key.setdefault((s["rank"], path), []).append(s)
    for rank in {s["rank"] for s in stepwise}:  # "all" repeats the row of a rank's only path
        if len({p for r, p in by_key if r == rank and p != "all"}) == 1:
            del by_key[(rank, "all")]
    rows = []
    for (rank, path), steps in sorted(by_key.items(), key=lambda kv: (kv[0][0], kv[0][1] == "all", kv[0][1])):
        comm = [s["comm"][path] for s in steps]
        exposed = [s["exposed"][path] for s in steps]
        median, low, high = _spread(exposed)
        comm_sum = sum(comm)
        rows.append(dict(
            rank=rank, path=path, steps=len(steps), comm_ms=statistics.median(comm) * 1e3, exposed_ms=median,
            exposed_min_ms=low, exposed_max_ms=high,
            overlap_share=(comm_sum - sum(exposed)) / comm_sum if comm_sum > 0 else None,
            exposed_share=statistics.median(s["exposed"][path] / s["spanned"] if s["spanned"] > 0 else 0.0
                                            for s in steps)))
    return rows


def phase_table(spans, steps=None) -> list[dict]:
    """Per rank and phase (span name, in ``PHASE_ORDER``), then "exposed comm" and "step" (the
    spanned time), over the steps in which the phase ran on the rank: ``steps``, ``median_ms``,
    ``min_ms``, ``max_ms`` and ``share`` (median of the phase's time / the step's spanned time).
    A phase's time is the time its spans cover (batches in flight together count once).
    ``steps``: which steps (``select_steps``)."""
    by_key: dict[tuple[int, str], list[tuple[float, float]]] = {}  # (rank, phase) -> [(seconds, spanned)]
    for s in per_step(spans, steps):
        values = dict(s["phases"])
        if "all" in s["exposed"]:
            values["exposed comm"] = s["exposed"]["all"]
        values["step"] = s["spanned"]
        for phase, seconds in values.items():
            by_key.setdefault((s["rank"], phase), []).append((seconds, s["spanned"]))

    def place(phase: str) -> tuple:  # the step's order, unknown names, then the two summaries
        if phase in PHASE_ORDER:
            return (0, PHASE_ORDER.index(phase), "")
        return {"exposed comm": (2, 0, ""), "step": (3, 0, "")}.get(phase, (1, 0, phase))

    rows = []
    for (rank, phase), values in sorted(by_key.items(), key=lambda kv: (kv[0][0], place(kv[0][1]))):
        median, low, high = _spread([v for v, _ in values])
        rows.append(dict(rank=rank, phase=phase, steps=len(values), median_ms=median, min_ms=low, max_ms=high,
                         share=statistics.median(v / spanned if spanned > 0 else 0.0 for v, spanned in values)))
    return rows


def format_table(rows: list[dict], columns: Iterable[str] | None = None, digits: int = 3) -> str:
    """``rows`` (e.g. ``exposed_comm_table``'s) as aligned text: floats to ``digits`` significant
    digits, shares as percentages, None as "-"."""
    rows = list(rows)
    columns = list(columns) if columns is not None else list(rows[0]) if rows else []

    def cell(key: str, value) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{100 * value:.0f}%" if key.endswith("share") else f"{value:.{digits}g}"
        return str(value)

    cells = [[cell(k, r.get(k)) for k in columns] for r in rows]
    widths = [max([len(k), *(len(c[i]) for c in cells)]) for i, k in enumerate(columns)]
    lines = ["  ".join(k.rjust(w) for k, w in zip(columns, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(c, widths)) for c in cells]
    return "\n".join(lines)
