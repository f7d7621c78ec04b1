"""What a coefficient schedule is: one record per schedule, with where its numbers come from.

A schedule is the per-iteration (a, b, c) of Newton-Schulz's odd quintic
X <- a X + b (X X^T) X + c (X X^T)^2 X. Each module of this package is one schedule and holds
its ``SCHEDULE``: the numbers exactly as its source publishes them, the source, the scale its
normalisation assumes, and where it may run (forms, iterate dtypes, step counts). ``SCHEDULES`` in the
package's ``__init__`` is the only registry of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

Triple = tuple[float, float, float]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """One coefficient schedule: its numbers, their source, and where it may run."""

    name: str
    table: tuple[Triple, ...]
    """(a, b, c) per iteration, first to last. A run of more steps repeats the last entry (as
    every shipped schedule's source does); a run of fewer takes the first ones."""
    source: str
    """Where the numbers come from: the method's paper and the code or table they were copied from."""
    norm_scale: float = 1.0
    """Each matrix is divided by ``norm_scale * ||X||_F`` before iterating: the coefficients
    assume a top singular value of at most ``1 / norm_scale`` (a safety margin for rounding)."""
    allowed: dict[str, tuple[torch.dtype, ...]] | None = None
    """Where it may run: {form name: the dtypes its iterates may be in there}; a form not listed
    is refused. None: every form, every dtype. Each schedule is allowed exactly where
    tests/kernels/test_schedules.py finds its output bounded."""
    min_steps: int = 1
    """The fewest steps it may run: with fewer, its polynomials have not yet brought the top
    singular value under 1.5 (they are designed to be composed that many times)."""

    def __post_init__(self):
        if not self.table:
            raise ValueError(f"schedule {self.name!r} needs at least one (a, b, c)")
        for abc in self.table:
            if len(abc) != 3 or not all(isinstance(v, float) and math.isfinite(v) for v in abc):
                raise ValueError(f"schedule {self.name!r}: every entry must be three finite floats, got {abc!r}")
        if not (math.isfinite(self.norm_scale) and self.norm_scale >= 1.0):
            raise ValueError(f"schedule {self.name!r}: norm_scale must be a finite number >= 1, got {self.norm_scale!r}")
        if not (isinstance(self.min_steps, int) and self.min_steps >= 1):
            raise ValueError(f"schedule {self.name!r}: min_steps must be a positive int, got {self.min_steps!r}")

    def coefficients(self, steps: int) -> list[Triple]:
        """Exactly ``steps`` (a, b, c): the table's first ones, its last entry repeated past its end."""
        return [self.table[min(i, len(self.table) - 1)] for i in range(steps)]

    def refusal(self, form: str, dtype: torch.dtype | None = None, steps: int | None = None) -> str | None:
        """Why this schedule may not run ``steps`` iterations in ``form`` with iterates in
        ``dtype`` (None: not known yet, not checked), or None where it may."""
        where = f"Newton-Schulz schedule {self.name!r} (Muon's ns_coefficients)"
        if steps is not None and steps < self.min_steps:
            return (f"{where} needs at least {self.min_steps} steps (Muon's ns_steps), got {steps}: with fewer its "
                    "output's top singular value can exceed 1.5")
        if self.allowed is None:
            return None
        if form not in self.allowed:
            return f"{where} may not run in the {form!r} form (Muon's ns_form); it runs in {list(self.allowed)}"
        if dtype is not None and dtype not in self.allowed[form]:
            return (f"{where} may not iterate in {_dtype_name(dtype)} in the {form!r} form (Muon's ns_dtype, or "
                    f"gram_dtype for the gram form): its output is not bounded there; it iterates in "
                    f"{[_dtype_name(d) for d in self.allowed[form]]}")
        return None

    def check(self, form: str, dtype: torch.dtype | None = None, steps: int | None = None) -> None:
        """ValueError naming the schedule and the form, dtype or step count where it may not run."""
        why = self.refusal(form, dtype, steps)
        if why is not None:
            raise ValueError(why)
