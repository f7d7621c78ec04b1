"""Is each orthogonalized update sane? Counted on the device, read only when asked.

An orthogonal factor of rank r has Frobenius norm sqrt(r) <= sqrt(min(m, n)); Newton-Schulz with
the shipped coefficients leaves singular values within about [0.68, 1.2], so its output's norm is
at most about 1.2 * sqrt(min(m, n)). With some settings it returned matrices whose top singular
value was 2.4 to 4,490: the weights grew to 1e7 and then turned NaN, and nothing said so. Here a
matrix is flagged when ``||O||_F / sqrt(min(m, n))`` (its *ratio*) is above ``LIMIT`` or is not
finite.

The hot step must not read device values on the host (muonlab's "two phases"), so
``UpdateHealth.observe`` (called by ``NewtonSchulzRunner`` on every chunk it orthogonalizes)
writes each matrix's ratio into a device vector, two kernels per chunk: one fused norm over the
chunk (in the output's own dtype, accumulated in fp32 by torch; asking for an fp32 result would
copy the whole chunk to fp32 first) and one scale into the vector. ``end_step`` adds two more per
step: the step's worst ratio, folded into the worst of the steps not yet read. The step's vector
is kept (two vectors take turns, so a step that raises leaves the last one whole) and counted
only when read: ``last_step`` and ``take_unread`` are the host reads (Muon: when its stats are
read, and when it makes a new plan, outside the hot step), and they synchronise.

Its cost is one more read of every output (benchmarks/bench_health.py measures it against a step
without the check; results in benchmarks/results/health.md).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import NamedTuple

import torch

LIMIT = 1.5
"""A matrix is flagged when its ratio ``||O||_F / sqrt(min(m, n))`` is above this, or not finite."""


class HealthReport(NamedTuple):
    """What the host read of the device counters."""

    flagged: int
    """Matrices of the last completed step whose ratio is above the limit or not finite."""
    checked: int
    """Matrices the last completed step checked (0 for a skipped step)."""
    worst: float | None
    """The largest ratio (NaN if one was NaN; None when no matrix was checked): of the last
    completed step (``last_step``) or of the steps since the last read (``take_unread``)."""
    steps: int
    """Completed steps it covers that checked a matrix."""


def update_ratios(mats: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """Each matrix's ``||O||_F / sqrt(min(m, n))`` in fp32, for a (..., m, n) stack or a list of
    them (concatenated): the readable form of what ``UpdateHealth.observe`` records."""
    pieces = [mats] if isinstance(mats, torch.Tensor) else list(mats)
    out = [torch.linalg.vector_norm(p.double(), dim=(-2, -1)).flatten() / math.sqrt(min(p.shape[-2:]))
           for p in pieces]
    return torch.cat(out).float()


def is_flagged(ratio: float | None, limit: float = LIMIT) -> bool:
    """Whether a ratio read on the host is flagged: above ``limit`` or not finite."""
    return ratio is not None and not ratio <= limit


def unhealthy_message(unread: HealthReport, when: str = "", limit: float = LIMIT) -> str:
    """The warning's text for ``unread`` (``take_unread``'s, whose counts are the last step's;
    ``when``: appended to the steps it names)."""
    many = "matrix" if unread.flagged == 1 else "matrices"
    if unread.checked == 0:  # the last step was skipped: the flagged ones came before it
        steps = "a step" if unread.steps == 1 else f"{unread.steps} steps"
        what = f"update matrices on this rank in {steps} before the last one{when},"
    elif unread.steps <= 1:
        what = f"{unread.flagged} of {unread.checked} update {many} on this rank in the last step{when}"
    else:
        what = (f"update matrices on this rank in the last {unread.steps} steps{when}, {unread.flagged} of "
                f"{unread.checked} in the last one,")
    return (f"Newton-Schulz returned {what} with a Frobenius norm above {limit:g} x sqrt(min(m, n)) or not finite "
            f"(worst ratio {unread.worst:.4g}; an orthogonal factor's is at most 1): the updates are not "
            "orthogonal and the weights may diverge. Try ns_form=\"plain\", ns_dtype=torch.float32, or other "
            "ns_coefficients.")


class UpdateHealth:
    """Per-matrix ratios of one step's orthogonalized updates, counted on the device.

    ``begin_step()``, then ``observe(chunk)`` per chunk of outputs, then ``end_step()`` (the step
    completed: it becomes ``last_step()`` and its worst ratio joins the unread one) or
    ``drop_step()`` (skipped, nothing applied: no counts). ``observe`` outside a step records
    nothing, so a runner used on its own holds nothing. No method but ``last_step`` and
    ``take_unread`` reads a device value on the host.
    """

    def __init__(self, limit: float = LIMIT):
        self.limit = float(limit)
        self._recording = False
        self._vectors: list[torch.Tensor | None] = [None, None]  # fp32 ratios on the device, grown on the host's count
        self._current = 0  # the vector this step records into
        self._count = 0  # matrices observed in this step (from shapes, on the host)
        self._last: int | None = None  # the vector of the last completed step (None: skipped, or none yet)
        self._last_count = 0
        self._unread: torch.Tensor | None = None  # 0-dim fp32: the worst ratio of the completed steps not yet read
        self._unread_steps = 0

    def begin_step(self) -> None:
        """Start recording a step, in the vector the last completed step does not hold (what a
        step that raised left behind is overwritten)."""
        self._recording, self._count = True, 0
        self._current = 0 if self._last is None else 1 - self._last

    def observe(self, mats: torch.Tensor | Sequence[torch.Tensor]) -> None:
        """Record the ratio of each matrix of ``mats`` (a (k, m, n) stack or a list of them),
        without a host read: a fused norm per tensor and a scale into the step's vector."""
        if not self._recording:
            return
        xs = [mats] if isinstance(mats, torch.Tensor) else mats
        # matrices per tensor (none where one has no matrix or a zero dim: nothing orthogonalized);
        # the slots are taken once for them all, so a list costs no Python call per tensor
        counts = [x.numel() // (x.shape[-2] * x.shape[-1]) if x.numel() else 0 for x in xs]
        total = sum(counts)
        if not total:
            return
        slots, at = self._slots(total, xs[0].device), 0
        for x, k in zip(xs, counts):
            if k:
                norms = torch.linalg.vector_norm(x, dim=(-2, -1)).reshape(k)
                torch.mul(norms, 1.0 / math.sqrt(min(x.shape[-2:])), out=slots[at:at + k])
                at += k

    def _slots(self, k: int, device: torch.device) -> torch.Tensor:
        """The next ``k`` entries of the step's vector, grown (on the device, from the host's
        count) when it is too short; after a first step its size holds."""
        need = self._count + k
        vector = self._vectors[self._current]
        if vector is None or vector.numel() < need or vector.device != device:
            grown = torch.empty(max(need, 2 * (0 if vector is None else vector.numel()), 64), dtype=torch.float32,
                                device=device)
            if vector is not None and self._count:
                grown[:self._count].copy_(vector[:self._count])
            self._vectors[self._current] = vector = grown
        slot = vector[self._count:need]
        self._count = need
        return slot

    def end_step(self) -> None:
        """The step completed: it becomes the last step, and its worst ratio is folded into the
        unread one (two device ops)."""
        recorded, self._recording = self._recording, False
        count = self._count if recorded else 0
        self._last, self._last_count = (self._current, count) if count else (None, 0)
        if count == 0:
            return
        worst = self._vectors[self._current][:count].amax()  # propagates a NaN, as maximum does
        if self._unread is None or self._unread.device != worst.device:
            self._unread = worst
        else:
            torch.maximum(self._unread, worst, out=self._unread)
        self._unread_steps += 1

    def drop_step(self) -> None:
        """The step was skipped (nothing applied): no counts for it."""
        self._recording, self._count = False, 0
        self._last, self._last_count = None, 0

    def last_step(self) -> HealthReport:
        """The last completed step's counts (a host read: synchronises on a GPU)."""
        if self._last is None:
            return HealthReport(0, 0, None, 0)
        ratios = self._vectors[self._last][:self._last_count]
        # not (ratio <= limit): NaN compares False, so it is flagged too
        flagged, worst = torch.stack([ratios.le(self.limit).logical_not_().sum(dtype=torch.float32),
                                      ratios.amax()]).tolist()
        return HealthReport(int(flagged), self._last_count, worst, 1)

    def take_unread(self) -> HealthReport:
        """The last step's counts with the worst ratio of the completed steps since the last
        call, which it then forgets (a host read: synchronises on a GPU)."""
        last = self.last_step()
        worst = None if self._unread is None else self._unread.item()
        report = HealthReport(last.flagged, last.checked, worst, self._unread_steps)
        self._unread, self._unread_steps = None, 0
        return report

    def warn_unread(self, when: str = "", stacklevel: int = 1) -> HealthReport:
        """``take_unread()``, with a RuntimeWarning (``unhealthy_message``) when a ratio since the
        last read was flagged; ``stacklevel`` as ``warnings.warn``'s, counted from the caller."""
        if self._unread is None:  # nothing to read: no host read either
            return HealthReport(0, 0, None, 0)
        report = self.take_unread()
        if is_flagged(report.worst, self.limit):
            warnings.warn(unhealthy_message(report, when, self.limit), RuntimeWarning, stacklevel=stacklevel + 1)
        return report
