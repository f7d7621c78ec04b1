"""A slow, readable Muon: one matrix at a time, no batching, no communication.

The fast optimizer (batched, distributed) is tested against this; this is tested against
torch.optim.Muon. Read it as the specification of one step.
"""

from __future__ import annotations

import math

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
    update_rule: str = "muon",
    normuon_beta2: float = 0.95,
    normuon_scale: str = "code",
    row_variances: list[torch.Tensor] | None = None,
    num_fused: list[int] | None = None,
) -> None:
    """One Muon step on full (unsharded) tensors, each read as matrices by its view (one of
    muonlab.comm.specs.VIEWS; default by shape, as in Muon): a bank is a list of matrices, a
    fused bank (``num_fused``) its row blocks. ``update_rule="normuon"`` normalises each
    orthogonalized matrix by its rows' second moments ``row_variances`` (updated in place) and
    rescales it to the norm ``normuon_scale`` picks (see muonlab.optim.rules.normuon) before the update."""
    views = views or [""] * len(params)
    num_fused = num_fused or [1] * len(params)
    row_variances = row_variances or [None] * len(params)
    for p, g, buf, view, fused, var in zip(params, grads, bufs, views, num_fused, row_variances):
        spec = MatrixSpec(0, "reference", tuple(p.shape), "whole", None, num_fused=fused, view=view)
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
        ])
        if update_rule == "normuon":  # per neuron: the rows of (out, in), stored columns for "transpose"
            neurons = ortho.transpose(-2, -1) if view == "transpose" else ortho
            variances = var.view(len(matrices), -1, 1)
            neurons = torch.stack([reference_normuon(o, v, normuon_beta2, scale=normuon_scale) for o, v in zip(neurons, variances)])
            ortho = neurons.transpose(-2, -1) if view == "transpose" else neurons
        ortho = ortho.reshape(u.shape)
        ratio = adjust_lr_ratio(spec.lr_shape, adjust_lr)
        p.mul_(1 - lr * weight_decay)
        p.add_(ortho.to(p.dtype), alpha=-lr * ratio)


def reference_normuon(ortho: torch.Tensor, variance: torch.Tensor, beta2: float, eps: float = 1e-10,
                      scale: str = "code") -> torch.Tensor:
    """NorMuon on one orthogonalized matrix (m, n) with its rows' second moments ``variance``
    (m, 1), updated in place (Li et al. 2025, arXiv 2510.05491): rescaled to ||ortho||_F
    (``scale="code"``, the authors' code) or to sqrt(min(m, n)) ("paper", their Algorithm 1)."""
    if scale not in ("code", "paper"):
        raise ValueError(f"scale must be 'code' or 'paper', got {scale!r}")
    variance.lerp_((ortho * ortho).mean(dim=1, keepdim=True), 1 - beta2)
    normalised = ortho / (variance.sqrt() + eps)
    kept = ortho.norm() if scale == "code" else math.sqrt(min(ortho.shape))
    return normalised * (kept / (normalised.norm() + eps))
