"""A small GPT and a MoE GPT whose experts are 3-D grouped weights (num_experts, d_out, d_in).

Sized to train on a CPU in seconds. Byte-level tokens, pre-norm blocks, causal attention through
``scaled_dot_product_attention``, no biases in linear layers (so every Linear weight is a matrix
for Muon and every 1-D tensor is a norm).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .._base import check_whole
from .qk_logits import note_max_logits


@dataclass(kw_only=True)
class GPTConfig:
    """Shape of the small GPT."""

    vocab_size: int = 256
    """Number of token ids (256 for byte-level text)."""
    context: int = 64
    """Maximum sequence length."""
    d_model: int = 64
    """Residual stream width."""
    n_layers: int = 2
    """Number of transformer blocks."""
    n_heads: int = 4
    """Attention heads; must divide d_model."""
    mlp_ratio: int = 4
    """Hidden width of the MLP (or of each expert) as a multiple of d_model."""
    tie_embeddings: bool = False
    """Share the token embedding with the output head."""
    num_experts: int = 0
    """Experts per MoE layer; 0 builds dense MLPs."""
    top_k: int = 2
    """Experts each token is routed to (MoE only)."""

    def __post_init__(self):
        least = dict(vocab_size=1, context=1, d_model=1, n_layers=1, n_heads=1, mlp_ratio=1, num_experts=0, top_k=1)
        for name, low in least.items():
            check_whole(f"GPTConfig.{name}", getattr(self, name), low)
        if self.d_model % self.n_heads:
            raise ValueError(f"n_heads={self.n_heads} must divide d_model={self.d_model}")
        if self.num_experts and not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")


def check_width(name: str, width, n_heads: int) -> None:
    """A model width given as argument ``name`` (a GPTConfig's d_model with ``n_heads`` heads): a
    ValueError naming ``name`` unless it is a whole number >= 1 that ``n_heads`` divides, raised
    before any model is built."""
    check_whole(name, width, 1)
    if width % n_heads:
        raise ValueError(f"{name} must be a multiple of {n_heads} (the model's {n_heads} attention heads), got {width}")


class Attention(nn.Module):
    """Causal multi-head attention with a fused (3C, C) qkv projection: rows [0, C) are the query
    heads, [C, 2C) the key heads, [2C, 3C) the value heads, head h at rows h*d .. (h+1)*d of each.

    With ``qk_recording`` on (muonlab.optim.qk_clip.QKClip sets it), each forward also folds the max
    attention logit per head into ``qk_max_logit`` (muonlab.models.qk_logits); off, the forward is
    scaled_dot_product_attention alone.
    """

    qk_recording = False
    qk_max_logit = None

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=-1)
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for t in (q, k, v))
        if self.qk_recording:  # the logits SDPA computes: scale 1/sqrt(head_dim), causal
            note_max_logits(self, q, k, (C // self.n_heads) ** -0.5)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model, bias=False)
        self.out = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x):
        return self.out(F.gelu(self.fc(x)))


class MoE(nn.Module):
    """Top-k routed experts; expert weights are banks of shape (num_experts, d_out, d_in). Each
    token's expert outputs are weighted by its gates (see :meth:`route`).

    ``dispatcher`` moves tokens to the experts and back: ``None`` (the default) computes every
    expert on this rank; expert parallelism (muonlab.distributed.apply_ep) installs a callable
    ``dispatcher(moe, tokens_sorted_by_expert, counts) -> outputs in the same order``.
    """

    dispatcher = None
    expert_banks = ("w_in", "w_out")
    """Names of the (num_experts, d_out, d_in) banks: muon_param_groups reads them as banks of
    matrices, one expert's (1, d_out, d_in) bank too (its shape alone reads as a size-1 table)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        hidden = cfg.mlp_ratio * cfg.d_model
        self.num_experts, self.top_k = cfg.num_experts, cfg.top_k
        self.router = nn.Linear(cfg.d_model, cfg.num_experts, bias=False)
        self.w_in = nn.Parameter(torch.empty(cfg.num_experts, hidden, cfg.d_model))
        self.w_out = nn.Parameter(torch.empty(cfg.num_experts, cfg.d_model, hidden))
        self.reset_parameters()

    def reset_parameters(self):
        for w in (self.w_in, self.w_out):
            bound = 1.0 / w.shape[-1] ** 0.5  # nn.Linear's default range, per expert
            nn.init.uniform_(w, -bound, bound)

    def route(self, x):
        """(token ids sorted by expert, their gate weights, tokens per expert) for flat x (N, C).

        A token's gates are the router's softmax probabilities of its top-k experts, renormalised to
        sum to 1 when top_k > 1. With top_k == 1 the gate is the raw probability, as in the Switch
        Transformer (Fedus et al. 2021): renormalised, it would be p / p = 1 and the router would get
        no gradient."""
        logits = self.router(x)
        gates, experts = logits.softmax(-1).topk(self.top_k, dim=-1)
        if self.top_k > 1:
            gates = gates / gates.sum(-1, keepdim=True)
        flat_expert = experts.reshape(-1)
        order = flat_expert.argsort(stable=True)
        token = order // self.top_k
        counts = torch.bincount(flat_expert, minlength=self.num_experts)
        return token, gates.reshape(-1)[order], counts

    @staticmethod
    def expert_forward(w_in, w_out, tokens, counts):
        """Run each expert on its contiguous slice of ``tokens`` (sorted by expert)."""
        outs = []
        for e, chunk in enumerate(tokens.split(counts.tolist())):
            outs.append(F.gelu(chunk @ w_in[e].T) @ w_out[e].T)
        return torch.cat(outs) if outs else tokens

    def forward(self, x):
        B, T, C = x.shape
        flat = x.reshape(-1, C)
        token, gate, counts = self.route(flat)
        if self.dispatcher is None:
            y = self.expert_forward(self.w_in, self.w_out, flat[token], counts)
        else:
            y = self.dispatcher(self, flat[token], counts)
        out = torch.zeros_like(flat).index_add_(0, token, y * gate.unsqueeze(-1).to(y.dtype))
        return out.view(B, T, C)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.d_model, bias=False)
        self.attn = Attention(cfg)
        self.norm2 = nn.LayerNorm(cfg.d_model, bias=False)
        self.mlp = MoE(cfg) if cfg.num_experts else MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model, bias=False)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    def forward(self, idx, targets=None):
        T = idx.shape[1]
        if T > self.cfg.context:
            raise ValueError(f"sequence length {T} exceeds the model's context {self.cfg.context}")
        pos = torch.arange(T, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def moe_config(**overrides) -> GPTConfig:
    """A GPTConfig with 4 experts, top-2, unless overridden."""
    overrides.setdefault("num_experts", 4)
    return GPTConfig(**overrides)
