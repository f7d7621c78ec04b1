"""The plan against the run: the cost model's seconds per batch and phase beside the step's spans.

    rec = StepRecorder(opt, keep=10)
    for ...: loss.backward(); opt.step(); opt.zero_grad()
    result = plan_vs_run(opt, rec, steps=range(2, 10))   # leave out steps that built the plan
    print(result.table())

Predicted: ``muonlab.comm.cost.predict_phases`` of ``opt.plan()`` under a ``HardwareProfile``
(the optimizer's ``hardware_profile`` unless one is given; ``muonlab.calibrate()`` measures one).
Measured, per recorded step on this rank, from its spans (``muonlab.trace.spans``), then the median
over the steps:

- momentum, newton_schulz, update: the time the batch's spans of that name cover;
- comm: the union of the batch's comm_out and comm_back spans (issue to the end of the wait: the
  time a collective was in flight, which the overlap hides in part);
- exposed_comm: the part of that union the rank's compute spans do not cover;
- step: from the rank's first Muon span to its last (the AdamW phase and the control exchange
  before the first batch are outside it, as they are outside the model).

Communication rows appear only for batches whose plan moves bytes or has rule sums (a batch on
the local path has no collective to predict). The rule's all-reduce has no span of its own: its
rows show the prediction with no measurement and count in no error. Errors are
(predicted - measured) / measured.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from ..trace.spans import LANES, span_rows
from ..trace.step_time import format_table, intersection, merge, total
from .cost import HardwareProfile, get_profile, predict_phases

__all__ = ["MEASURED_PHASES", "PlanVsRun", "measured_phases", "plan_vs_run"]

MEASURED_PHASES = ("momentum", "comm", "exposed_comm", "newton_schulz", "update")
"""Phases the spans measure, in table order (``rule`` is predicted only)."""
_COMM_PHASES = ("comm", "exposed_comm", "rule")


def _error(predicted: float, measured: float | None) -> float | None:
    if measured is None or measured <= 0:
        return None
    return (predicted - measured) / measured


@dataclass
class PlanVsRun:
    """``plan_vs_run``'s answer."""

    rank: int
    profile: str
    """The profile's name (``source`` has its provenance)."""
    steps: int
    """Recorded steps the measured medians are over."""
    rows: list[dict] = field(default_factory=list)
    """One per (batch, phase): ``batch``, ``path``, ``phase``, ``predicted_s``, ``measured_s``
    (None: no span measures it), ``error``."""
    step_predicted_s: float = 0.0
    step_measured_s: float = 0.0

    @property
    def step_error(self) -> float | None:
        return _error(self.step_predicted_s, self.step_measured_s)

    @property
    def median_abs_error(self) -> float | None:
        """Median of |error| over every (batch, phase) row with a measurement."""
        errors = [abs(r["error"]) for r in self.rows if r["error"] is not None]
        return statistics.median(errors) if errors else None

    def median_abs_error_by_phase(self) -> dict[str, float]:
        out: dict[str, list[float]] = {}
        for r in self.rows:
            if r["error"] is not None:
                out.setdefault(r["phase"], []).append(abs(r["error"]))
        return {p: statistics.median(v) for p, v in out.items()}

    def table(self) -> str:
        """The rows, then the whole step, as aligned text (milliseconds)."""
        shown = [dict(batch=r["batch"], path=r["path"], phase=r["phase"], predicted_ms=1e3 * r["predicted_s"],
                      measured_ms=None if r["measured_s"] is None else 1e3 * r["measured_s"],
                      error_share=r["error"]) for r in self.rows]
        shown.append(dict(batch="step", path="", phase="", predicted_ms=1e3 * self.step_predicted_s,
                          measured_ms=1e3 * self.step_measured_s, error_share=self.step_error))
        return format_table(shown)


def measured_phases(spans, rank: int) -> tuple[list[dict[int, dict[str, float]]], list[float]]:
    """Per recorded step of ``rank`` (``Span``s or rows with their ``step``): {batch: {phase:
    seconds}} for ``MEASURED_PHASES``, and the step's Muon span (first Muon span to last)."""
    by_step: dict[int, list[dict]] = {}
    for r in span_rows(spans):
        if r["rank"] == rank and r["batch"] >= 0:  # batch -1: the AdamW phase, outside the model
            by_step.setdefault(r["step"], []).append(r)
    per_step, spanned = [], []
    for _, rows in sorted(by_step.items()):
        compute = merge((r["start"], r["end"]) for r in rows if LANES.get(r["name"], "compute") == "compute")
        batches: dict[int, dict[str, float]] = {}
        for b in sorted({r["batch"] for r in rows}):
            mine = [r for r in rows if r["batch"] == b]
            phases = {name: total(merge((r["start"], r["end"]) for r in mine if r["name"] == name))
                      for name in ("momentum", "newton_schulz", "update")}
            comm = merge((r["start"], r["end"]) for r in mine if LANES.get(r["name"]) == "comm")
            phases["comm"] = total(comm)
            phases["exposed_comm"] = phases["comm"] - intersection(comm, compute)
            batches[b] = phases
        per_step.append(batches)
        spanned.append(max(r["end"] for r in rows) - min(r["start"] for r in rows))
    return per_step, spanned


def plan_vs_run(opt, recorder=None, *, profile: HardwareProfile | str | None = None, steps=None,
                rank: int | None = None) -> PlanVsRun:
    """Predicted against measured seconds per batch and phase, and for the whole step, on this
    rank (see the module docstring). ``opt``: a muonlab ``Muon``; ``recorder``: a ``StepRecorder``
    on it, or None for ``opt.last_step_spans()`` (one step); ``steps``: which recorded step numbers
    (None: all; an int: the last k); ``rank``: the global rank whose spans to read (default: the
    spans' own, this process's)."""
    if not callable(getattr(opt, "plan", None)) or not callable(getattr(opt, "last_step_spans", None)):
        raise TypeError(f"plan_vs_run compares muonlab's Muon (plan() and last_step_spans()); got {type(opt).__name__}")
    if recorder is None:
        spans = opt.last_step_spans()
    elif callable(getattr(recorder, "spans", None)):
        spans = recorder.spans()
    else:
        raise TypeError(f"recorder must be a muonlab.trace.StepRecorder or None, got {type(recorder).__name__}")
    rows = span_rows(spans)
    if steps is not None:
        from ..trace.step_time import select_steps
        rows = select_steps(rows, steps)
    ranks = sorted({r["rank"] for r in rows if r["batch"] >= 0})
    if not ranks:
        raise ValueError("no spans of a Muon batch to measure: step the optimizer (with a recorder attached, "
                         "or read last_step_spans() right after a step) first")
    if rank is None:
        if len(ranks) > 1:
            raise ValueError(f"the spans hold ranks {ranks}: pass rank= (or this rank's own spans)")
        rank = ranks[0]
    elif rank not in ranks:
        raise ValueError(f"rank={rank} has no spans; the spans hold ranks {ranks}")
    profile = get_profile(profile if profile is not None else opt.options.hardware_profile)
    plan = opt.plan()
    choices = {c["batch"]: c for c in opt.resolved_choices()}  # the dtype and form each batch ran in
    predicted = predict_phases(plan, profile, rank=rank, ns_choices=choices)
    per_step, spanned = measured_phases(rows, rank)

    def median_of(batch: int, phase: str) -> float:
        return statistics.median(s.get(batch, {}).get(phase, 0.0) for s in per_step)

    table = []
    for b, pred in zip(plan, predicted):
        moves = any(b.bytes_sent) or any(b.bytes_recv) or b.rule_sums
        for phase in (*MEASURED_PHASES, "rule"):
            if phase in _COMM_PHASES and not moves:
                continue
            measured = None if phase == "rule" else median_of(b.index, phase)
            if not pred[phase] and not measured:
                continue  # a phase this batch has not on this rank
            table.append(dict(batch=b.index, path=b.path, phase=phase, predicted_s=pred[phase],
                              measured_s=measured, error=_error(pred[phase], measured)))
    return PlanVsRun(rank=rank, profile=profile.name, steps=len(per_step), rows=table,
                     step_predicted_s=predicted[0]["step"] if predicted else 0.0,
                     step_measured_s=statistics.median(spanned))
