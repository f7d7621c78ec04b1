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


# ---------------------------------------------------------------- uneven shards

UNEVEN = [("a", (5, 6)), ("c", (3, 8)), ("b", (6, 6)), ("d", (4, 8)), ("e", (8, 3))]
"""Row-sharded on 2 ranks: 3+2, 2+1, 3+3, 2+2, 4+4 rows, so rank 0's rows of a and b (and of c and d)
have one local shape while rank 1's differ: stacked by local shape, the ranks would pack their
reductions in different orders (a, b, c, d against a, c, b, d)."""


def _uneven_train(params, shard=None) -> list[dict]:
    opt = Muon(params, lr=0.02, ns_dtype=torch.float32, comm_dtype=torch.float32)
    rec = SpectralRecorder(opt, params, every=1)
    for step in range(3):
        for seed, (_, p) in enumerate(params):
            g = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * seed + step))
            p.grad = g if shard is None else shard(g)
        opt.step()
    gathered = gather_spectral(rec.records)
    return None if gathered is None else [asdict(r) for r in gathered]


def _uneven_tensor(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def uneven_reference() -> list[dict]:
    return _uneven_train([(n, torch.nn.Parameter(_uneven_tensor(s, i))) for i, (n, s) in enumerate(UNEVEN)])


def uneven_run() -> list[dict] | None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    params = [(n, torch.nn.Parameter(distribute_tensor(_uneven_tensor(s, i), mesh, [Shard(0)])))
              for i, (n, s) in enumerate(UNEVEN)]
    return _uneven_train(params, shard=lambda g: distribute_tensor(g, mesh, [Shard(0)]))


def all_runs(cases) -> dict:
    """The GPT cases and the uneven shards in one launch (process start-up is the slow part)."""
    out = spectral_runs(cases)
    out["uneven"] = uneven_run()
    return out
