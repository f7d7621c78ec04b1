"""Orthogonalization compute: Newton-Schulz (NSConfig, torch path, presets, FLOP counts), the
readable reference loop, and Triton kernels."""

from .newton_schulz import PRESETS, NSConfig, newton_schulz, ns_flops, resolve_coefficients
from .reference import reference_newton_schulz

__all__ = ["PRESETS", "NSConfig", "newton_schulz", "ns_flops", "reference_newton_schulz", "resolve_coefficients"]
