"""Orthogonalization compute: Newton-Schulz (torch path, presets, FLOP counts) and Triton kernels."""

from .newton_schulz import PRESETS, newton_schulz, ns_flops, resolve_coefficients

__all__ = ["PRESETS", "newton_schulz", "ns_flops", "resolve_coefficients"]
