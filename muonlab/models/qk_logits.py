"""The max attention logit per head, recorded in an attention module's forward for QK-clip.

An attention module takes part by calling :func:`note_max_logits` with its query and key heads
(after RoPE, after any norm on q/k: the tensors whose scaled dot products the softmax sees).
The call does nothing unless ``module.qk_recording`` is true (``QKClip`` turns it on), so the
normal forward is unchanged and costs nothing when recording is off. While on, the module keeps
``module.qk_max_logit``, a float32 tensor (n_heads,), the running max over every forward since
``QKClip.apply`` last read and reset it (micro-batches of one step included).

It lives with the models, which call it; muonlab.optim.qk_clip reads what it records.
"""

from __future__ import annotations

import torch

__all__ = ["max_logits_per_head", "note_max_logits"]

_CHUNK_ELEMENTS = 1 << 24
"""Logit elements computed at once: the batch is cut into pieces so that recording a long context
never holds more than this many float32 logits (64 MiB)."""


def _check_heads(q: torch.Tensor, k: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be (batch, heads, tokens, head_dim), got q {tuple(q.shape)} and "
                         f"k {tuple(k.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1] or q.shape[1] % k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must share batch and head_dim, and k's heads "
                         f"must divide q's (grouped-query attention)")


def _as_additive(mask: torch.Tensor) -> torch.Tensor:
    """A boolean mask (True: attend) as 0 / -inf; a float mask is already additive."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(~mask, float("-inf"))
    return mask.float()


def max_logits_per_head(q: torch.Tensor, k: torch.Tensor, scaling: float, *, causal: bool = True,
                        mask: torch.Tensor | None = None) -> torch.Tensor:
    """The max over batch, query and key of ``scaling * q . k`` per query head, as float32 (heads,).

    ``q`` (batch, heads, q_tokens, head_dim), ``k`` (batch, kv_heads, k_tokens, head_dim); with
    fewer kv heads (grouped-query attention) query head h reads kv head ``h // (heads // kv_heads)``,
    as Hugging Face's ``repeat_kv`` does. ``causal``: query i sees keys 0..i (top-left aligned, as
    ``scaled_dot_product_attention(is_causal=True)``); ``mask``: broadcastable to (batch, heads,
    q_tokens, k_tokens), boolean (True: attend) or additive float, applied as well. Positions no
    query sees do not count; a head that sees nothing reads -inf.
    """
    _check_heads(q, k)
    batch, heads, tq, _ = q.shape
    rep = heads // k.shape[1]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
    bias = None
    if causal:
        bias = torch.ones(tq, k.shape[2], dtype=torch.bool, device=q.device).tril_()
        bias = _as_additive(bias)
    if mask is not None:
        extra = _as_additive(mask)
        bias = extra if bias is None else bias + extra
    per_chunk = max(1, _CHUNK_ELEMENTS // max(1, heads * tq * k.shape[2]))
    out = torch.full((heads,), float("-inf"), dtype=torch.float32, device=q.device)
    for lo in range(0, batch, per_chunk):
        logits = torch.matmul(q[lo:lo + per_chunk].float(), k[lo:lo + per_chunk].float().transpose(-1, -2))
        logits.mul_(scaling)
        if bias is not None:
            b = bias if bias.dim() < 4 or bias.shape[0] == 1 else bias[lo:lo + per_chunk]
            logits = logits + b
        out = torch.maximum(out, logits.amax(dim=(0, 2, 3)))
    return out


def note_max_logits(module: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, scaling: float, *,
                    causal: bool = True, mask: torch.Tensor | None = None) -> None:
    """Fold this forward's max logit per head into ``module.qk_max_logit`` when
    ``module.qk_recording`` is true; otherwise return at once. Call it from an attention module's
    forward with the q and k heads the softmax sees (see :func:`max_logits_per_head` for the
    shapes, ``causal`` and ``mask``). Runs under no_grad: it adds nothing to the autograd graph."""
    if not getattr(module, "qk_recording", False):
        return
    with torch.no_grad():
        seen = max_logits_per_head(q.detach(), k.detach(), scaling, causal=causal, mask=mask)
        previous = getattr(module, "qk_max_logit", None)
        module.qk_max_logit = seen if previous is None else torch.maximum(previous, seen)
