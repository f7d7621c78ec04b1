"""Worker for tests/distributed/test_spectral_distributed.py (importable by spawned children).

``spectral_runs`` trains the small GPT under FSDP2 and DDP with muonlab's Muon (its planner or
strategy "redundant") or torch's AdamW, records spectral metrics and returns every rank's records
gathered on rank 0; ``reference`` computes the same records in one process on the whole global
batches. ``uneven_run``, ``wide_run`` and ``moved_owner_run`` check row shards of uneven sizes, the
bytes a wide row-sharded matrix costs, and a replica whose recording rank changes.
"""

from __future__ import annotations

from dataclasses import asdict

import torch
import torch.distributed as dist

from muonlab import Muon, muon_param_groups
from muonlab.trace import SpectralRecorder, exact_top_singular_value, gather_spectral

from ._common import SMALL_GPT, build_gpt, rank_rows, token_batches, train_steps

GPT_CFG = SMALL_GPT
STEPS = 6
EVERY = 2


def make_optimizer(name: str, model):
    if name.startswith("muon"):  # fp32 throughout, so ranks and the single process agree to rounding
        # "muon-redundant": every rank orthogonalizes every matrix, no owner to record it
        return Muon(muon_param_groups(model, adamw_lr=3e-3), lr=0.02, weight_decay=0.01, ns_dtype=torch.float32,
                    comm_dtype=torch.float32, strategy="redundant" if name == "muon-redundant" else "muonlab")
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


# ---------------------------------------------------------------- a wide row-sharded matrix

WIDE = (32, 1024)
"""Wide (m << n): the Gram of the smaller side is 32 x 32; the n x n one, packed in fp64, was 64 times
the matrix's bytes."""


def _wide_train(p, shard=None, count=lambda step, fn: fn()) -> list[dict] | None:
    """Two steps of Muon on ``p``, the second recorded; ``count(step, opt.step)`` takes each step."""
    opt = Muon([("w", p)], lr=0.02, ns_dtype=torch.float32, comm_dtype=torch.float32)
    rec = SpectralRecorder(opt, [("w", p)], every=2)
    for step in range(2):
        g = torch.randn(WIDE, generator=torch.Generator().manual_seed(step))
        p.grad = g if shard is None else shard(g)
        count(step, opt.step)
    gathered = gather_spectral(rec.records)
    return None if gathered is None else [asdict(r) for r in gathered]


def wide_reference() -> list[dict]:
    return _wide_train(torch.nn.Parameter(_uneven_tensor(WIDE, 0)))


def wide_run() -> dict:
    """The records, and the bytes this rank handed to all-reduces and all-gathers in each step
    (counted at the call; the real collective runs): the second step records, the first doesn't."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    p = torch.nn.Parameter(distribute_tensor(_uneven_tensor(WIDE, 0), mesh, [Shard(0)]))
    sent = [0, 0]

    def count(step, fn):
        real = {name: getattr(dist, name) for name in ("all_reduce", "all_gather_into_tensor")}

        def counted(name):
            def call(t, *args, **kwargs):
                sent[step] += t.numel() * t.element_size()
                return real[name](t, *args, **kwargs)
            return call

        for name in real:
            setattr(dist, name, counted(name))
        try:
            fn()
        finally:
            for name, f in real.items():
                setattr(dist, name, f)

    records = _wide_train(p, shard=lambda g: distribute_tensor(g, mesh, [Shard(0)]), count=count)
    return dict(records=records, bytes=sent)


# ---------------------------------------------------------------- a replica whose recording rank moves


def moved_owner_run() -> dict | None:
    """DDP-like replicas with muonlab's Muon (owners). '1.weight' has no gradient at the first
    recorded step, so rank position % world records it; at the next its Newton-Schulz owner does,
    a rank that never measured it: it must start cold. The records and the exact sigma_max after."""
    torch.manual_seed(0)  # the same replica on every rank
    model = torch.nn.Sequential(torch.nn.Linear(32, 64, bias=False), torch.nn.Linear(64, 64, bias=False),
                                torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 8, bias=False))
    opt = Muon(muon_param_groups(model), lr=0.02, ns_dtype=torch.float32, comm_dtype=torch.float32)
    rec = SpectralRecorder(opt, model, every=1)
    params = dict(model.named_parameters())
    for step in range(2):
        for i, (n, p) in enumerate(params.items()):  # identical on every rank, as after DDP's all-reduce
            frozen = step == 0 and n == "1.weight"
            p.grad = None if frozen else torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * step + i))
        opt.step()
    gathered = gather_spectral(rec.records)
    exact = float(exact_top_singular_value(params["1.weight"].detach()))
    return None if gathered is None else dict(records=[asdict(r) for r in gathered], exact=exact)


def all_runs(cases) -> dict:
    """The GPT cases and the other checks in one launch (process start-up is the slow part)."""
    out = spectral_runs(cases)
    out["uneven"] = uneven_run()
    out["wide"] = wide_run()
    out["moved"] = moved_owner_run()
    return out
