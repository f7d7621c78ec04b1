"""Checks that a training run went the way a working Muon run goes: the facts a notebook's check
cell prints, so that a run that breaks shows as False instead of as a plot nobody reads.

On 2026-11-26 a Newton-Schulz schedule that diverged in bf16 trained nothing (weights grew to 1e7,
then NaN) while every notebook check passed: they looked at the run's shape (steps recorded,
matrices seen), not at what it did. These look at what it did.
"""

from __future__ import annotations

import math

from .optim.functional import adjust_lr_ratio
from .train import History

UPDATE_RMS_TOLERANCE = 2.0
"""How far (as a factor) a Muon matrix's update RMS may be from lr x ratio x the RMS of an
orthogonal factor of its shape: Newton-Schulz leaves singular values in about [0.68, 1.2], a
momentum of lower rank than the matrix gives a smaller update, weight decay a slightly larger one."""


def orthogonal_rms(shape: tuple[int, int]) -> float:
    """RMS of a full-rank m x n matrix with all singular values 1: sqrt(min / (m n))."""
    m, n = shape
    return math.sqrt(min(m, n) / (m * n))


def muon_records(history: History) -> list:
    """The spectral records of Muon's matrices: those with an orthogonality error recorded at some
    step (a broken run's error turns NaN later, and its records still count)."""
    names = {r.name for r in history.spectral if not math.isnan(r.ortho_error)}
    return [r for r in history.spectral if r.name in names]


def update_rms_ratios(history: History, lr: float, adjust_lr: str | None = "original") -> list[float]:
    """Per Muon matrix and recorded step: its update's RMS over lr x adjust_lr's ratio x
    ``orthogonal_rms``."""
    return [r.update_rms / (lr * adjust_lr_ratio(r.shape, adjust_lr) * orthogonal_rms(r.shape))
            for r in muon_records(history)]


def check_run(history: History, muon_lr: float | None = None, adjust_lr: str | None = "original") -> dict[str, bool]:
    """{check: passed} for one run. Always: the loss fell (the mean of the last quarter of the
    training losses under the first quarter's) and every loss and recorded value is finite. With
    ``muon_lr`` (a Muon run recorded with ``spectral_every``): every Muon matrix's update RMS within
    ``UPDATE_RMS_TOLERANCE`` of what Muon's update has (``update_rms_ratios``), and a finite
    orthogonality error at every recorded step; both False where no Muon matrix recorded one."""
    if not history.train_loss:
        raise ValueError("check_run needs a run with at least one training step (history.train_loss is empty)")
    losses = history.train_loss
    quarter = max(1, len(losses) // 4)
    checks = {
        "loss falls": sum(losses[-quarter:]) / quarter < sum(losses[:quarter]) / quarter,
        "finite": all(math.isfinite(v) for v in (*losses, *history.val_loss))
        and all(math.isfinite(r.weight_sigma) and math.isfinite(r.update_rms) for r in history.spectral),
    }
    if muon_lr is not None:  # False, not left out, where no Muon matrix recorded anything finite
        records = muon_records(history)
        ratios = update_rms_ratios(history, muon_lr, adjust_lr)
        checks[f"update RMS within {UPDATE_RMS_TOLERANCE:g}x of lr x ratio"] = \
            bool(ratios) and all(1 / UPDATE_RMS_TOLERANCE <= q <= UPDATE_RMS_TOLERANCE for q in ratios)
        checks["orthogonality error finite"] = bool(records) and all(math.isfinite(r.ortho_error) for r in records)
    return checks


def format_checks(checks: dict[str, bool]) -> str:
    """One line: "check: True, check: False"."""
    return ", ".join(f"{name}: {passed}" for name, passed in checks.items())
