"""Run one batch of Newton-Schulz whose every choice is made: the form, the backend, the dtype
it iterates in. ``newton_schulz`` makes those choices (the device's rules) and calls ``run``; so
does the "auto" timing (``backend_choice``), which times each backend on a fixed choice.
"""

from __future__ import annotations

import torch

from .batch_io import load_normalised, store_pieces
from .coefficients import norm_scale
from .forms import FORMS
from .workspace import Workspace


def run(pieces: list[torch.Tensor], targets: list[torch.Tensor], cfg, *, form: str, backend: str,
        dtype: torch.dtype, workspace: Workspace | None = None) -> None:
    """Orthogonalize ``pieces`` ((k, A, B) each, checked, no dim zero) into ``targets`` (as many
    matrices, any float dtype) under ``cfg``, with ``form`` on ``backend`` ("torch" or "triton"),
    iterating in ``dtype``; buffers from ``workspace`` (None: a new one)."""
    unit = FORMS[form]
    if dtype not in unit.dtypes:  # the form's own guarantee (the gram form never iterates in bf16)
        raise ValueError(f"the {form!r} Newton-Schulz form may not iterate in {dtype}; it takes {list(unit.dtypes)}")
    first = pieces[0]
    device = first.device
    rows, cols = first.shape[-2:]
    num = sum(p.shape[0] for p in pieces)
    m, n = sorted((rows, cols))
    tall = rows > cols
    # one contiguous tensor in the iterates' dtype: the iterations write it directly, no copy
    direct = targets[0] if len(targets) == 1 and targets[0].dtype == dtype and targets[0].is_contiguous() else None
    if workspace is None:
        workspace = Workspace()
    # The torch path iterates on the matrices as stored (tall ones too, see plain_iterations);
    # the Triton kernels want them wide, so a tall batch is transposed on its way in.
    stored, square, wide = ((num, rows, cols), dtype), ((num, m, m), dtype), ((num, m, n), dtype)
    squares = [square] * unit.squares
    scale = norm_scale(cfg.coefficients)
    coeffs = cfg.resolved_coefficients()
    if backend == "triton":
        X, spare, *products = workspace.take(device, [wide, wide, *squares])
        load_normalised(X.mT if tall else X, pieces, cfg.eps, scale)
        result = unit.iterate(X, spare, products, coeffs, cfg, dtype, kernels="triton")
        store_pieces(result.mT if tall else result, targets)
        return
    # Two iterate buffers take turns (and the form's m x m products come from the workspace too).
    # A contiguous output in the iterates' dtype is one of the two (its bytes are dead until the
    # result): the input goes into the one that makes the last write land in it. The output may
    # be the input itself: then the input is normalised in place or read first.
    if direct is not None:
        S, *products = workspace.take(device, [stored, *squares])
        first_buffer, second = (direct, S) if unit.writes(cfg, dtype) % 2 == 0 else (S, direct)
    else:
        first_buffer, second, *products = workspace.take(device, [stored, stored, *squares])
    load_normalised(first_buffer, pieces, cfg.eps, scale)
    result = unit.iterate(first_buffer, second, products, coeffs, cfg, dtype, kernels="torch")
    if direct is None:
        store_pieces(result, targets)
