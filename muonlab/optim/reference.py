"""A slow, readable Muon: one matrix at a time, no batching, no communication.

The fast optimizer (batched, distributed) is tested against this; this is tested against
torch.optim.Muon. Read it as the specification of one step.
"""

from __future__ import annotations

import torch

from ..comm.specs import MatrixSpec
from ..kernels.reference import reference_newton_schulz
from .functional import adjust_lr_ratio


@torch.no_grad()
def reference_muon_step(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    bufs: list[torch.Tensor],
    *,
    lr: float,
    momentum: float,
    nesterov: bool,
    weight_decay: float,
    ns_steps: int,
    ns_coefficients,
    eps: float,
    adjust_lr: str | None,
    momentum_form: str,
    ns_dtype: torch.dtype = torch.float32,
    views: list[str] | None = None,
    blocks: list[int] | None = None,
) -> None:
    """One Muon step on full (unsharded) tensors, each read as matrices by its view (one of
    muonlab.comm.specs.VIEWS; default by shape, as in Muon): a bank is a list of matrices, and so
    is a 2-D tensor of ``blocks`` > 1 (a fused bank: that many matrices of rows, one after another)."""
    views = views or [""] * len(params)
    blocks = blocks or [1] * len(params)
    for p, g, buf, view, num_blocks in zip(params, grads, bufs, views, blocks):
        spec = MatrixSpec(0, "reference", tuple(p.shape), "whole", None, view=view, num_fused=num_blocks)
        g = g.float()
        if momentum_form == "ema":
            buf.copy_(buf + (1 - momentum) * (g - buf))
            u = g + momentum * (buf - g) if nesterov else buf.clone()
        else:
            buf.copy_(momentum * buf + g)
            u = g + momentum * buf if nesterov else buf.clone()
        matrices = u.reshape(-1, *spec.matrix_shape)
        ortho = torch.stack([
            reference_newton_schulz(m, ns_steps, ns_coefficients, eps, ns_dtype).float() for m in matrices
        ]).reshape(u.shape)
        ratio = adjust_lr_ratio(spec.lr_shape, adjust_lr)
        p.mul_(1 - lr * weight_decay)
        p.add_(ortho.to(p.dtype), alpha=-lr * ratio)
