"""Coefficients as a config holds them: a schedule's name (``muonlab.kernels.schedules``), or
explicit (a, b, c) triples; and what they mean for a number of steps and for the normaliser."""

from __future__ import annotations

import math
from collections.abc import Sequence

from .precision import is_number
from .schedules import SCHEDULES, Schedule

Coefficients = list[tuple[float, float, float]]

PRESETS: dict[str, Coefficients] = {name: list(SCHEDULES[name].table) for name in ("keller", "xtuner", "polar_express")}
"""The three schedules muonlab shipped before the registry, by name: their tables, for the code
and notebooks that list or index them (``muonlab.PRESETS``). Every schedule, these included, is
in ``SCHEDULES``, and any of its names is an ``ns_coefficients``."""

NORM_SCALE = {name: s.norm_scale for name, s in SCHEDULES.items()}
"""Extra safety factor on each schedule's normaliser (``Schedule.norm_scale``)."""


def _triple(abc, coefficients) -> tuple[float, float, float]:
    if isinstance(abc, (str, bytes)) or not isinstance(abc, Sequence):
        raise TypeError(f"ns_coefficients entries must be (a, b, c) sequences of numbers, got {abc!r} "
                        f"in {coefficients!r}")
    if not all(is_number(v) for v in abc):
        raise TypeError(f"ns_coefficients entries must hold numbers, got {abc!r} in {coefficients!r}")
    if len(abc) != 3:
        raise ValueError(f"ns_coefficients must be a preset name, one (a, b, c) or a non-empty list of (a, b, c), "
                         f"got an entry of length {len(abc)}: {coefficients!r}")
    if not all(math.isfinite(v) for v in abc):
        raise ValueError(f"ns_coefficients must be finite, got {abc!r}")
    return tuple(float(v) for v in abc)


def coefficient_table(coefficients: str | Sequence) -> str | tuple[tuple[float, float, float], ...]:
    """A schedule's name as is, or explicit coefficients as a tuple of float (a, b, c) triples.

    One bare triple ``(a, b, c)`` (torch.optim.Muon's format) is a table of one entry, which
    ``resolve_coefficients`` repeats for every step, as torch does.
    """
    if isinstance(coefficients, str):
        if coefficients not in SCHEDULES:
            raise ValueError(
                f"unknown Newton-Schulz preset {coefficients!r}; choose one of {list(SCHEDULES)} "
                "or pass ns_coefficients as (a, b, c) or a list of (a, b, c) tuples"
            )
        return coefficients
    if isinstance(coefficients, bytes) or not isinstance(coefficients, Sequence):
        raise TypeError(f"ns_coefficients must be a preset name, one (a, b, c) or a list of (a, b, c), "
                        f"got {type(coefficients).__name__} {coefficients!r}")
    if not coefficients:
        raise ValueError(f"ns_coefficients must be a preset name or a non-empty list of (a, b, c), "
                         f"got {coefficients!r}")
    if any(is_number(v) for v in coefficients):  # numbers at the top level: one bare triple
        return (_triple(coefficients, coefficients),)
    return tuple(_triple(abc, coefficients) for abc in coefficients)


def schedule_of(coefficients: str | Sequence) -> Schedule | None:
    """The registered schedule ``coefficients`` names; None for explicit (a, b, c) triples."""
    table = coefficient_table(coefficients)
    return SCHEDULES[table] if isinstance(table, str) else None


def resolve_coefficients(coefficients: str | Sequence, steps: int) -> Coefficients:
    """Return exactly ``steps`` (a, b, c) tuples for a schedule's name, one (a, b, c) or a list of
    them; a table shorter than ``steps`` repeats its last entry."""
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"ns_steps must be a positive integer, got {steps!r}")
    table = coefficient_table(coefficients)
    if isinstance(table, str):
        return SCHEDULES[table].coefficients(steps)
    return [table[min(i, len(table) - 1)] for i in range(steps)]


def norm_scale(coefficients: str | Sequence) -> float:
    """The factor on each matrix's norm that ``coefficients`` assume (1 for explicit triples)."""
    return SCHEDULES[coefficients].norm_scale if isinstance(coefficients, str) and coefficients in SCHEDULES else 1.0
