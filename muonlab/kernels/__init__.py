"""Orthogonalization compute: Newton-Schulz (NSConfig, the torch path, FLOP counts), its
registered coefficient schedules (``schedules.SCHEDULES``), forms (``forms.FORMS``) and backends
(``backends.BACKENDS``), the readable reference loop, and Triton kernels."""

from .backends import BACKENDS
from .coefficients import PRESETS, resolve_coefficients
from .config import NSConfig, ns_flops
from .forms import FORMS
from .newton_schulz import newton_schulz
from .reference import reference_newton_schulz
from .schedules import SCHEDULES

__all__ = ["BACKENDS", "FORMS", "PRESETS", "SCHEDULES", "NSConfig", "newton_schulz", "ns_flops",
           "reference_newton_schulz", "resolve_coefficients"]
