"""Which parameters Muon orthogonalizes and which go to AdamW.

Muon is for hidden matrices: Linear weights and 3-D expert banks. Embeddings, the output head (a
lookup table read backwards), norms and biases go to AdamW (Keller Jordan's Muon post; Moonlight).
The decision is made by module type and shape, plus user name patterns, never by fixed names.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn


def flat_shard_origin(p: torch.Tensor) -> str | None:
    """What flattened ``p`` into a 1-D shard of many parameters, or None.

    FSDP1 (use_orig_params=False) and ZeRO hand the optimizer 1-D flat buffers; their matrices'
    shapes are gone, so Muon cannot orthogonalize them, and routing them to AdamW would silently
    train the model without Muon.
    """
    if getattr(p, "_is_flat_param", False):
        return "an FSDP1 FlatParameter (use FSDP2 fully_shard, e.g. muonlab.distributed.apply_fsdp, or FSDP1 with use_orig_params=True)"
    if hasattr(p, "ds_numel") or hasattr(p, "ds_id"):
        return "a DeepSpeed ZeRO partition (give Muon the module's original parameters)"
    return None


def check_not_flat(p: torch.Tensor, name: str) -> None:
    origin = flat_shard_origin(p)
    if origin:
        raise ValueError(
            f"parameter '{name}' of shape {tuple(p.shape)} is {origin}: a flattened 1-D shard of several "
            "matrices, which Muon cannot orthogonalize and which must not silently fall back to AdamW")


@dataclass(frozen=True)
class Route:
    name: str
    shape: tuple[int, ...]
    algorithm: str
    reason: str


class ParamGroups(list):
    """A list of parameter-group dicts (no names inside) that also knows where each name went.

    ``Muon`` reads ``names`` for its error messages and diagnostics; ``table()`` is for notebooks.
    """

    def __init__(self, groups: list[dict], routes: list[Route], names: dict[torch.Tensor, str]):
        super().__init__(groups)
        self.routes = routes
        self.names = names

    def table(self) -> str:
        width = max((len(r.name) for r in self.routes), default=4)
        lines = [f"{'parameter':<{width}}  {'shape':<18} {'algorithm':<9} reason"]
        for r in self.routes:
            lines.append(f"{r.name:<{width}}  {str(r.shape):<18} {r.algorithm:<9} {r.reason}")
        return "\n".join(lines)

    def counts(self) -> dict[str, int]:
        out = {"muon": 0, "adamw": 0}
        for r in self.routes:
            out[r.algorithm] += 1
        return out


def _route(module: nn.Module, p: torch.Tensor, embeddings: list[torch.Tensor], head: nn.Module | None,
           full_name: str, exclude: Sequence[str]) -> tuple[str, str]:
    for pattern in exclude:
        if fnmatch.fnmatchcase(full_name, pattern):
            return "adamw", f"excluded by pattern {pattern!r}"
    if isinstance(module, nn.Embedding):
        return "adamw", "embedding table"
    if p.ndim < 2:
        return "adamw", "1-D (norm scale or bias)"
    if isinstance(module, nn.modules.conv._ConvNd):
        return "adamw", "convolution kernel"
    if any(p is e for e in embeddings):
        return "adamw", "tied to an embedding"
    if module is head:
        return "adamw", "output head (last Linear shaped like an embedding)"
    if p.ndim >= 3:
        return "muon", f"bank of {p[..., 0, 0].numel()} matrices"
    return "muon", "hidden matrix"


def muon_param_groups(
    model: nn.Module,
    *,
    adamw_lr: float | None = None,
    exclude: Sequence[str] = (),
) -> ParamGroups:
    """Split ``model``'s trainable parameters into a Muon group and an AdamW group.

    Args:
        model: any nn.Module.
        adamw_lr: lr of the AdamW group (default: Muon's ``adamw_lr``).
        exclude: fnmatch patterns on parameter names forced to AdamW (e.g. ``"*.router.*"``).
    """
    if isinstance(exclude, str):
        exclude = (exclude,)
    embeddings = [m.weight for m in model.modules() if isinstance(m, nn.Embedding)]
    # The output head reads the vocabulary back out: the LAST Linear shaped like an embedding
    # (earlier ones can match by accident in small models, e.g. an MLP of width == vocab).
    heads = [m for m in model.modules()
             if isinstance(m, nn.Linear) and any(m.weight.shape == e.shape for e in embeddings)]
    head = heads[-1] if heads else None
    routes, names = [], {}
    buckets: dict[str, list[torch.Tensor]] = {"muon": [], "adamw": []}
    seen: set[int] = set()
    for mod_name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in seen or not p.requires_grad:
                continue  # tied weights are routed once, by their first owner
            seen.add(id(p))
            full = f"{mod_name}.{pname}" if mod_name else pname
            check_not_flat(p, full)
            algorithm, reason = _route(module, p, embeddings, head, full, exclude)
            buckets[algorithm].append(p)
            names[p] = full
            routes.append(Route(full, tuple(p.shape), algorithm, reason))
    groups = []
    if buckets["muon"]:
        groups.append({"params": buckets["muon"], "algorithm": "muon"})
    if buckets["adamw"]:
        adamw = {"params": buckets["adamw"], "algorithm": "adamw"}
        if adamw_lr is not None:
            adamw["lr"] = adamw_lr
        groups.append(adamw)
    return ParamGroups(groups, routes, names)
