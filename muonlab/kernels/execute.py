"""Run one batch of Newton-Schulz whose every choice is made: the form, the backend, the dtype
it iterates in. ``resolve`` turns those choices into a ``ResolvedRun``, which ``run_resolved``
runs on any number of batches: the runner resolves once per batch key and runs each chunk of
every step with no choice left to make. ``newton_schulz`` (and the "auto" timing,
``backend_choice``, which times each backend on a fixed choice) resolve per call through ``run``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .backends import BACKENDS, NSBackend
from .batch_io import load_normalised, store_pieces
from .coefficients import Coefficients, norm_scale
from .config import NSConfig
from .forms import FORMS, NSForm
from .workspace import Workspace


@dataclass(frozen=True, eq=False)
class ResolvedRun:
    """What ``run_resolved`` needs of a config and its choices, computed once."""

    cfg: NSConfig
    """The config: the forms read their own settings (steps, restarts) from it."""
    form: str
    backend: NSBackend
    """The backend's record: how the executor hands it the batch (``wide``), and the kernels the
    form's products run on."""
    dtype: torch.dtype
    """The dtype the iterates are in."""
    unit: NSForm
    coefficients: Coefficients
    scale: float
    """The factor on each matrix's norm the coefficients assume (``norm_scale``)."""
    result_in_input: bool
    """Whether the torch path's last write lands in the buffer the input was loaded into."""


def resolve(cfg: NSConfig, *, form: str, backend: str, dtype: torch.dtype) -> ResolvedRun:
    """``cfg`` with ``form`` on ``backend`` iterating in ``dtype``, resolved; ValueError where the
    form may not iterate in ``dtype``."""
    unit = FORMS[form]
    if dtype not in unit.dtypes:  # the form's own guarantee (the gram form never iterates in bf16)
        raise ValueError(f"the {form!r} Newton-Schulz form may not iterate in {dtype}; it takes {list(unit.dtypes)}")
    return ResolvedRun(cfg=cfg, form=form, backend=BACKENDS[backend], dtype=dtype, unit=unit,
                       coefficients=cfg.resolved_coefficients(), scale=norm_scale(cfg.coefficients),
                       result_in_input=unit.writes(cfg, dtype) % 2 == 0)


def run(pieces: list[torch.Tensor], targets: list[torch.Tensor], cfg: NSConfig, *, form: str, backend: str,
        dtype: torch.dtype, workspace: Workspace | None = None) -> None:
    """Orthogonalize ``pieces`` ((k, A, B) each, checked, no dim zero) into ``targets`` (as many
    matrices, any float dtype) under ``cfg``, with ``form`` on ``backend`` (a registered one),
    iterating in ``dtype``; buffers from ``workspace`` (None: a new one)."""
    run_resolved(pieces, targets, resolve(cfg, form=form, backend=backend, dtype=dtype), workspace)


def run_resolved(pieces: list[torch.Tensor], targets: list[torch.Tensor], resolved: ResolvedRun,
                 workspace: Workspace | None = None) -> None:
    """``run`` with its choices already resolved (``resolve``)."""
    cfg, unit, dtype = resolved.cfg, resolved.unit, resolved.dtype
    first = pieces[0]
    device = first.device
    rows, cols = first.shape[-2:]
    num = sum([p.shape[0] for p in pieces])  # a list: a generator would be one Python call per piece
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
    backend = resolved.backend
    if backend.wide:
        X, spare, *products = workspace.take(device, [wide, wide, *squares])
        load_normalised(X.mT if tall else X, pieces, cfg.eps, resolved.scale)
        result = unit.iterate(X, spare, products, resolved.coefficients, cfg, dtype, kernels=backend.kernels)
        store_pieces(result.mT if tall else result, targets)
        return
    # Two iterate buffers take turns (and the form's m x m products come from the workspace too).
    # A contiguous output in the iterates' dtype is one of the two (its bytes are dead until the
    # result): the input goes into the one that makes the last write land in it. The output may
    # be the input itself: then the input is normalised in place or read first.
    if direct is not None:
        S, *products = workspace.take(device, [stored, *squares])
        first_buffer, second = (direct, S) if resolved.result_in_input else (S, direct)
    else:
        first_buffer, second, *products = workspace.take(device, [stored, stored, *squares])
    load_normalised(first_buffer, pieces, cfg.eps, resolved.scale)
    result = unit.iterate(first_buffer, second, products, resolved.coefficients, cfg, dtype, kernels=backend.kernels)
    if direct is None:
        store_pieces(result, targets)
