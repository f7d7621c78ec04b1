"""Which parameters Muon orthogonalizes, which go to AdamW, and how Muon reads each as matrices.

Muon is for hidden matrices. Embeddings, the output head (a lookup table read backwards), norms and
biases go to AdamW (Keller Jordan's Muon post; Moonlight). The decision is made by module type,
plus rules for raw parameters and user name patterns. Every matrix goes to Muon unless a rule
below clearly sends it elsewhere; the first rule that applies decides, and ``ParamGroups.table()``
shows each decision with its reason:

1. ``exclude`` patterns -> AdamW; ``include`` patterns -> Muon (any parameter of 2+ dims); 1-D
   tensors (norm scales, biases) and empty ones -> AdamW; nn.Embedding (and EmbeddingBag) tables,
   and anything tied to one -> AdamW.
2. The output head -> AdamW, only in a model with the structure of a network that reads out
   features: an nn.Embedding, a convolution, or an nn.ModuleList of blocks (items that hold
   layers). A plain MLP (nn.Sequential of Linears, deepmd-kit's fitting networks) or a lone
   Linear has no head: all its matrices go to Muon. The head is the LAST nn.Linear or
   transformers Conv1D of the model, in module registration order, that is not inside an
   nn.ModuleList (the repeated blocks): lm_head, classifier, score, a CNN's final fc; and the last
   such Linear shaped like an embedding. A list of bare Linear/Conv1D layers of one non-square
   shape is no block but parallel layers: a head in it takes the others along (one head per
   codebook, per draft token). A bare backbone whose Linears all live in blocks has no head.
3. nn.Linear (and nn.MultiheadAttention's input projections) -> Muon, view "matrix", unless a
   dim is 1 (a scalar gate: Muon would reduce it to its normalised gradient) -> AdamW;
   transformers' Conv1D, which stores its weight (in, out) -> Muon, view "transpose". A module's
   declared ``expert_banks`` (muonlab's MoE) -> Muon, view "bank", one expert's too.
4. Convolution kernels -> AdamW by default; ``conv="muon"`` sends them to Muon, view "flatten"
   (one (out, in * prod(kernel)) matrix per kernel).
5. Raw parameters (owned by any other module, e.g. an nn.Parameter attribute), in this order:
   a. a matrix dim (one of the last two) of size 1 -> AdamW (class tokens, a single row);
   b. one matrix (2-D, or (1, ..., 1, m, n)) whose name says it is a table, learned tokens or a
      router -> AdamW: a word of ``RAW_TABLE_WORDS`` in its name or its module's (pos_embed,
      position_embeddings), of ``RAW_TOKEN_WORDS`` in its own name (register_tokens, latents,
      query), or a name of ``RAW_ROUTER_NAMES`` (a module ``gate`` or ``router``). The one place
      names decide, since a raw tensor has no type to read;
   c. a 2-D tensor held by a module that also holds layers (a child module with parameters): a
      table, learned queries or a state matrix added next to those layers (a position table,
      Mamba's A_log, CLIP's projection) -> AdamW;
   d. otherwise -> Muon: 2-D is the weight matrix of a hand-written layer, whose own forward
      reads it (deepmd-kit's (in, out) ``matrix``, a layer's (6, 4) weight), view "matrix"; 3-D+
      is a bank, one matrix per leading index (expert banks, a (1, m, n) bank of one expert
      included, wherever it is held), view "bank".

Rules 2 and 5b-c guess a role: a matrix they send to AdamW is named in one ``RoutingWarning``
per call, with the ``include=``/``exclude=`` patterns that decide it instead (a choice made
there is not warned about). A head shaped like one of the model's embeddings (a language model's
vocabulary projection) is no guess and is not warned about; nor are rules 1, 3, 4 and 5a.

The views (see muonlab.comm.specs) travel to ``Muon`` through ``ParamGroups.views``, and the blocks
of ``split_heads`` (muonlab.optim.heads) through ``ParamGroups.fused_banks``.
"""

from __future__ import annotations

import fnmatch
import math
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from .heads import SPLITS, attention_blocks

CONV_ROUTES = ("adamw", "muon")

EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)
"""Lookup tables (rule 1): an EmbeddingBag's weight is no raw matrix of a layer."""

RAW_TABLE_WORDS = ("embed", "embeds", "embedding", "embeddings", "emb", "pos", "position", "positions",
                   "positional", "table", "codebook")
"""Rule 5b: a word of a raw parameter's name, or of its module's name, that says it is a table."""

RAW_TOKEN_WORDS = ("token", "tokens", "cls", "query", "queries", "latent", "latents", "prompt", "prompts")
"""Rule 5b: a word of a raw parameter's own name that says it holds learned tokens or queries (a
module named ``query`` is an attention projection, so its name does not count)."""

RAW_ROUTER_NAMES = ("router", "routers", "routing", "gate", "gating")
"""Rule 5b: a raw parameter, or its module, named exactly so is a router ("gate_up_proj" is none)."""


class RoutingWarning(UserWarning):
    """muon_param_groups sent a matrix to AdamW by a guess of its role (rules 2 and 5b-c)."""


def flat_shard_origin(p: torch.Tensor) -> str | None:
    """What flattened ``p`` into a 1-D shard of many parameters, or None.

    FSDP1 (use_orig_params=False) and ZeRO hand the optimizer 1-D flat buffers; their matrices'
    shapes are gone, so Muon cannot orthogonalize them, and routing them to AdamW would silently
    train the model without Muon.
    """
    if getattr(p, "_is_flat_param", False):
        return ("an FSDP1 FlatParameter (use FSDP2 fully_shard, e.g. muonlab.distributed.apply_fsdp, or FSDP1 "
                "with use_orig_params=True)")
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
    view: str = ""
    """How Muon reads the tensor as matrices (muonlab.comm.specs.VIEWS); empty for AdamW."""
    guessed: bool = False
    """A matrix sent to AdamW by a guess of its role (a head, a raw table): named in the warning."""


class ParamGroups(list):
    """A list of parameter-group dicts (no names inside) that also knows where each name went.

    ``Muon`` reads ``names`` for its error messages and diagnostics and ``views`` for how each
    Muon parameter reads as matrices; ``table()`` is for notebooks.
    """

    def __init__(self, groups: list[dict], routes: list[Route], names: dict[torch.Tensor, str],
                 fused_banks: dict[str, int] | None = None):
        super().__init__(groups)
        self.routes = routes
        self.names = names
        self.fused_banks = dict(fused_banks or {})
        """{name: blocks} of the Muon matrices orthogonalized as blocks of rows (``split_heads``);
        ``Muon`` reads it as its ``fused_banks`` (which override it name by name)."""

    @property
    def views(self) -> dict[str, str]:
        """{name: matrix view} of every Muon parameter."""
        return {r.name: r.view for r in self.routes if r.algorithm == "muon"}

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


def is_transformers_conv1d(module: nn.Module) -> bool:
    """transformers.pytorch_utils.Conv1D (GPT-2's layers): a Linear whose weight is stored (in, out).

    Recognised by class name and its (nx, nf) layout, so transformers need not be installed.
    """
    if not any(cls.__name__ == "Conv1D" for cls in type(module).__mro__):
        return False
    weight = getattr(module, "weight", None)
    nx, nf = getattr(module, "nx", None), getattr(module, "nf", None)
    return isinstance(weight, torch.Tensor) and tuple(weight.shape) == (nx, nf)


def _is_matrix_layer(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_transformers_conv1d(module)


def _holds_layers(module: nn.Module) -> bool:
    """``module`` has a child module with parameters (it is more than one layer)."""
    return any(True for child in module.children() for _ in child.parameters())


def _reads_out_features(model: nn.Module) -> bool:
    """The model has the structure under which its last Linear is an output head (rule 2): an
    embedding, a convolution or a list of blocks. A plain MLP or a lone Linear has none."""
    return any(isinstance(m, (*EMBEDDINGS, nn.modules.conv._ConvNd))
               or (isinstance(m, nn.ModuleList) and any(_holds_layers(item) for item in m))
               for m in model.modules())


def _heads(model: nn.Module) -> dict[nn.Module, tuple[str, bool]]:
    """The output head(s) (rule 2), each with its reason and whether it is a guess."""
    if not _reads_out_features(model):
        return {}
    embeddings = [m.weight.shape for m in model.modules() if isinstance(m, EMBEDDINGS)]
    # repeated blocks: ModuleLists, except a list of bare Linear/Conv1D layers all of one
    # non-square shape, which no stack of layers can be (each would feed the next): parallel
    # layers, such as one head per codebook, read as layers outside blocks
    layer_lists = {name + "." for name, m in model.named_modules() if _parallel_layers(m)}
    repeated = [name + "." for name, m in model.named_modules() if isinstance(m, nn.ModuleList)
                and name + "." not in layer_lists]
    outside = [(name, m) for name, m in model.named_modules()
               if _is_matrix_layer(m) and not any(name.startswith(prefix) for prefix in repeated)]
    # Earlier Linears can match an embedding's shape by accident in small models (an MLP of
    # width == vocab), so only the last one counts; a block's layers never do (BERT-tiny's
    # intermediate layer is (512, 128), as its position table).
    shaped = [m for _, m in outside if isinstance(m, nn.Linear) and m.weight.shape in embeddings]
    heads = {}
    if outside:
        last_name, last = outside[-1]
        heads[last] = ("output head (last Linear/Conv1D outside repeated blocks)", True)
        home = last_name.rpartition(".")[0] + "."
        if home in layer_lists:  # the other layers of that list are heads too
            for name, m in outside[:-1]:
                if name.rpartition(".")[0] + "." == home:
                    heads[m] = ("output head (one of parallel heads, as the last one)", True)
    if shaped:
        # the last layer, shaped like an embedding, is the vocabulary projection: no guess
        heads[shaped[-1]] = ("output head (last Linear shaped like an embedding)", shaped[-1] is not outside[-1][1])
    return heads


def _parallel_layers(module: nn.Module) -> bool:
    """A ModuleList of bare Linear/Conv1D layers whose weights share one non-square shape."""
    if not isinstance(module, nn.ModuleList) or not len(module) or not all(_is_matrix_layer(m) for m in module):
        return False
    shapes = {tuple(m.weight.shape) for m in module}
    return len(shapes) == 1 and len(set(next(iter(shapes)))) == 2


def _view(module: nn.Module, p: torch.Tensor) -> str:
    """How the module's own layout reads ``p`` as matrices (rule 3, 4 and 5's views)."""
    if is_transformers_conv1d(module) and p is module.weight:
        return "transpose"
    if isinstance(module, nn.modules.conv._ConvNd):
        return "flatten"
    return "matrix" if p.ndim == 2 else "bank"


def _describe(view: str, shape: tuple[int, ...]) -> str:
    if view == "transpose":
        return "hidden matrix stored (in, out): lr ratio from (out, in)"
    if view == "flatten":
        return f"read as one ({shape[0]}, {math.prod(shape[1:])}) matrix"
    if view == "bank":
        return f"bank of {math.prod(shape[:-2])} matrices"
    return "hidden matrix"


def _global_shape(p: torch.Tensor) -> tuple[int, ...]:
    """``p``'s shape in the whole model: an expert bank of apply_ep holds this rank's E/ep experts,
    one of them where E == ep, and a (1, out, in) bank must not read as a size-1 table."""
    shape = tuple(p.shape)
    if getattr(p, "_ep_size", 1) > 1:
        return (shape[0] * p._ep_size, *shape[1:])
    return shape


def _words(name: str) -> set[str]:
    """Lower-case words of a name: "pos_embed" -> {"pos", "embed"}, "clsToken" -> {"cls", "token"}."""
    return {w.lower() for w in re.findall(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|\d+", name)}


def _raw_role(full_name: str) -> tuple[str, str] | None:
    """(role, word) when the parameter's own name or its module's name says its role (rule 5b)."""
    *_, module_name, name = ["", *full_name.split(".")]
    for candidate in (name, module_name):
        if candidate.lower() in RAW_ROUTER_NAMES:
            return "a router", candidate
    own, module_words = _words(name), _words(module_name)
    for word in RAW_TABLE_WORDS:
        if word in own or word in module_words:
            return "an embedding or position table", word
    for word in RAW_TOKEN_WORDS:
        if word in own:
            return "learned tokens or queries", word
    return None


def _by_module(module: nn.Module, p: torch.Tensor, full_name: str, conv: str) -> tuple[str, str, bool]:
    """Rules 3 to 5: the module's type decides, or for raw parameters the tensor's (global) shape,
    its name and its place. (algorithm, reason, guessed)."""
    view, shape = _view(module, p), _global_shape(p)
    if p.ndim == 3 and any(getattr(module, name, None) is p for name in getattr(module, "expert_banks", ())):
        return "muon", _describe(view, shape), False  # a declared expert bank, one expert's included
    if isinstance(module, nn.Linear) or is_transformers_conv1d(module) or (
            isinstance(module, nn.MultiheadAttention) and p.ndim == 2):
        if 1 in shape:  # Muon would reduce it to its normalised gradient
            return "adamw", "one-row or one-column layer (a scalar gate or a single output)", False
        return "muon", _describe(view, shape), False
    if isinstance(module, nn.modules.conv._ConvNd):
        if conv == "muon":
            return "muon", f"convolution kernel {_describe(view, shape)}", False
        return "adamw", "convolution kernel (conv='muon' sends it to Muon)", False
    if 1 in shape[-2:]:
        return "adamw", "raw parameter with a dim of size 1 (a token or position table)", False
    if math.prod(shape[:-2]) == 1:  # one matrix, 2-D or (1, ..., 1, m, n): a bank of several is a bank
        role = _raw_role(full_name)
        if role:
            return "adamw", f"raw parameter named as {role[0]} ({role[1]!r}; include= sends it to Muon)", True
        if p.ndim == 2 and _holds_layers(module):
            return "adamw", ("raw matrix held next to layers (a table, learned queries or a state matrix, no "
                             "layer's weight; include= sends it to Muon)"), True
    if p.ndim == 2:
        return "muon", "raw weight matrix of a layer (its module holds no other layers)", False
    return "muon", _describe(view, shape), False


def _route(module: nn.Module, p: torch.Tensor, full_name: str, ctx: dict) -> tuple[str, str, bool]:
    """(algorithm, reason, guessed) for one parameter: the rules of the module docstring, in order."""
    for pattern in ctx["exclude"]:
        if fnmatch.fnmatchcase(full_name, pattern):
            return "adamw", f"excluded by pattern {pattern!r}", False
    for pattern in ctx["include"]:
        if fnmatch.fnmatchcase(full_name, pattern):
            if p.ndim < 2:
                raise ValueError(f"include pattern {pattern!r} matches '{full_name}' of shape {tuple(p.shape)}, "
                                 "which has fewer than 2 dims: Muon needs matrices")
            return "muon", f"included by pattern {pattern!r}, {_describe(_view(module, p), tuple(p.shape))}", False
    if p.ndim < 2:
        return "adamw", "1-D (norm scale or bias)", False
    if p.numel() == 0:  # Muon refuses it: nothing to orthogonalize
        return "adamw", "empty (a zero-width layer)", False
    if isinstance(module, EMBEDDINGS):
        return "adamw", "embedding table", False
    if any(p is e for e in ctx["embeddings"]):
        return "adamw", "tied to an embedding", False
    if module in ctx["heads"]:
        return "adamw", *ctx["heads"][module]
    return _by_module(module, p, full_name, ctx["conv"])


def _name_patterns(names: list[str], all_names: list[str]) -> dict[str, list[str]]:
    """{pattern: names}: names that differ only in their numeric parts (one per layer or block)
    as one pattern with ``*`` for those parts, where it matches no other parameter."""
    by_pattern: dict[str, list[str]] = {}
    for name in names:
        by_pattern.setdefault(".".join("*" if part.isdigit() else part for part in name.split(".")), []).append(name)
    out = {}
    for pattern, members in by_pattern.items():
        if len(members) > 1 and all(n in members for n in all_names if fnmatch.fnmatchcase(n, pattern)):
            out[pattern] = members
        else:
            out.update({n: [n] for n in members})
    return out


def _guess_warning(routes: list[Route]) -> str:
    """The one warning of a call: the matrices rules 2 and 5b-c sent to AdamW, by reason."""
    guessed = [r for r in routes if r.guessed]
    shapes = {r.name: r.shape for r in guessed}
    lines, patterns = [], []
    for reason in dict.fromkeys(r.reason for r in guessed):
        names = [r.name for r in guessed if r.reason == reason]
        listed = []
        for pattern, members in _name_patterns(names, [r.name for r in routes]).items():
            patterns.append(pattern)
            member_shapes = {shapes[n] for n in members}
            shape = next(iter(member_shapes)) if len(member_shapes) == 1 else "various shapes"
            listed.append(f"{pattern!r} {shape}" if len(members) == 1 else f"{pattern!r} ({len(members)} of {shape})")
        lines.append(f"  {reason}: {', '.join(listed)}")
    return ("muon_param_groups sent these matrices to AdamW by a guess of their role (not by their type, a tie "
            "to an embedding or your choice):\n" + "\n".join(lines) + "\n"
            f"To decide yourself, and silence this warning: include={patterns!r} sends them to Muon, "
            f"exclude={patterns!r} keeps them on AdamW (fnmatch patterns; ParamGroups.table() shows every "
            "decision).")


def _patterns(option: str, patterns) -> tuple[str, ...]:
    if patterns is None:
        return ()
    if isinstance(patterns, str):
        patterns = (patterns,)
    try:
        patterns = tuple(patterns)
    except TypeError:
        raise TypeError(f"{option} must be a pattern (str) or a list of patterns, got "
                        f"{type(patterns).__name__} {patterns!r}") from None
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise TypeError(f"{option} patterns must be strings, got {type(pattern).__name__} {pattern!r}")
    return patterns


def _check_patterns(exclude: tuple[str, ...], include: tuple[str, ...], names: list[str]) -> None:
    """Every pattern must match a parameter, and none both ways: a typo must not pass silently."""
    for option, patterns in (("exclude", exclude), ("include", include)):
        for pattern in patterns:
            if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
                raise ValueError(f"{option} pattern {pattern!r} matches no trainable parameter "
                                 f"(names look like {names[:3]})")
    for name in names:
        ex = [p for p in exclude if fnmatch.fnmatchcase(name, p)]
        inc = [p for p in include if fnmatch.fnmatchcase(name, p)]
        if ex and inc:
            raise ValueError(f"parameter '{name}' matches both exclude pattern {ex[0]!r} and include "
                             f"pattern {inc[0]!r}")


def _owned_parameters(model: nn.Module) -> list[tuple[str, nn.Module, torch.Tensor]]:
    """(full name, owning module, parameter) of each trainable parameter, tied ones once."""
    out, seen = [], set()
    for mod_name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in seen or not p.requires_grad:
                continue  # tied weights are routed once, by their first owner
            seen.add(id(p))
            full = f"{mod_name}.{pname}" if mod_name else pname
            check_not_flat(p, full)
            out.append((full, module, p))
    return out


def muon_param_groups(
    model: nn.Module,
    *,
    adamw_lr: float | None = None,
    exclude: Sequence[str] = (),
    include: Sequence[str] = (),
    conv: str = "adamw",
    split_heads: bool | str = False,
) -> ParamGroups:
    """Split ``model``'s trainable parameters into a Muon group and an AdamW group (the rules
    are in this module's docstring; ``.table()`` shows each decision and why). Matrices sent to
    AdamW by a guess of their role are named in one ``RoutingWarning``.

    Args:
        model: any nn.Module.
        adamw_lr: lr of the AdamW group (default: Muon's ``adamw_lr``).
        exclude: fnmatch patterns on parameter names forced to AdamW (e.g. ``"*.router.*"``).
        include: fnmatch patterns on parameter names (2+ dims) forced to Muon (e.g. a raw router).
        conv: "adamw" (default) or "muon": where convolution kernels go; in Muon each kernel
            (out, in, *k) is orthogonalized as one (out, in * prod(k)) matrix.
        split_heads: False (default), True or "heads": orthogonalize the attention input
            projections head by head; "qkv": a fused QKV as its three matrices. Which matrices and
            how many blocks: ``muonlab.optim.heads.attention_blocks`` (the output projection stays
            whole); the groups carry it to ``Muon`` as ``fused_banks`` and ``.table()`` names the
            blocks. A model with no attention it recognises is refused (declare yours with
            ``Muon(fused_banks=...)``).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"muon_param_groups needs the model (an nn.Module), got {type(model).__name__}: it "
                        "routes each parameter by the module that holds it and by its name")
    if conv not in CONV_ROUTES:
        raise ValueError(f"conv must be one of {CONV_ROUTES}, got {conv!r}")
    exclude, include = _patterns("exclude", exclude), _patterns("include", include)
    params = _owned_parameters(model)
    _check_patterns(exclude, include, [name for name, _, _ in params])
    blocks = _split_heads(model, split_heads)
    ctx = dict(exclude=exclude, include=include, conv=conv, heads=_heads(model),
               embeddings=[m.weight for m in model.modules() if isinstance(m, EMBEDDINGS)])
    routes, names = [], {}
    buckets: dict[str, list[torch.Tensor]] = {"muon": [], "adamw": []}
    for full, module, p in params:
        algorithm, reason, guessed = _route(module, p, full, ctx)
        buckets[algorithm].append(p)
        names[p] = full
        view = _view(module, p) if algorithm == "muon" else ""
        if algorithm == "muon" and blocks.get(full, 1) > 1:
            reason += f", in {blocks[full]} blocks of ({p.shape[0] // blocks[full]}, {p.shape[1]}) (split_heads)"
        routes.append(Route(full, tuple(p.shape), algorithm, reason, view, guessed))
    if any(r.guessed for r in routes):
        warnings.warn(_guess_warning(routes), RoutingWarning, stacklevel=2)
    groups = []
    if buckets["muon"]:
        groups.append({"params": buckets["muon"], "algorithm": "muon"})
    if buckets["adamw"]:
        adamw = {"params": buckets["adamw"], "algorithm": "adamw"}
        if adamw_lr is not None:
            adamw["lr"] = adamw_lr
        groups.append(adamw)
    muon = {r.name for r in routes if r.algorithm == "muon"}
    return ParamGroups(groups, routes, names, {n: k for n, k in blocks.items() if n in muon and k > 1})


def _split_heads(model: nn.Module, split_heads) -> dict[str, int]:
    """{name: blocks} that ``split_heads`` declares (see ``muon_param_groups``)."""
    if split_heads is False or split_heads is None:
        return {}
    if split_heads is not True and split_heads not in SPLITS:
        raise ValueError(f"split_heads must be False, True or one of {SPLITS}, got {split_heads!r}")
    blocks = attention_blocks(model, "heads" if split_heads is True else split_heads)
    if not blocks and not attention_blocks(model, "heads"):  # (a model whose q, k, v are apart has no "qkv" to split)
        raise ValueError(f"split_heads={split_heads!r}: no attention projection found in {type(model).__name__} "
                         "(recognised: muonlab's GPT, nn.MultiheadAttention, q_proj/k_proj/v_proj with a head_dim); "
                         "declare the blocks with Muon(fused_banks={name: blocks})")
    return blocks
