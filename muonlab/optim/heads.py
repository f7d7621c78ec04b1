"""Per-head Newton-Schulz: which attention matrices to orthogonalize as blocks of rows.

A fused QKV projection (3C, C) stacks three matrices, and each of them stacks one (C/h, C) block
per head; Muon on the whole matrix couples heads (and q, k, v) that the forward keeps apart.
dion (``split_sizes``, ``num_heads``), NVIDIA Emerging-Optimizers (``muon_split_qkv``) and
torchtitan orthogonalize such blocks separately. In muonlab a parameter (E*M, N) declared as E
blocks is a fused bank (``Muon(fused_banks={name: E})``): each block is its own matrix to the
planner, the paths and the lr ratio, on every layout (a single process, DDP's owner, FSDP2 row
shards, whole blocks or blocks cut by the shards; see muonlab.comm.specs).

``attention_blocks(model)`` finds the attention matrices of a model and returns that
declaration; ``muon_param_groups(model, split_heads=...)`` carries it to ``Muon``.
"""

from __future__ import annotations

import torch.nn as nn

SPLITS = ("heads", "qkv")
"""How a fused QKV projection is cut: one block per head of q, k and v, or three blocks q, k, v."""


def attention_blocks(model: nn.Module, split: str = "heads") -> dict[str, int]:
    """{parameter name: blocks} for the attention input projections of ``model``, each to be
    orthogonalized as that many blocks of rows (pass it as ``Muon(fused_banks=...)``, or use
    ``muon_param_groups(model, split_heads=split)``). Recognised:

    * muonlab's GPT (``muonlab.models.gpt.Attention``): ``qkv.weight`` (3C, C) -> 3 * n_heads
      blocks of (C / n_heads, C) with ``split="heads"``, 3 blocks of (C, C) with ``split="qkv"``.
    * ``nn.MultiheadAttention`` with one embedding size: ``in_proj_weight`` (3E, E), the same way.
    * Hugging Face attention with separate q, k, v Linears (``q_proj``, ``k_proj``, ``v_proj``:
      Llama, Qwen2/3, Mistral, Mixtral, ViT, ...; ``query``, ``key``, ``value``: BERT) and a head
      width (``head_dim``; BERT's ``attention_head_size``): q (n_heads * d, C) -> n_heads blocks,
      k and v (n_kv_heads * d, C) -> n_kv_heads blocks each (grouped-query attention: one block
      per key/value head, which its query heads share). With ``split="qkv"`` they are already
      separate matrices: nothing to declare.

    The output projection (``proj``, ``o_proj``, ``out_proj``) stays one matrix: a head owns a
    block of its COLUMNS, and blocks of columns are no fused bank (Muon's fused banks stack
    matrices on dim 0, the dim FSDP2 shards). Nor is GPT-2's ``c_attn``, a transformers Conv1D
    stored (in, out), split: its heads are column blocks as stored. Heads of another layout:
    declare them yourself with ``Muon(fused_banks={name: blocks})``.

    The lr ratio (``adjust_lr``) then reads a block's shape: under "original", max(1, rows /
    cols) ** 0.5, a (3C, C) QKV took sqrt(3) as one matrix and a (C / n_heads, C) head takes 1.

    Names are the model's own (``model.named_parameters()``); a module reached twice counts once.
    ``simulate(model, W, fused_banks=attention_blocks(model))`` plans the split at any world size.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    from ..models.gpt import Attention  # the models import optim's validation: import here

    out: dict[str, int] = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, Attention):
            out[f"{prefix}qkv.weight"] = 3 * module.n_heads if split == "heads" else 3
        elif isinstance(module, nn.MultiheadAttention) and module.in_proj_weight is not None:
            out[f"{prefix}in_proj_weight"] = 3 * module.num_heads if split == "heads" else 3
        elif split == "heads" and (projections := _separate_projections(module)):
            d = _head_dim(module)
            for proj in projections:
                rows = getattr(module, proj).weight.shape[0]
                if rows % d:
                    raise ValueError(f"attention '{name}': {proj}.weight of shape "
                                     f"{tuple(getattr(module, proj).weight.shape)} has rows that head_dim={d} does "
                                     "not divide")
                out[f"{prefix}{proj}.weight"] = rows // d
    return out


SEPARATE_PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("query", "key", "value"))
"""Names of separate q, k, v Linears: Llama-style, and BERT's self-attention."""


def _separate_projections(module: nn.Module) -> tuple[str, ...]:
    """The names of ``module``'s q, k and v Linears if it is an attention with a head width, else ()."""
    if _head_dim(module) is None:
        return ()
    for names in SEPARATE_PROJECTIONS:
        if all(isinstance(getattr(module, proj, None), nn.Linear) for proj in names):
            return names
    return ()


def _head_dim(module: nn.Module) -> int | None:
    """The attention's head width: its own ``head_dim`` (BERT: ``attention_head_size``), else its
    config's (transformers keeps it on the module since 4.48, on the config before)."""
    for source in (module, getattr(module, "config", None)):
        for attr in ("head_dim", "attention_head_size"):
            d = getattr(source, attr, None)
            if isinstance(d, int) and not isinstance(d, bool) and d > 0:
                return d
    return None
