"""Worker for tests/distributed/test_spectral_distributed.py (importable by spawned children).

``spectral_runs`` trains the small GPT under FSDP2 and DDP with muonlab's Muon or torch's AdamW,
records spectral metrics and returns every rank's records gathered on rank 0; ``reference``
computes the same records in one process on the whole global batches.
"""

from __future__ import annotations

from dataclasses import asdict

import torch
import torch.distributed as dist

from muonlab import Muon, muon_param_groups
from muonlab.trace import SpectralRecorder, gather_spectral

from ._common import SMALL_GPT, build_gpt, rank_rows, token_batches, train_steps

GPT_CFG = SMALL_GPT
STEPS = 6
EVERY = 2


def make_optimizer(name: str, model):
    if name == "muon":  # fp32 throughout, so ranks and the single process agree to rounding
        return Muon(muon_param_groups(model, adamw_lr=3e-3), lr=0.02, weight_decay=0.01, ns_dtype=torch.float32,
                    comm_dtype=torch.float32)
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)


def batches(world: int):
    return token_batches(11, world, GPT_CFG["context"], STEPS)


def reference(world: int, opt_name: str) -> list[dict]:
    """One process, whole global batches."""
    model = build_gpt(**GPT_CFG)
    opt = make_optimizer(opt_name, model)
    rec = SpectralRecorder(opt, model, every=EVERY)
    train_steps(model, opt, [(x, x) for x in batches(world)])
    return [asdict(r) for r in gather_spectral(rec.records)]


def spectral_runs(cases) -> dict:
    """{(mode, optimizer): records gathered on rank 0 (None on other ranks)} for each case."""
    from muonlab.distributed import parallelize

    world = dist.get_world_size()
    out = {}
    for mode, opt_name in cases:
        model, inner, _ = parallelize(build_gpt(**GPT_CFG), mode)
        opt = make_optimizer(opt_name, inner)
        rec = SpectralRecorder(opt, inner, every=EVERY)
        train_steps(model, opt, [(rank_rows(x), rank_rows(x)) for x in batches(world)])
        gathered = gather_spectral(rec.records)
        out[(mode, opt_name)] = None if gathered is None else [asdict(r) for r in gathered]
    return out
