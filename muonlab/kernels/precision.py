"""Facts about dtypes and numbers that every Newton-Schulz module shares (it imports no other
kernel module, so any of them may import it)."""

from __future__ import annotations

from numbers import Real

import torch

NS_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""Compute dtypes Newton-Schulz accepts (None keeps the input's): integer or boolean matmuls turn
the normalised matrix into zeros or NaN, and float8 has no matmul here."""


TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""Compute dtypes the Triton kernels take: they accumulate ``tl.dot`` in fp32, so fp64 operands
would be rounded (the gram form returned garbage); fp64 runs on the torch backend only."""

HALF_DTYPES = (torch.float16, torch.bfloat16)


def fp32_matmul_precision() -> str:
    """"ieee" or "tf32": how torch runs fp32 CUDA matmuls now, which the Triton kernels follow and
    the "auto" timings key on. Read from ``torch.backends.cuda.matmul.fp32_precision`` ("none"
    there defers to ``torch.backends.fp32_precision``), because once either is set,
    ``torch.get_float32_matmul_precision()`` raises (it refuses to read a mix of the old and new
    APIs). The legacy getter remains the answer where the new attributes don't exist (older
    torch) or say "none"; anything that can't be read counts as torch's default, "ieee"."""
    matmul = getattr(getattr(torch.backends, "cuda", None), "matmul", None)
    precision = None
    try:
        precision = getattr(matmul, "fp32_precision", None)
        if precision == "none":
            precision = getattr(torch.backends, "fp32_precision", None)
    except RuntimeError:  # a torch whose getter exists but can't answer: try the legacy one
        precision = None
    if precision == "ieee":
        return "ieee"
    if isinstance(precision, str) and precision != "none":
        return "tf32"  # "tf32" (or a reduced precision newer than this code, as legacy "medium")
    try:
        legacy = torch.get_float32_matmul_precision()
    except RuntimeError:  # mixed legacy and new settings that resolved to "none" above
        return "ieee"
    return "ieee" if legacy == "highest" else "tf32"


def is_number(value) -> bool:
    """A real number, not a bool: bool is an int to Python, but True as a coefficient, an eps or
    a learning rate is a mistake, not a number."""
    return isinstance(value, Real) and not isinstance(value, bool)
