"""Worker for the per-head Newton-Schulz test: muonlab's GPT with its QKV declared per head
(``split_heads``) on FSDP2 and DDP, and fused banks of explicit DTensors whose shards cut blocks
and leave a trailing rank empty. Importable by spawned children; the parent runs the single
process the same way.

The GPT has 3 heads of 8 over 24 features: its (72, 24) QKV holds 9 blocks of 8 rows, which
shards of 36 (2 ranks) or 18 rows (4 ranks) cut; with ``split_heads="qkv"`` 3 blocks of 24 rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from muonlab import Muon, muon_param_groups
from muonlab.comm.records import bytes_for_rank

from ._common import build_gpt, full, rank_rows, single_process, token_batches, train_steps

GPT_CFG = dict(d_model=24, n_layers=2, n_heads=3, context=8)
HYPER = dict(lr=0.05, weight_decay=0.01, momentum=0.9, ns_dtype=torch.float32)
STEPS = 3
CASES = [("fsdp", "heads"), ("fsdp", "qkv"), ("ddp", "heads"), ("fsdp", "heads", 1), ("fsdp", "heads", None, "normuon")]
"""(mode, split[, workspace_bytes[, update_rule]]): a budget of 1 byte puts each QKV in a batch of
its own; NorMuon normalises each head's rows, its norms summed over the ranks holding the head."""
BANKS = [("ten", (10, 6), 5), ("six", (6, 8), 2), ("tall", (12, 4), 3)]
"""(name, shape, blocks): on 4 ranks rows 3,3,3,1 (blocks of 2 cut at rows 3 and 9), 2,2,2,0 (an
empty last shard; both blocks of 3 cut) and 3,3,3,3 (blocks of 4 cut); on 2 ranks 5,5 (cut), 3,3
(whole) and 6,6 (cut)."""


def gpt_batches(world: int):
    return [(x, x) for x in token_batches(7, world, GPT_CFG["context"], STEPS)]


def single_process_gpt(world: int, split: str, update_rule: str = "muon") -> dict[str, torch.Tensor]:
    model = build_gpt(**GPT_CFG)
    opt = Muon(muon_param_groups(model, split_heads=split), update_rule=update_rule, **HYPER)
    return single_process(model, opt, gpt_batches(world))


def _record(opt, params) -> dict:
    stats = opt.last_step_stats()
    sent, recv = bytes_for_rank(opt.plan(), dist.get_rank())
    return dict(params={n: full(p) for n, p in params}, sent=stats["bytes_sent"], recv=stats["bytes_recv"],
                plan_sent=sent, plan_recv=recv, plan=opt.plan(), choices=opt.resolved_choices())


def _gpt(mode: str, split: str, workspace_bytes: int | None = None, update_rule: str = "muon") -> dict:
    from muonlab.distributed import parallelize

    model, inner, _ = parallelize(build_gpt(**GPT_CFG), mode)
    opt = Muon(muon_param_groups(inner, split_heads=split), comm_dtype=torch.float32,
               workspace_bytes=workspace_bytes, update_rule=update_rule, **HYPER)
    train_steps(model, opt, [(rank_rows(x), rank_rows(y)) for x, y in gpt_batches(dist.get_world_size())])
    return _record(opt, inner.named_parameters())


def bank_grads(shape, seed: int, step: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 * seed + step))


def banks(layout: str | None) -> list[tuple[str, torch.nn.Parameter]]:
    """BANKS as parameters: row-sharded DTensors over every rank (layout "fsdp"), else whole."""
    from torch.distributed.tensor import Shard, distribute_tensor

    out = []
    for seed, (name, shape, _) in enumerate(BANKS):
        whole = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
        if layout == "fsdp":
            from muonlab.distributed import build_mesh

            whole = distribute_tensor(whole, build_mesh(), [Shard(0)])
        out.append((name, torch.nn.Parameter(whole)))
    return out


def train_banks(layout: str | None):
    from torch.distributed.tensor import distribute_tensor

    params = banks(layout)
    opt = Muon(params, fused_banks={n: k for n, _, k in BANKS}, comm_dtype=torch.float32, **HYPER)
    for step in range(STEPS):
        for seed, (_, p) in enumerate(params):
            g = bank_grads(p.shape, seed, step)
            p.grad = g if layout is None else distribute_tensor(g, p.device_mesh, p.placements)
        opt.step()
    return opt, params


def everything() -> dict:
    """Every case in one launch: start-up is the slow part."""
    out = {case: _gpt(*case) for case in CASES}
    out["banks"] = _record(*train_banks("fsdp"))
    return out
