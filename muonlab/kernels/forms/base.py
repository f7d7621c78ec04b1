"""What a Newton-Schulz form is: one record per form, read by the dispatcher, the workspace, the
FLOP model and the "auto" timing.

A form is one way to compute the same iteration (``plain``: on X; ``gram``: on X X^T). Each
module of this package is one form and owns everything about it in its ``FORM``: the iteration
on the torch and Triton backends, the workspace it needs, its FLOP count, and the dtypes its
iterates may be in. ``FORMS`` in the package's ``__init__`` is the only registry of them.

The iteration's contract (``NSForm.iterate``): ``X`` holds the batch, normalised, in the dtype
the form iterates in (``work_dtype``); ``spare`` is a second buffer like X, ``squares`` the
form's ``squares`` (B, m, m) buffers. On the torch backend X is as stored (wide (B, m, n) or tall
(B, n, m)); on Triton it is wide. It returns the buffer holding the result (X or ``spare``; the
dispatcher reads ``writes`` to make that the caller's output where it can).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class NSForm:
    """The facts and functions of one form. ``cfg`` below is an ``NSConfig``."""

    name: str
    squares: int
    """(B, m, m) workspace buffers the iteration needs, besides its two iterates."""
    dtypes: tuple[torch.dtype, ...]
    """Dtypes its iterates may be in (``work_dtype`` never returns another)."""
    square_matrices: bool
    """Whether it runs on square matrices; where not, they take the plain form."""
    iterate: Callable[..., torch.Tensor]
    """``iterate(X, spare, squares, coefficients, cfg, dtype, kernels)``: run the steps on the
    backend's kernels (``kernels``: its record's ``NSBackend.kernels``, "torch" or "triton"),
    return the buffer holding the result."""
    writes: Callable[..., int]
    """``writes(cfg, dtype)``: how many times ``iterate`` writes an iterate buffer on the torch
    backend (an even count leaves the result in X)."""
    flops: Callable[..., int]
    """``flops(m, n, cfg, symmetric)``: FLOPs on one m x n matrix (m <= n); ``symmetric``: on
    the Triton kernels, whose symmetric products compute upper tiles only."""
    work_dtype: Callable[..., torch.dtype]
    """``work_dtype(cfg, dtype, native_fp16)``: the dtype it iterates in for compute dtype
    ``dtype``, on a device that multiplies fp16 natively or not."""
    key: Callable[..., str]
    """``key(cfg, dtype)``: the form as it runs, for the "auto" timing cache's keys (a form whose
    settings change its speed names them here)."""
