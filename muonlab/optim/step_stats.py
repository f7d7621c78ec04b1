"""What Muon says about its last step: ``last_step_stats()``, ``last_step_spans()`` and the count
of skipped steps, recorded during the step and resolved when read (on CUDA, a read synchronises;
the step itself reads nothing).

``StepRecord`` owns them: the tracers (the one the step records into, and the one the last step's
stats read), the last step's record, a step decided on the device (its gate, read when the stats
are) and the skip count, host and device parts. What it reads beside them (the Newton-Schulz
runner's health counts, the parameters' names) is passed in.
"""

from __future__ import annotations

import copy

import torch

from ..comm.collectives import CommCounter, rank_or_zero
from ..comm.engine import phase_seconds
from ..comm.specs import local_shard
from ..trace import Span, Tracer
from . import nonfinite
from .step_gate import StepGate


def clock_device(param_groups: list[dict]) -> torch.device:
    """Where a step's work runs, for the tracer's clock: the Muon parameters' device (CUDA events
    there; the first Muon parameter's), else the first parameter's."""
    first = None
    for group in param_groups:
        for p in group["params"]:
            if group["algorithm"] == "muon":
                return local_shard(p).device
            first = p if first is None else first
            break
    return torch.device("cpu") if first is None else local_shard(first).device


class StepRecord:
    """The last step's stats and spans, and the skipped-step count (see the module doc)."""

    def __init__(self, rank: int):
        self.tracer = Tracer(rank=rank)
        """The tracer the step records into (or recorded last)."""
        self.spare_tracer = Tracer(rank=rank)
        """The other one: a step records into it while the last step's stats may still read theirs."""
        self.stats: dict = {}
        self.stats_tracer = self.tracer
        """The tracer ``stats``' seconds are read from (resolved lazily)."""
        self.stats_gate: tuple | None = None
        """(gate, checked parameters) of the last step where it was decided on the device."""
        self.skipped_on_host = 0
        self.skips_on_device: torch.Tensor | None = None

    def begin(self, device: torch.device) -> Tracer:
        """A step starts: it records into the tracer the last step's stats do not read (if this
        step raises, they can still read their seconds; resolving them here instead would
        synchronise inside the step), reset for ``device``'s clock."""
        if self.tracer is self.stats_tracer:
            self.tracer, self.spare_tracer = self.spare_tracer, self.tracer
        tracer = self.tracer
        if tracer.clock == device and device.type == "cpu":  # the same clock: a new log is a reset
            tracer.log = []
        else:
            tracer.reset(device)
        return tracer

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for a non-finite gradient (the device's count read here: one
        synchronisation on a GPU)."""
        on_device = self.skips_on_device
        return self.skipped_on_host + (0 if on_device is None else int(on_device.item()))

    def set_skipped_steps(self, count: int) -> None:
        # the device's count is zeroed in place: a captured step adds to that very tensor
        self.skipped_on_host = int(count)
        if self.skips_on_device is not None:
            self.skips_on_device.zero_()

    def count_skip(self, gate: StepGate) -> None:
        """``skipped_steps``' device part: one add, read when asked."""
        skipped = gate.go.logical_not()
        if self.skips_on_device is None or self.skips_on_device.device != skipped.device:
            self.skips_on_device = torch.zeros((), dtype=torch.int64, device=skipped.device)
        self.skips_on_device += skipped

    def record(self, counter: CommCounter, seconds: dict, skipped: bool | None, runner, gate: StepGate | None = None,
               checked: tuple = (), **nonfinite) -> None:
        """What ``last_step_stats()`` reports for this step; seconds=None: filled from the spans
        when read (on CUDA, reading them synchronises). With a ``gate`` (the step decided on the
        device) the skip is counted on the device, and whether it was skipped, by which ranks and
        this rank's culprits among the ``checked`` parameters' grads are read when the stats are
        (``_gate_stats``). ``runner``: the Newton-Schulz runner (None before the first Muon step),
        whose health counts close with the step."""
        if gate is not None:
            self.count_skip(gate)
        nonfinite = {} if gate is not None else dict(skipped_steps=self.skipped_steps, **nonfinite)  # gate: when read
        memory = counter.memory  # None: the step ran no plan (skipped before it)
        self.stats = dict(bytes_sent=dict(counter.sent), bytes_recv=dict(counter.recv), calls=dict(counter.calls),
                          buffer_peak_bytes=memory.peak if memory else 0,
                          buffer_peak_batches=memory.peak_batches if memory else (),
                          buffer_bytes=dict(memory.by_batch) if memory else {},
                          seconds=None, skipped=skipped, **nonfinite,
                          nonfinite_seconds=seconds or None, unhealthy_updates=None, worst_update_ratio=None)
        self.stats_gate = None if gate is None else (gate, checked)
        self.stats_tracer = self.tracer
        if runner is not None:  # a skipped step applied nothing: its updates are not counted
            (runner.health.drop_step if skipped else runner.health.end_step)()

    def captured(self) -> tuple:
        """What a captured step's replays report: its stats and gate as recorded at capture."""
        return copy.copy(self.stats), self.stats_gate

    def replayed(self, captured: tuple) -> None:
        """A replay of a captured step: its stats, without seconds (a graph records no spans)."""
        stats, gate = captured
        self.stats, self.stats_gate, self.stats_tracer = dict(stats, seconds={}), gate, self.tracer

    def last_step_stats(self, runner, names: dict) -> dict:
        """Bytes counted at each collective (per path) and seconds per phase, for the last step
        that completed or was skipped (a step that raised leaves them as they were), as a copy the
        caller may change. ``runner``: the Newton-Schulz runner (or None), ``names``: parameter ->
        name, for a skipped step's culprits.

        ``buffer_peak_bytes``: the most bytes of communication and Newton-Schulz buffers the
        batches in flight held at once on this rank (muonlab.comm.memory; the workspace aside),
        ``buffer_peak_batches`` those batches, ``buffer_bytes`` {batch: its buffers' bytes}: what
        ``muonlab.comm.memory.plan_memory`` plans for this rank.

        Bytes: the matrices the plan's paths moved, and momentum moved between ranks
        (MOMENTUM_MOVE); the small control messages (the ranks' agreement digests, the non-finite
        flags) are not counted. The seconds come from the step's spans (``phase_seconds``): on
        CUDA they are GPU time, and the first read after a step synchronises the device once.
        ``nonfinite_seconds``: the non-finite check's host seconds, "check" (the fused pass and the
        read of this rank's flag) and "wait" (the control exchange that shares the flags with the
        agreement digest; 0 for a single process); None when off.

        ``unhealthy_updates``: how many of the matrices this rank orthogonalized in the step have a
        Frobenius norm above 1.5 x sqrt(min(m, n)) or not finite (an orthogonal factor's is at
        most sqrt(min(m, n)); Newton-Schulz's with the shipped coefficients about 1.2x that at
        most), and ``worst_update_ratio`` the largest norm / sqrt(min(m, n)) of the step's matrices
        (None: no matrix; NaN: one was NaN); 0 and None for a skipped step (muonlab.kernels.health).
        They are counted on the device during the step and read here (one synchronisation on
        CUDA). When a completed step since the last read flagged a matrix, reading them (or
        making a new plan, e.g. after a setting changed) also gives one RuntimeWarning naming
        how many and the worst ratio, with settings to try."""
        stats = self.stats
        if stats.get("seconds", {}) is None:
            stats["seconds"] = self._phase_seconds()
        if self.stats_gate is not None:
            stats.update(self._gate_stats(*self.stats_gate, names))
            self.stats_gate = None
        if stats.get("skipped"):
            stats.update(unhealthy_updates=0, worst_update_ratio=None)  # nothing was applied
        if stats and stats.get("unhealthy_updates", 0) is None:
            report = runner.health.last_step() if runner is not None else None
            stats["unhealthy_updates"] = report.flagged if report else 0
            stats["worst_update_ratio"] = report.worst if report else None
        if runner is not None:
            runner.health.warn_unread(stacklevel=3)
        return copy.deepcopy(stats)

    def _gate_stats(self, gate: StepGate, checked: tuple, names: dict) -> dict:
        """The stats of a step decided on the device, read now: whether it was skipped, the
        flagged ranks and this rank's culprits (named from the grads as they are now: None when
        a grad was released since, e.g. by zero_grad)."""
        ranks = gate.flagged_ranks()
        if not ranks:  # the ranks and culprits are there for a skipped step only, as under "host"
            return dict(skipped=False, skipped_steps=self.skipped_steps)
        found: list[str] | None = []
        if rank_or_zero() in ranks:
            found = None if any(p.grad is None for p in checked) else nonfinite.named_culprits(checked, names)
        return dict(skipped=True, nonfinite_ranks=ranks, nonfinite_params=found, skipped_steps=self.skipped_steps)

    def _phase_seconds(self) -> dict[str, float]:
        """Seconds per phase of the last step: momentum, update and adamw from their spans,
        communication and Newton-Schulz from the engine's (muonlab.comm.engine.phase_seconds)."""
        phases = {"momentum": 0.0, "communication": 0.0, "newton_schulz": 0.0, "update": 0.0, "adamw": 0.0}
        tracer = self.stats_tracer
        for s in tracer.spans:  # resolves them
            if s.name in ("momentum", "update", "adamw"):
                phases[s.name] += s.duration
        phases.update(phase_seconds(tracer))
        return phases

    def last_step_spans(self) -> list[Span]:
        """This rank's spans of the step ``last_step_stats()`` describes (gather them with
        muonlab.trace.gather_spans); on CUDA GPU-timed, and the first read after a step
        synchronises the device once."""
        return list(self.stats_tracer.spans)


def record_of(attrs: dict) -> StepRecord:
    """The record of a Muon pickled when its parts were Muon's own attributes (``_tracer``,
    ``_stats``, ...; older: no spare tracer, ``skipped_steps`` a plain count), popped from ``attrs``."""
    tracer = attrs.pop("_tracer", None)
    record = StepRecord(rank_or_zero() if tracer is None else tracer.rank)
    if tracer is not None:
        spare = attrs.pop("_spare_tracer", None)
        record.tracer, record.spare_tracer = tracer, spare or Tracer(rank=tracer.rank)
        record.stats_tracer = attrs.pop("_stats_tracer", tracer) if spare is not None else tracer
    record.stats, record.stats_gate = attrs.pop("_stats", {}), attrs.pop("_stats_gate", None)
    if "_skipped_on_host" in attrs:
        record.skipped_on_host, record.skips_on_device = attrs.pop("_skipped_on_host"), attrs.pop("_skips_on_device")
    else:
        record.skipped_on_host = int(attrs.pop("skipped_steps", 0))
    return record
