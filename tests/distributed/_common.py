"""Helpers shared by the distributed test workers (and the tests that check their results).

Everything here is deterministic given its arguments: the models come from a seed, the token
batches from a generator of their own (the global RNG is left alone), so every rank and the
single-process reference in the parent build the same things. The model sizes and rows per rank
that several suites share are here; each worker module keeps its own seeds, steps and
hyper-parameters and passes them in.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from muonlab.models import GPT, GPTConfig
from muonlab.models.gpt import moe_config

SMALL_GPT = dict(d_model=24, n_layers=2, n_heads=2, context=16)
"""The dense GPT of the Muon and checkpoint tests."""
SMALL_MOE = dict(d_model=16, n_layers=1, n_heads=2, context=8)
"""The MoE GPT of the expert-parallel, Muon-on-EP and checkpoint tests (experts chosen per case)."""
BATCH_PER_RANK = 2
"""Rows of the global batch each rank trains on."""
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# ---------------------------------------------------------------------------------- ranks


def world_rank() -> tuple[int, int]:
    """(world size, rank); (1, 0) outside a process group."""
    if dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def group_rank(b, rank: int) -> int:
    """``rank``'s index in a plan batch's group: GroupKey.local_ranks maps global -> group-local."""
    return b.group.local_ranks()[rank] if b.group is not None else 0


# ---------------------------------------------------------------------------------- tensors


def full(t: torch.Tensor) -> torch.Tensor:
    """A detached copy of ``t`` in full: a DTensor gathered, a plain tensor as it is."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def full_ep(t: torch.Tensor, p, ep_group) -> torch.Tensor:
    """:func:`full` of ``t`` (``p`` itself or its gradient); where ``p`` is an expert bank of
    ``apply_ep``, which holds this EP rank's experts only, the EP ranks' consecutive blocks are
    gathered over ``ep_group`` back into the global (E, ...) bank."""
    t = full(t)
    if not hasattr(p, "_ep_rank"):
        return t
    out = t.new_empty((p._ep_size * t.shape[0], *t.shape[1:]))
    dist.all_gather_single(out, t.contiguous(), group=ep_group)
    return out


def cloned(named: Iterable) -> dict[str, torch.Tensor]:
    """{name: detached copy} of (name, tensor) pairs, e.g. ``model.named_parameters()``."""
    return {n: p.detach().clone() for n, p in named}


def rel_displacement(got: dict, ref: dict, start: dict) -> float:
    """||(got - start) - (ref - start)|| / ||ref - start|| over all parameters together."""
    num = sum(((got[n] - ref[n]).double() ** 2).sum() for n in ref)
    den = sum(((ref[n] - start[n]).double() ** 2).sum() for n in ref)
    return float((num / den).sqrt())


# ---------------------------------------------------------------------------------- batches


def token_batches(seed: int, world: int, width: int, steps: int = 1) -> list[torch.Tensor]:
    """``steps`` global batches of random byte tokens, (world * BATCH_PER_RANK, width) each, drawn
    in turn from one generator seeded ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (world * BATCH_PER_RANK, width), generator=gen) for _ in range(steps)]


def rank_rows(t: torch.Tensor, rank: int | None = None) -> torch.Tensor:
    """This rank's (or ``rank``'s) BATCH_PER_RANK rows of a global batch."""
    rank = world_rank()[1] if rank is None else rank
    return t[rank * BATCH_PER_RANK:(rank + 1) * BATCH_PER_RANK]


def shifted(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of a batch of sequences one token longer than the context."""
    return t[:, :-1], t[:, 1:]


# ---------------------------------------------------------------------------------- models


def build_gpt(seed: int = 0, **cfg) -> GPT:
    """The dense GPT of GPTConfig(**cfg), initialised from ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    return GPT(GPTConfig(**cfg))


def build_moe_gpt(num_experts: int, seed: int = 0, **cfg) -> GPT:
    """The MoE GPT of moe_config(num_experts, **cfg), initialised from ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    return GPT(moe_config(num_experts=num_experts, **cfg))


# ---------------------------------------------------------------------------------- training


def train_steps(model, opt, batches: Iterable) -> None:
    """One optimizer step per (inputs, targets) in ``batches``: loss, backward, step, zero_grad."""
    for x, y in batches:
        model(x, y).backward()
        opt.step()
        opt.zero_grad()


def single_process(model, opt, batches: Iterable) -> dict[str, torch.Tensor]:
    """The reference run: one process, whole global batches; the parameters after training."""
    train_steps(model, opt, batches)
    return cloned(model.named_parameters())


def nonzero(by_path: dict) -> dict:
    """{path: bytes} without the paths that moved nothing (a collective counted with 0 bytes)."""
    return {path: n for path, n in by_path.items() if n}


def running(pid: int) -> bool:
    """The process exists and is not a zombie (an orphan's zombie waits for init to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
