"""What crosses the wire: Muon's ``comm_dtype``, and the dtype each batch's matrices travel in.

Matrices travel as momentum, before Newton-Schulz normalises them. Rounded to bf16 on the wire
while Newton-Schulz iterates in fp32, the near-null directions of a low-rank momentum take the
rounding's noise, which the iteration lifts towards singular value 1: FSDP2 on 2-4 gloo ranks
differed from one process by up to 0.147 of a matrix's displacement after 3 steps (a (10, 40)
matrix; fp32 Newton-Schulz, the "auto" dtype on a CPU without native bf16). So by default
(``comm_dtype="auto"``) a batch travels in the dtype it iterates in: bf16 where its Newton-Schulz
computes in bf16, fp32 otherwise. An explicit dtype applies to every batch (bf16: half the bytes
of an fp32 wire, rounded as above).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..kernels.config import NSConfig
from ..kernels.newton_schulz import resolve_dtype
from .specs import MatrixSpec

WIRE_DTYPES = (torch.bfloat16, torch.float32)
"""The dtypes matrices may travel in. Not fp16: momentum travels before it is normalised, and
fp16's range can't hold it (gradients of 1e-7 underflowed to a zero update, of 1e6 overflowed to
NaN parameters). Their itemsizes differ, so a batch's ``comm_itemsize`` names its wire dtype."""

ItemsizeRule = Callable[[MatrixSpec, NSConfig], int]
"""Bytes per element on the wire of a batch of ``spec``'s matrices under ``config``."""


def wire_dtype(comm_dtype: torch.dtype | str, compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype a batch travels in under ``comm_dtype`` when its Newton-Schulz computes in
    ``compute_dtype``: "auto" is bf16 for bf16 and fp32 for any other (fp32 and fp64, and fp16,
    whose 10-bit mantissa bf16 would coarsen); an explicit dtype is itself."""
    if isinstance(comm_dtype, torch.dtype):
        return comm_dtype
    return torch.bfloat16 if compute_dtype == torch.bfloat16 else torch.float32


def of_itemsize(itemsize: int) -> torch.dtype:
    """The wire dtype of ``itemsize`` bytes (``BatchPlan.comm_itemsize``)."""
    for dtype in WIRE_DTYPES:
        if dtype.itemsize == itemsize:
            return dtype
    raise ValueError(f"no wire dtype has {itemsize} bytes per element; wire dtypes: {list(WIRE_DTYPES)}")


def wire_itemsizes(comm_dtype: torch.dtype | str, *, device: torch.device | str | None,
                   input_dtype: Callable[[MatrixSpec], torch.dtype]) -> ItemsizeRule:
    """The planner's ``comm_itemsize`` per batch under ``comm_dtype``: a batch's compute dtype is
    its config's dtype as Newton-Schulz resolves it on ``device`` for the batch's matrix shape
    (``resolve_dtype``; None: a GPU's rule, as ``muonlab.simulate`` plans without a device), or
    with ``ns_dtype=None`` the dtype of what it reads, ``input_dtype(spec)`` (the momentum's)."""
    run_device = device if device is not None else "cuda"

    def itemsize(spec: MatrixSpec, cfg: NSConfig) -> int:
        compute = resolve_dtype(cfg.dtype, run_device, spec.matrix_shape) or input_dtype(spec)
        return wire_dtype(comm_dtype, compute).itemsize

    return itemsize


def itemsize_rule(comm_itemsize: int | ItemsizeRule) -> ItemsizeRule:
    """``comm_itemsize`` as a rule per batch: a number of bytes is the same for every batch."""
    if callable(comm_itemsize):
        return comm_itemsize
    if isinstance(comm_itemsize, bool) or not isinstance(comm_itemsize, int):
        raise TypeError(f"comm_itemsize must be an int (bytes per element on the wire) or a function "
                        f"(spec, config) -> int, got {comm_itemsize!r}")
    of_itemsize(comm_itemsize)  # a size no wire dtype has: refused here, not in the engine mid-step
    return lambda spec, cfg: comm_itemsize
