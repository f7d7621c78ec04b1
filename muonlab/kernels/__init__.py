"""Orthogonalization compute: Newton-Schulz (NSConfig, the torch path, FLOP counts), its
registered coefficient schedules (``schedules.SCHEDULES``) and forms (``forms.FORMS``), the
readable reference loop, and Triton kernels."""

from .forms import FORMS
from .newton_schulz import PRESETS, NSConfig, newton_schulz, ns_flops, resolve_coefficients
from .reference import reference_newton_schulz
from .schedules import SCHEDULES

__all__ = ["FORMS", "PRESETS", "SCHEDULES", "NSConfig", "newton_schulz", "ns_flops", "reference_newton_schulz",
           "resolve_coefficients"]
