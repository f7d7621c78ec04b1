"""QK-clip (MuonClip, Kimi K2, arXiv 2507.20534): after the optimizer step, every attention head whose
max logit in this step's forward passed ``tau`` has its query and key rows scaled down so that its
logits scale by ``gamma_h = tau / max_h``.

    clip = QKClip(model, tau=100.0)     # finds the attention modules, turns logit recording on
    clip.attach(opt)                    # clip.apply() after every opt.step()
    ...                                 # or call clip.apply() yourself after opt.step()
    clip.history[-1].max_logit          # per layer, (heads,) max logit seen before the clip
    clip.history[-1].overshoot          # that max over tau: how far the step's forward went past it

What holds: the clip scales a clipped head's logits, on any input, by ``gamma_h`` (exactly, to
rounding; by the layer's smaller gamma under a shared q/k norm), with ``max_h`` the max of the
forwards BEFORE the optimizer step. So without an update in between, each layer's logits recomputed
after the clip on the input it saw are at most tau (to rounding). With the update (Kimi's order:
forward, step, clip) the clip does not see what the step did to the logits: recomputed after step
and clip they read ``tau * max_h(after the step) / max_h(before)``, and the next forward may pass
tau by that growth (on a small GPT: 1.19 x tau after a Muon step at lr 0.3). ``overshoot`` records it.

What is scaled (``gamma_h = min(1, tau / max_h)``, max over batch, queries and keys of this step's
forwards, over every rank):

* multi-head attention (muonlab's GPT, a Llama with as many kv heads as heads): head h's W_q rows
  and W_k rows (and their bias rows, if any) by ``sqrt(gamma_h)``; a head under tau is not touched.
* grouped-query attention (kv group g serves heads H_g): ``gamma_g = min over h in H_g of gamma_h``;
  group g's W_k rows by ``sqrt(gamma_g)``, head h's W_q rows by ``gamma_h / sqrt(gamma_g)``, so head h's
  logits scale by exactly its own ``gamma_h``. A group none of whose heads passed tau is not touched,
  bit for bit; an unclipped head in a clipped group keeps its logits (to rounding) while its q rows
  grow by ``1 / sqrt(gamma_g)``. With one kv head per head this is the multi-head rule.
* a norm on q and k after the projections (Qwen3's ``q_norm``/``k_norm``, RMSNorm over head_dim,
  shared by the layer's heads): RMSNorm undoes any scaling of the W_q/W_k rows, so they are left
  alone and the norms' weights are scaled instead, by ``sqrt(gamma_layer)`` each with ``gamma_layer``
  the min over the layer's heads: every head of a clipped layer scales by ``gamma_layer``, at most
  its own gamma; a layer with no head over tau is not touched.

Where the heads are read from: muonlab's GPT ``Attention`` records in its own forward; Hugging Face
attention with ``q_proj``/``k_proj`` (Llama, Qwen3, Mistral, ...) gets a forward hook that recomputes
q and k from the layer's input (after q_norm/k_norm and RoPE: the logits the layer computes), when
recording only; an attention module of your own calls :func:`muonlab.models.qk_logits.note_max_logits`
in its forward and is described by a :class:`QKHeads`.

Distributed: the max per head is reduced with MAX over ``group`` (default: all ranks, whose batches
differ under FSDP2, HSDP, DDP and expert parallelism), so every rank takes the same decision; the
row scaling then touches each rank's own rows only: a DTensor sharded ``Shard(0)`` (FSDP2, the
dense parameters under muonlab's EP) scales the rows of its local shard, which may cut through a
head or be empty, a replicated weight (DDP) all its rows. Under tensor parallelism (q/k split
column-wise, whole heads per TP rank, then FSDP2: ``(_StridedShard(0), Shard(0))``) each TP rank's
forward sees its own heads only: their maxima go to their places among all the heads (the others
-inf) before the MAX over every rank, so each head's max is the max over the data-parallel ranks of
the TP rank that holds it, and every rank scales the rows it holds of each head.
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from .._base import collective_device, dist_on
from ..models.gpt import Attention
from ..models.qk_logits import note_max_logits

__all__ = ["QKClip", "QKClipStep", "QKHeads", "clip_factors", "heads_of"]


@dataclass
class QKHeads:
    """How QK-clip reads and scales one attention module.

    ``module`` records (``qk_recording`` / ``qk_max_logit``, see muonlab.models.qk_logits). ``q`` and
    ``k``: ``(tensor, first_row)`` pairs, the tensors (a weight, its bias) whose rows
    ``first_row + h * head_dim ...`` produce query head h (kv head g for ``k``), in full-tensor rows
    (a sharded DTensor is scaled on its local rows). ``qk_norms``: ``(q_norm weight, k_norm weight)``
    where a norm over head_dim shared by the heads follows the projections; then those are scaled and
    ``q``/``k`` are not (see the module docstring)."""

    name: str
    module: nn.Module
    n_heads: int
    n_kv_heads: int
    head_dim: int
    q: tuple[tuple[torch.Tensor, int], ...]
    k: tuple[tuple[torch.Tensor, int], ...]
    qk_norms: tuple[torch.Tensor, torch.Tensor] | None = None

    def __post_init__(self):
        for what in ("n_heads", "n_kv_heads", "head_dim"):
            value = getattr(self, what)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"QKHeads {self.name!r}: {what} must be an integer >= 1, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"QKHeads {self.name!r}: n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")
        for side, pairs, heads in (("q", self.q, self.n_heads), ("k", self.k, self.n_kv_heads)):
            if not pairs and self.qk_norms is None:
                raise ValueError(f"QKHeads {self.name!r}: no {side} tensor to scale")
            for t, first in pairs:
                if t.shape[0] < first + heads * self.head_dim:
                    raise ValueError(f"QKHeads {self.name!r}: {side} rows {first} .. {first + heads * self.head_dim} "
                                     f"({heads} heads x {self.head_dim}) do not fit a tensor of shape {tuple(t.shape)}")
        if self.qk_norms is not None:
            for t in self.qk_norms:
                if tuple(t.shape) != (self.head_dim,):
                    raise ValueError(f"QKHeads {self.name!r}: a q/k norm weight must be ({self.head_dim},) (one "
                                     f"per head_dim, shared by the heads), got {tuple(t.shape)}")


@dataclass
class QKClipStep:
    """What one :meth:`QKClip.apply` saw and did, per layer (``QKClip.names`` order), as tensors on the
    device the step ran on (reading them on a GPU waits for the step: ``clipped_heads`` does)."""

    max_logit: list[torch.Tensor] = field(default_factory=list)
    """(n_heads,) float32: the max logit per head over this step's forwards and every rank, before
    the clip (-inf for a layer that ran no forward)."""
    gamma: list[torch.Tensor] = field(default_factory=list)
    """(n_heads,) float64: the factor each head's logits were scaled by (1.0: untouched)."""
    tau: float = math.inf
    """The threshold of the clip (math.inf: recording only)."""

    @property
    def overshoot(self) -> float:
        """The largest max logit over tau, across layers and heads (a host read): how far this
        step's forward went past tau (<= 1: not at all; after a clip, the previous update's growth);
        0.0 with tau = inf, -inf when no forward ran."""
        return float(torch.stack([m.max() for m in self.max_logit]).max()) / self.tau

    @property
    def clipped_heads(self) -> int:
        return int(sum((g < 1).sum() for g in self.gamma))


def clip_factors(max_logit: torch.Tensor, tau: float, n_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(gamma per head, q row factor per head, k row factor per kv head)`` in float64 for the
    grouped-query rule of the module docstring (one kv head per head: multi-head attention)."""
    m = max_logit.double()
    gamma = torch.where(m > tau, tau / m, torch.ones_like(m))
    gamma_group = gamma.view(n_kv_heads, -1).amin(dim=1)
    k_factor = gamma_group.sqrt()
    q_factor = gamma / k_factor.repeat_interleave(gamma.numel() // n_kv_heads)
    same = gamma == gamma_group.repeat_interleave(gamma.numel() // n_kv_heads)
    q_factor = torch.where(same, gamma.sqrt(), q_factor)  # MHA: exactly sqrt(gamma) on both sides
    return gamma, q_factor, k_factor


# ---------------------------------------------------------------------------------- finding heads


def _hf_rope(module: nn.Module):
    return getattr(sys.modules.get(type(module).__module__), "apply_rotary_pos_emb", None)


def _looks_like_hf(module: nn.Module) -> bool:
    return (isinstance(getattr(module, "q_proj", None), nn.Linear) and isinstance(getattr(module, "k_proj", None), nn.Linear)
            and getattr(module, "config", None) is not None and hasattr(module, "head_dim"))


def heads_of(name: str, module: nn.Module) -> QKHeads:
    """The :class:`QKHeads` of muonlab's GPT ``Attention`` or of a Hugging Face attention module
    (``q_proj``/``k_proj``, ``config.num_attention_heads``/``num_key_value_heads``, ``head_dim``,
    ``scaling`` and ``apply_rotary_pos_emb`` in its modeling module).

    Raises:
        TypeError: ``module`` is neither, or its heads cannot be read, naming it and what is missing.
    """
    if isinstance(module, Attention):
        c = module.proj.in_features
        w = module.qkv.weight
        return QKHeads(name, module, module.n_heads, module.n_heads, c // module.n_heads, q=((w, 0),), k=((w, c),))
    if not _looks_like_hf(module):
        raise TypeError(f"QKClip cannot read the heads of {name!r} ({type(module).__name__}): it reads muonlab's GPT "
                        f"Attention and Hugging Face attention with q_proj/k_proj Linear layers, a config and "
                        f"head_dim; describe your own with QKHeads (and call note_max_logits in its forward)")
    cfg, d = module.config, module.head_dim
    n_heads = getattr(cfg, "num_attention_heads", None)
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_heads
    missing = [what for what, ok in (("config.num_attention_heads", n_heads), ("scaling", hasattr(module, "scaling")),
                                     ("apply_rotary_pos_emb in its modeling module", _hf_rope(module))) if not ok]
    if missing:
        raise TypeError(f"QKClip cannot read the heads of {name!r} ({type(module).__name__}): it has no "
                        f"{', '.join(missing)}")
    q_proj, k_proj = module.q_proj, module.k_proj
    if q_proj.out_features != n_heads * d or k_proj.out_features != n_kv * d:
        raise TypeError(f"QKClip cannot read the heads of {name!r} ({type(module).__name__}): q_proj has "
                        f"{q_proj.out_features} rows and k_proj {k_proj.out_features}, not {n_heads} and {n_kv} heads "
                        f"x head_dim {d}")
    q_norm, k_norm = getattr(module, "q_norm", None), getattr(module, "k_norm", None)
    if q_norm is not None or k_norm is not None:
        weights = tuple(getattr(n, "weight", None) for n in (q_norm, k_norm))
        if any(w is None or tuple(w.shape) != (d,) for w in weights):
            raise TypeError(f"QKClip cannot clip {name!r} ({type(module).__name__}): its q_norm/k_norm are not both "
                            f"norms over head_dim {d} with a weight (which QK-clip would scale)")
        return QKHeads(name, module, n_heads, n_kv, d, q=(), k=(), qk_norms=weights)
    q = tuple((t, 0) for t in (q_proj.weight, q_proj.bias) if t is not None)
    k = tuple((t, 0) for t in (k_proj.weight, k_proj.bias) if t is not None)
    return QKHeads(name, module, n_heads, n_kv, d, q=q, k=k)


def _hf_record_hook(module, args, kwargs, output):
    """Forward hook of a Hugging Face attention module: its q and k as its forward computes them
    (projection, q_norm/k_norm, RoPE), recorded when recording is on. The causal mask is top-left
    aligned, as in a forward from the first token (training's): a forward that continues a KV
    cache (generation) is not recorded, with a warning, since its keys start before its queries."""
    if not getattr(module, "qk_recording", False):
        return
    hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    # the cache's keyword: "cache" from transformers 5.24, "past_key_values" in 5.0-5.23, "past_key_value" in 4
    cache = next((kwargs[k] for k in ("cache", "past_key_values", "past_key_value") if kwargs.get(k) is not None), None)
    if cache is not None and hasattr(cache, "get_seq_length"):
        earlier = cache.get_seq_length(getattr(module, "layer_idx", 0) or 0) - hidden.shape[-2]
        if earlier > 0:
            warnings.warn(f"QKClip did not record a forward of {type(module).__name__} that continued a KV cache "
                          f"of {earlier} earlier tokens (generation): it records forwards from the first token, "
                          "as training makes them", RuntimeWarning, stacklevel=2)
            return
    position = kwargs["position_embeddings"] if "position_embeddings" in kwargs else (args[1] if len(args) > 1 else None)
    mask = kwargs["attention_mask"] if "attention_mask" in kwargs else (args[2] if len(args) > 2 else None)
    with torch.no_grad():
        shape = (*hidden.shape[:-1], -1, module.head_dim)
        q, k = module.q_proj(hidden).view(shape), module.k_proj(hidden).view(shape)
        if getattr(module, "q_norm", None) is not None:
            q, k = module.q_norm(q), module.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        if position is not None:
            q, k = _hf_rope(module)(q, k, *position)
        note_max_logits(module, q, k, module.scaling, causal=getattr(module, "is_causal", True),
                        mask=mask if isinstance(mask, torch.Tensor) else None)


# ---------------------------------------------------------------------------------- rows


def _tp_first_head(h: QKHeads, recorded: torch.Tensor) -> int:
    """The first query head of a max logit that recorded fewer heads than the module has: tensor
    parallelism gave this rank's forward a contiguous run of them (its column-wise q rows: a TP axis
    of ``n_heads / recorded`` ranks sharding the q weight ``Shard(0)``).

    Raises:
        ValueError: no such TP axis explains the shape, naming the module and the shapes."""
    weight = h.q[0][0] if h.q else getattr(getattr(h.module, "q_proj", None), "weight", None)
    count = recorded.numel()
    if recorded.dim() == 1 and count and h.n_heads % count == 0 and hasattr(weight, "placements"):
        from torch.distributed.tensor import Shard

        tp = h.n_heads // count
        mesh = weight.device_mesh
        axes = [a for a, pl in enumerate(weight.placements)
                if type(pl) is Shard and pl.dim == 0 and mesh.size(a) == tp]  # FSDP2's is a _StridedShard
        if len(axes) == 1:
            return mesh.get_coordinate()[axes[0]] * count
    raise ValueError(f"{h.name!r} recorded a max logit of shape {tuple(recorded.shape)}, expected ({h.n_heads},), or "
                     f"one tensor-parallel rank's heads of a q weight split Shard(0) over a TP axis")


def _row_runs(t: torch.Tensor) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """(this rank's rows of ``t`` as a plain tensor, its runs of rows: (first local row, first full
    row, rows) each).

    A DTensor may be sharded on dim 0 only, by any Shards and _StridedShards: FSDP2 ``Shard(0)``,
    HSDP ``(Replicate(), Shard(0))``, tensor parallel and FSDP2 ``(_StridedShard(0), Shard(0))``;
    its local rows follow ``torch.chunk`` (muonlab.comm.specs.held_piece), so a rank may hold none."""
    if not hasattr(t, "to_local"):
        return t, [(0, 0, t.shape[0])]
    from torch.distributed.tensor import Replicate

    from ..comm.specs import held_piece

    local = t.to_local()
    sharded = [p for p in t.placements if not isinstance(p, Replicate)]
    if any(getattr(p, "dim", None) != 0 for p in sharded):
        raise ValueError(f"QKClip scales rows of tensors sharded on dim 0 only (FSDP2's Shard(0), tensor parallel's "
                         f"column-wise split), got placements {list(t.placements)} on a tensor of shape {tuple(t.shape)}")
    piece = held_piece(tuple(t.shape), tuple(t.device_mesh.mesh.shape), tuple(t.device_mesh.get_coordinate()),
                       tuple(t.placements))
    runs, at = [], 0
    for start, n in piece[0]:
        runs.append((at, start, n))
        at += n
    if at != local.shape[0]:
        raise ValueError(f"QKClip expected {at} local rows of {tuple(t.shape)} placed {list(t.placements)}, got "
                         f"{local.shape[0]}")
    return local, runs


def _scale_rows_(t: torch.Tensor, first: int, factors: torch.Tensor, rows_per_factor: int) -> None:
    """Multiply full rows ``first + i*rows_per_factor ...`` by ``factors[i]``, on this rank's rows
    only. Every such row is multiplied, whatever its factor: x * 1.0 is x bit for bit, so the rows
    of heads under tau come out unchanged, and no factor is read on the host (on a GPU that read
    would wait for the step)."""
    local, runs = _row_runs(t)
    end = first + factors.numel() * rows_per_factor
    for at, start, n in runs:
        lo, hi = max(first, start), min(end, start + n)
        if lo >= hi:
            continue
        mine = factors.repeat_interleave(rows_per_factor)[lo - first:hi - first]
        local[at + lo - start:at + hi - start].mul_(mine.to(local.device, local.dtype).view(-1, *([1] * (local.dim() - 1))))


# ---------------------------------------------------------------------------------- QKClip


def check_tau(tau, name: str = "tau") -> None:
    """ValueError naming ``name`` unless ``tau`` is a number > 0 (math.inf: record, never clip)."""
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not tau > 0:
        raise ValueError(f"{name} must be a number > 0 (the max attention logit a head may keep; math.inf records "
                         f"the max logits only), got {tau!r}")


class QKClip:
    """QK-clip of ``model``'s attention heads at threshold ``tau`` (see the module docstring).

    ``modules``: None (default) finds muonlab GPT ``Attention`` and Hugging Face attention modules
    (``q_proj``/``k_proj``) in ``model``; else a list of such modules or :class:`QKHeads` of your own.
    ``tau=math.inf`` records without clipping (to watch logits under another optimizer). ``group``:
    the process group whose ranks' maxima are combined (default: all ranks when torch.distributed
    is initialized). Recording starts at construction; :meth:`close` stops it and removes the hooks.
    What a clip promises, and what it does not (the next forward's logits): see the module docstring.

    Raises (before anything changes):
        ValueError: ``tau`` not a number > 0; no attention module found.
        TypeError: a module whose heads cannot be read, naming it.
    """

    def __init__(self, model: nn.Module, tau: float = 100.0, *, modules: Iterable | None = None, group=None,
                 keep_history: bool = True):
        check_tau(tau)
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        names = {id(m): n for n, m in model.named_modules()}
        if modules is None:
            found = [(n, m) for n, m in model.named_modules() if isinstance(m, Attention) or _looks_like_hf(m)]
            if not found:
                raise ValueError(f"QKClip found no attention module in {type(model).__name__}: it finds muonlab's GPT "
                                 f"Attention and Hugging Face attention with q_proj/k_proj; pass modules= (QKHeads "
                                 f"of your own attention)")
            heads = [heads_of(n, m) for n, m in found]
        else:
            heads = []
            for i, m in enumerate(modules):
                if isinstance(m, QKHeads):
                    heads.append(m)
                elif isinstance(m, nn.Module):
                    heads.append(heads_of(names.get(id(m), f"modules[{i}]"), m))
                else:
                    raise TypeError(f"modules[{i}] must be an attention nn.Module or a QKHeads, got {type(m).__name__}")
            if not heads:
                raise ValueError("modules= is empty: QKClip needs at least one attention module")
        self.tau = float(tau)
        self.heads = heads
        self.names = [h.name for h in heads]
        self.group = group
        self.keep_history = keep_history
        self.history: list[QKClipStep] = []
        self._handles = [h.module.register_forward_hook(_hf_record_hook, with_kwargs=True)
                         for h in heads if _looks_like_hf(h.module)]
        self._step_handle = None
        for h in heads:
            h.module.qk_recording = True
            h.module.qk_max_logit = None

    # -- the step
    def _reduced_maxima(self) -> list[torch.Tensor]:
        """Each module's max logit per head over this step's forwards and the group's ranks, on the
        device the modules recorded on (no host read: on a GPU nothing here waits for the step)."""
        recorded = [h.module.qk_max_logit for h in self.heads]
        device = next((m.device for m in recorded if m is not None), torch.device("cpu"))
        seen = []
        for h, m in zip(self.heads, recorded):
            if m is None:
                m = torch.full((h.n_heads,), float("-inf"), device=device)
            m = m.detach().float().to(device)
            if m.shape != (h.n_heads,):  # a TP rank's own heads: in their places, -inf elsewhere
                first = _tp_first_head(h, m)
                m = torch.full((h.n_heads,), float("-inf"), device=device).index_copy_(
                    0, torch.arange(first, first + m.numel(), device=device), m)
            seen.append(m)
        flat = torch.cat(seen)
        if dist_on() and dist.get_world_size(self.group) > 1:
            moved = flat.to(collective_device(self.group))
            dist.all_reduce(moved, op=dist.ReduceOp.MAX, group=self.group)
            flat = moved.to(device)
        return list(flat.split([h.n_heads for h in self.heads]))

    @torch.no_grad()
    def apply(self) -> QKClipStep:
        """Clip the heads whose max logit since the last call passed tau; reset the maxima. Call after
        ``opt.step()`` on every rank of ``group`` (it makes one all-reduce). Returns what it did (also
        appended to ``history`` when ``keep_history``)."""
        maxima = self._reduced_maxima()
        report = QKClipStep(tau=self.tau)
        for h, m in zip(self.heads, maxima):
            gamma, q_factor, k_factor = clip_factors(m, self.tau, h.n_kv_heads)
            if h.qk_norms is not None:  # a shared norm: every head of the layer by the layer's min gamma
                gamma = gamma.amin().expand_as(gamma).clone()
                for w in h.qk_norms if self.tau != math.inf else ():
                    _scale_rows_(w, 0, gamma[:1].sqrt(), h.head_dim)
            elif self.tau != math.inf:  # factors of 1 leave their rows' bits as they are (see _scale_rows_)
                for t, first in h.q:
                    _scale_rows_(t, first, q_factor, h.head_dim)
                for t, first in h.k:
                    _scale_rows_(t, first, k_factor, h.head_dim)
            report.max_logit.append(m)
            report.gamma.append(gamma)
            h.module.qk_max_logit = None
        if self.keep_history:
            self.history.append(report)
        return report

    def attach(self, optimizer: torch.optim.Optimizer) -> QKClip:
        """Run :meth:`apply` after every ``optimizer.step()`` (a step post-hook); returns self.

        Raises:
            TypeError: ``optimizer`` is not a torch.optim.Optimizer (it takes step post-hooks).
            RuntimeError: already attached.
        """
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"QKClip.attach(optimizer) takes the torch.optim.Optimizer whose steps it follows "
                            f"(an instance, e.g. Muon(...)), got {type(optimizer).__name__} {optimizer!r}")
        if self._step_handle is not None:
            raise RuntimeError("this QKClip is already attached to an optimizer; close() it first")
        self._step_handle = optimizer.register_step_post_hook(lambda *_: self.apply())
        return self

    def detach(self) -> None:
        """Remove the step hook of :meth:`attach` (recording goes on)."""
        if self._step_handle is not None:
            self._step_handle.remove()
            self._step_handle = None

    def close(self) -> None:
        """Stop recording, remove the forward hooks and the step hook; the weights stay as they are."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.detach()
        for h in self.heads:
            h.module.qk_recording = False
            h.module.qk_max_logit = None

    # -- for plots
    def max_logit_per_layer(self) -> torch.Tensor:
        """(steps, layers): the max over heads of each recorded step's max logit (before the clip)."""
        if not self.history:
            return torch.empty(0, len(self.heads))
        return torch.stack([torch.stack([m.max() for m in s.max_logit]) for s in self.history])

    def clipped_per_step(self) -> list[int]:
        """Heads clipped at each recorded step."""
        return [s.clipped_heads for s in self.history]

    def __repr__(self) -> str:
        return f"QKClip(tau={self.tau}, {len(self.heads)} attention modules, {len(self.history)} steps recorded)"
