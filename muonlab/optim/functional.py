"""The math of one step, on plain tensors and numbers (no optimizer object, no communication).

Muon's per-matrix stages are split so that communication can sit between them:
``muon_momentum_`` (on the rank that owns the shard) -> orthogonalize (elsewhere) ->
``muon_apply_``. AdamW is a single function.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

ADJUST_LR_MODES = ("original", "match_rms_adamw", "spectral", None)
MOMENTUM_FORMS = ("ema", "sum")


def adjust_lr_ratio(matrix_shape: Sequence[int], mode: str | None) -> float:
    """Scale applied to lr for one matrix of GLOBAL shape (A, B) (one expert for 3-D banks).

    "original": sqrt(max(1, A/B)) (Keller Jordan's Muon); "match_rms_adamw": 0.2 sqrt(max(A, B))
    (Moonlight, Liu et al. 2025); "spectral": sqrt(A/B) (Bernstein's spectral condition);
    None: 1.
    """
    A, B = int(matrix_shape[-2]), int(matrix_shape[-1])
    if mode == "original":
        return math.sqrt(max(1.0, A / B))
    if mode == "match_rms_adamw":
        return 0.2 * math.sqrt(max(A, B))
    if mode == "spectral":
        return math.sqrt(A / B)
    if mode is None:
        return 1.0
    raise ValueError(f"unknown adjust_lr {mode!r}; choose one of {ADJUST_LR_MODES}")


def muon_momentum_(
    grads: Sequence[torch.Tensor],
    bufs: Sequence[torch.Tensor],
    *,
    momentum: float,
    nesterov: bool,
    form: str,
    gate=None,
) -> list[torch.Tensor]:
    """Update momentum buffers in place; return the Newton-Schulz inputs (the buffers' dtype,
    grad-shaped), back to back in one new buffer where the buffers share a dtype and device (a
    batch's Newton-Schulz then reads them as one tensor, without a stacking copy).

    "ema" (torch.optim.Muon): m <- lerp(m, g, 1 - mu); input lerp(g, m, mu) or m.
    "sum" (Moonlight, Dion): M <- mu M + g; input g + mu M or M.
    On a GPU each stage is one ``torch._foreach_*`` call over the whole list (one launch per chunk
    of tensors instead of one per tensor: a step of small matrices is otherwise bound by the
    host). On a CPU each tensor is updated and read into its input at once, while its grad and
    buffer are still in cache (staged over the whole list, the second stage read them from memory
    again; a 1B/8 step went from 110 to 108 ms). The arithmetic, and so the bits, are the same
    either way.

    ``gate`` (a muonlab.optim.step_gate.StepGate): the step is decided on the device; the buffers
    change only if it goes: the grads are masked first (``grads_for_momentum``: one new tensor per
    grad, for the batch at once), so the "ema" form takes the same foreach calls on a GPU (a
    skipped step's lerp of m towards m is m); the "sum" form commits each buffer through the gate.
    The returned inputs are finite either way.
    """
    if form not in MOMENTUM_FORMS:
        raise ValueError(f"unknown momentum_form {form!r}; choose one of {MOMENTUM_FORMS}")
    if not bufs:
        return []
    outs = _packed_like(bufs)
    if gate is not None:  # masked (and cast) for the batch at once
        grads = gate.grads_for_momentum(grads, bufs, form)
    if outs[0].is_cuda and (gate is None or form == "ema"):
        _momentum_foreach(outs, _cast_all(grads, bufs), bufs, momentum=momentum, nesterov=nesterov, form=form)
        return outs
    for o, g, buf in zip(outs, grads, bufs):
        g = g.to(buf.dtype)  # one grad at a time: no copy of them all in the buffers' dtype
        # _update_foreach_'s operations one tensor at a time, written out here (a helper called per
        # matrix is host work a batch repeats)
        if gate is not None and form == "sum":  # mu * buf + 0 is not buf: the new buffer is committed
            gate.commit_(buf, (buf * momentum).add_(g))  # out of place
        elif form == "ema":  # under a gate a skipped step's grad is buf: lerp(m, m, w) is m
            buf.lerp_(g, 1 - momentum)
        else:
            buf.mul_(momentum).add_(g)
        if not nesterov:
            o.copy_(buf)
        elif form == "ema":
            torch.lerp(g, buf, momentum, out=o)
        else:
            torch.add(g, buf, alpha=momentum, out=o)
    return outs


def _cast_all(grads, bufs) -> list[torch.Tensor]:
    """The grads in their buffers' dtypes, as the foreach calls want them (on a CPU the loops cast
    one grad at a time instead: bf16 grads of fp32 momentum held an fp32 copy of a whole batch)."""
    return [g.to(buf.dtype) for g, buf in zip(grads, bufs)]


def _update_foreach_(grads, bufs, momentum: float, form: str) -> None:
    if form == "ema":
        torch._foreach_lerp_(bufs, grads, 1 - momentum)
    else:
        torch._foreach_mul_(bufs, momentum)
        torch._foreach_add_(bufs, grads)


def _momentum_foreach(outs, grads, bufs, *, momentum: float, nesterov: bool, form: str) -> None:
    """``muon_momentum_``'s stages as a few foreach launches (the GPU's way): the buffers, then the
    inputs as a copy of g and the same arithmetic in place (the same bits as out of place)."""
    _update_foreach_(grads, bufs, momentum, form)
    torch._foreach_copy_(outs, grads if nesterov else bufs)
    if nesterov and form == "ema":
        torch._foreach_lerp_(outs, bufs, momentum)
    elif nesterov:
        torch._foreach_add_(outs, bufs, alpha=momentum)


def _packed_like(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """New tensors shaped like ``tensors``: views of one buffer, in order, where all share a dtype
    and device; else separate tensors."""
    first = tensors[0]
    for t in tensors:  # (a loop: a comprehension is a Python frame per batch)
        if t.dtype != first.dtype or t.device != first.device:
            return [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    sizes = [t.numel() for t in tensors]
    flat = torch.empty(sum(sizes), dtype=first.dtype, device=first.device)
    return [v.view(t.shape) for v, t in zip(flat.split_with_sizes(sizes), tensors)]  # (split: 2 Python calls more)


def muon_apply_(
    params: Sequence[torch.Tensor],
    updates: Sequence[torch.Tensor],
    *,
    lr: float | torch.Tensor,
    weight_decay: float,
    ratios: Sequence[float],
    row_scales: Sequence[torch.Tensor | None] | None = None,
    gate=None,
) -> None:
    """Decoupled weight decay with the unadjusted lr, then X -= lr * ratio * O: on a GPU one foreach
    call per distinct ratio; on a CPU one add per matrix, each update cast as it is added (its
    foreach call is the same loop of adds, with the same bits, but wants every cast update at once:
    fp32 updates of bf16 parameters held a bf16 copy of a whole batch).

    ``row_scales`` (an update rule's, see muonlab.optim.rules): per matrix None, or a 1-D fp32
    scale of each row of O read as (len(scale), -1): X -= lr * ratio * scale[:, None] * O, in one
    ``addcmul_`` per matrix (no scaled copy of O); or a (1, cols) scale of each column of O read
    as (-1, cols).

    ``gate`` (a muonlab.optim.step_gate.StepGate): the parameters change only if the step goes:
    the decayed parameter is committed through it, and each update (overwritten: it is the step's
    own buffer) is zeroed when the step is skipped.

    A tensor ``lr`` (one element, read on the device: nothing on the host) scales each update
    before its add, in fp32 at least (``_times_lr``), and decays through ``_decayed``."""
    if not params:
        return
    if gate is not None:
        updates = gate.zero_unless_go_(list(updates))
    if isinstance(lr, torch.Tensor):
        updates = [_times_lr(o, lr) for o in updates]
        if weight_decay != 0:
            for p in params:
                if gate is not None:
                    gate.commit_(p, _decayed(p, lr, weight_decay))
                else:
                    p.addcmul_(p, -(lr * weight_decay))  # _decayed, in place
        lr, weight_decay = 1.0, 0  # folded into the updates and the decay above
    if weight_decay != 0:
        factor = 1 - lr * weight_decay
        if gate is not None:
            for p in params:
                gate.commit_(p, p * factor)
        elif params[0].is_cuda:
            torch._foreach_mul_(list(params), factor)
        else:
            # on a CPU _foreach_mul_ rounds its scalar to the tensors' dtype first: in bf16 a factor
            # of 0.998 became 0.99609375 (twice the decay) and 0.9996 became 1.0 (none); mul_ keeps it
            for p in params:
                p.mul_(factor)
    if row_scales is not None and row_scales.count(None) < len(row_scales):
        _add_row_scaled(params, updates, lr=lr, ratios=ratios, row_scales=row_scales)
        return
    if not params[0].is_cuda:
        for p, o, ratio in zip(params, updates, ratios):  # _update_for, written out (a call per matrix)
            p.add_(o.float() if p.dtype == torch.float16 else o.to(p.dtype), alpha=-lr * ratio)
        return
    by_ratio: dict[float, tuple[list, list]] = {}
    for p, o, ratio in zip(params, updates, ratios):
        ps, os_ = by_ratio.setdefault(ratio, ([], []))
        ps.append(p)
        os_.append(_update_for(p, o))
    for ratio, (ps, os_) in by_ratio.items():
        torch._foreach_add_(ps, os_, alpha=-lr * ratio)


def _add_row_scaled(params, updates, *, lr: float, ratios, row_scales) -> None:
    """``muon_apply_``'s update with row scales: one ``addcmul_`` per matrix (the update in its own
    dtype unless the parameter is fp16, as ``_update_for`` says)."""
    for p, o, ratio, scale in zip(params, updates, ratios, row_scales):
        if scale is None:
            p.add_(_update_for(p, o), alpha=-lr * ratio)
            continue
        if p.numel() == 0:  # an empty shard: no rows here
            continue
        o = o.float() if p.dtype == torch.float16 else o
        scale = scale.to(p.device)
        if scale.dim() == 1:  # one per row
            scale = scale.unsqueeze(1)
            shape = (scale.shape[0], p.numel() // scale.shape[0])
        else:  # (1, cols): one per column
            shape = (p.numel() // scale.shape[1], scale.shape[1])
        if p.is_contiguous():
            p.view(shape).addcmul_(o.reshape(shape), scale, value=-lr * ratio)
        else:  # a strided view of a parameter: the scaled update in full, then one add
            p.add_((o.reshape(shape) * scale).view(p.shape).to(p.dtype), alpha=-lr * ratio)


def _times_lr(o: torch.Tensor, lr: torch.Tensor) -> torch.Tensor:
    """An update times a tensor lr: in place when it is fp32 or wider (it is the step's own
    buffer), else as a new fp32 tensor, so lr is never rounded to a 16-bit dtype (on a GPU a
    0-dim device tensor takes the other operand's dtype: lr 0.02 would become 0.0200195 in bf16)."""
    if o.dtype in (torch.bfloat16, torch.float16):
        return o.float().mul_(lr)
    return o.mul_(lr)


def _decayed(p: torch.Tensor, lr: torch.Tensor, weight_decay: float) -> torch.Tensor:
    """``p * (1 - lr * weight_decay)`` for a tensor lr, as ``p + p * (-lr * weight_decay)``: were
    the factor a device tensor in p's 16-bit dtype, 0.998 would become 0.99609375 (twice the decay);
    rounded there, the decay's amount is off by at most its own 0.4%."""
    return torch.addcmul(p, p, -(lr * weight_decay))


def _update_for(p: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """Orthogonalized update ``o`` in the dtype it is added to ``p`` in: ``p``'s, or fp32 for fp16
    (as torch.optim.Muon's mixed-dtype add of its bf16 update does: an fp16 add rounds its alpha
    to fp16 on a CPU, -0.02 became -0.019997)."""
    return o.float() if p.dtype == torch.float16 else o.to(p.dtype)


def adamw_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    *,
    lr: float | torch.Tensor,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    gate=None,
    on_device: bool = False,
) -> None:
    """AdamW (Loshchilov & Hutter) with bias correction; moments in at least fp32, step counts as tensors.

    ``gate`` (a muonlab.optim.step_gate.StepGate: the step decided on the device), a tensor ``lr``
    or ``on_device`` (a step captured in a CUDA graph): the step on the device
    (``_adamw_on_device``: its step counts there too), nothing read on the host."""
    beta1, beta2 = betas
    if gate is not None or isinstance(lr, torch.Tensor) or on_device:
        for p, g, m, v, step in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
            _adamw_on_device(p, g, m, v, step, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, gate=gate)
        return
    for p, g, m, v, step in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
        step += 1
        t = step.item()
        g = g.to(m.dtype)
        if weight_decay != 0:
            p.mul_(1 - lr * weight_decay)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        bias1 = 1 - beta1**t
        bias2 = 1 - beta2**t
        denom = (v.sqrt() / math.sqrt(bias2)).add_(eps)
        if p.dtype == m.dtype:
            p.addcdiv_(m, denom, value=-lr / bias1)  # same rounding as torch.optim.AdamW
        else:
            p.add_((m / denom).to(p.dtype), alpha=-lr / bias1)


def _adamw_on_device(p, g, m, v, step, *, lr: float | torch.Tensor, betas, eps: float, weight_decay: float,
                     gate=None) -> None:
    """One parameter of ``adamw_`` without a host read: the step count (a tensor on the
    parameter's device) and the bias corrections stay on the device, in fp64 like the host's
    Python floats, each rounded where the host path's scalar is (so with a float lr the bits match
    it on a CPU). With a ``gate`` the new parameter, moments and count are committed only if the
    step goes; without, they are written."""
    beta1, beta2 = betas
    commit = gate.commit_ if gate is not None else torch.Tensor.copy_
    g = g.to(m.dtype)
    t = (step + 1).to(torch.float64)
    bias1 = 1 - torch.pow(beta1, t)
    bias2 = 1 - torch.pow(beta2, t)
    if weight_decay == 0:
        new_p = p
    else:
        new_p = _decayed(p, lr, weight_decay) if isinstance(lr, torch.Tensor) else p * (1 - lr * weight_decay)
    new_m = torch.lerp(m, g, 1 - beta1)
    new_v = (v * beta2).addcmul_(g, g, value=1 - beta2)
    denom = (new_v.sqrt() / bias2.sqrt().to(new_v.dtype)).add_(eps)
    scale = (-lr / bias1).to(torch.float32)
    if p.dtype == m.dtype:
        new_p = new_p + (new_m * scale) / denom  # addcdiv's order: value * t1 / t2, then the add
    else:
        new_p = (new_p.float() + (new_m / denom).to(p.dtype).float() * scale).to(p.dtype)
    commit(p, new_p)
    commit(m, new_m)
    commit(v, new_v)
    commit(step, t.to(step.dtype))
