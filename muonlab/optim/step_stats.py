"""What Muon says about its last step: ``last_step_stats()``, ``last_step_spans()`` and the count
of skipped steps, recorded during the step and resolved when read (on CUDA, a read synchronises;
the step itself reads nothing).

``StepStats`` is a mixin of ``muonlab.optim.Muon``. It keeps ``_stats`` (the last step's record),
``_stats_tracer`` (the tracer holding its spans), ``_stats_gate`` (a step decided on the device:
its gate, read when the stats are) and the skip count, ``_skipped_on_host`` plus the device's
``_skips_on_device``; it reads the optimizer's ``_tracer``, ``_runner`` (Newton-Schulz's health
counts) and ``_culprits()``.
"""

from __future__ import annotations

import copy

import torch

from ..comm.collectives import CommCounter, rank_or_zero
from ..comm.engine import phase_seconds
from ..trace import Span
from .step_gate import StepGate


class StepStats:
    """The last step's stats and spans, and the skipped-step count, of Muon (see the module doc)."""

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for a non-finite gradient (under nonfinite_decision="device" the device's
        count is read here: one synchronisation on a GPU)."""
        on_device = self._skips_on_device
        return self._skipped_on_host + (0 if on_device is None else int(on_device.item()))

    @skipped_steps.setter
    def skipped_steps(self, count: int) -> None:
        # the device's count is zeroed in place: a captured step adds to that very tensor
        self._skipped_on_host = int(count)
        if self._skips_on_device is not None:
            self._skips_on_device.zero_()

    def _count_skip(self, gate: StepGate) -> None:
        """``skipped_steps``' device part: one add, read when asked."""
        skipped = gate.go.logical_not()
        if self._skips_on_device is None or self._skips_on_device.device != skipped.device:
            self._skips_on_device = torch.zeros((), dtype=torch.int64, device=skipped.device)
        self._skips_on_device += skipped

    def _record_stats(self, counter: CommCounter, seconds: dict, skipped: bool | None, gate: StepGate | None = None,
                      checked: tuple = (), **nonfinite) -> None:
        """What ``last_step_stats()`` reports for this step; seconds=None: filled from the spans
        when read (on CUDA, reading them synchronises). With a ``gate`` (the step decided on the
        device) whether it was skipped, by which ranks and this rank's culprits among the
        ``checked`` parameters' grads are read when the stats are (``_gate_stats``)."""
        nonfinite = {} if gate is not None else dict(skipped_steps=self.skipped_steps, **nonfinite)  # gate: when read
        self._stats = dict(bytes_sent=dict(counter.sent), bytes_recv=dict(counter.recv), calls=dict(counter.calls),
                           seconds=None, skipped=skipped, **nonfinite,
                           nonfinite_seconds=seconds or None, unhealthy_updates=None, worst_update_ratio=None)
        self._stats_gate = None if gate is None else (gate, checked)
        self._stats_tracer = self._tracer
        if self._runner is not None:  # a skipped step applied nothing: its updates are not counted
            (self._runner.health.drop_step if skipped else self._runner.health.end_step)()

    def last_step_stats(self) -> dict:
        """Bytes counted at each collective (per path) and seconds per phase, for the last step
        that completed or was skipped (a step that raised leaves them as they were), as a copy the
        caller may change.

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
        if self._stats.get("seconds", {}) is None:
            self._stats["seconds"] = self._phase_seconds()
        if self._stats_gate is not None:
            self._stats.update(self._gate_stats(*self._stats_gate))
            self._stats_gate = None
        if self._stats.get("skipped"):
            self._stats.update(unhealthy_updates=0, worst_update_ratio=None)  # nothing was applied
        if self._stats and self._stats.get("unhealthy_updates", 0) is None:
            report = self._runner.health.last_step() if self._runner is not None else None
            self._stats["unhealthy_updates"] = report.flagged if report else 0
            self._stats["worst_update_ratio"] = report.worst if report else None
        if self._runner is not None:
            self._runner.health.warn_unread(stacklevel=2)
        return copy.deepcopy(self._stats)

    def _gate_stats(self, gate: StepGate, checked: tuple) -> dict:
        """The stats of a step decided on the device, read now: whether it was skipped, the
        flagged ranks and this rank's culprits (named from the grads as they are now: None when
        a grad was released since, e.g. by zero_grad)."""
        ranks = gate.flagged_ranks()
        if not ranks:  # the ranks and culprits are there for a skipped step only, as under "host"
            return dict(skipped=False, skipped_steps=self.skipped_steps)
        names: list[str] | None = []
        if rank_or_zero() in ranks:
            names = None if any(p.grad is None for p in checked) else self._culprits(checked)
        return dict(skipped=True, nonfinite_ranks=ranks, nonfinite_params=names, skipped_steps=self.skipped_steps)

    def _phase_seconds(self) -> dict[str, float]:
        """Seconds per phase of the last step: momentum, update and adamw from their spans,
        communication and Newton-Schulz from the engine's (muonlab.comm.engine.phase_seconds)."""
        phases = {"momentum": 0.0, "communication": 0.0, "newton_schulz": 0.0, "update": 0.0, "adamw": 0.0}
        tracer = self._stats_tracer
        for s in tracer.spans:  # resolves them
            if s.name in ("momentum", "update", "adamw"):
                phases[s.name] += s.duration
        phases.update(phase_seconds(tracer))
        return phases

    def last_step_spans(self) -> list[Span]:
        """This rank's spans of the step ``last_step_stats()`` describes (gather them with
        muonlab.trace.gather_spans); on CUDA GPU-timed, and the first read after a step
        synchronises the device once."""
        return list(self._stats_tracer.spans)
