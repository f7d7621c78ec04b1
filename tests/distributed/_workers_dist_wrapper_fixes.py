"""Worker for tests/distributed/test_dist_wrapper_fixes.py (importable by spawned children).

``wrapper_checks`` runs, in one process group (start-up costs seconds), every case of the audit of
the distributed wrappers: wrappers applied twice or over one another, a MoE shared by two blocks,
parallelize's refusals (and that they come before the model moves), mesh sizes as numpy ints or
None, and the collective timeout of mesh sub-groups. It returns plain data; the parent asserts.
"""

from __future__ import annotations

import importlib
import warnings

import numpy as np
import torch
import torch.distributed as dist

from muonlab.distributed import apply_ep, apply_fsdp, build_ep_mesh, build_mesh, parallelize
from muonlab.models.gpt import MoE
from tests.distributed._common import SMALL_MOE, build_gpt, build_moe_gpt, full

NUM_EXPERTS = 4
# the module, not the function muonlab.distributed re-exports under the same name
parallelize_module = importlib.import_module("muonlab.distributed.parallelize")


def _error(fn, *args, **kwargs) -> str | None:
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the parent checks the type and the words
        return f"{type(e).__name__}: {e}"
    return None


def _moe(model) -> MoE:
    return next(m for m in model.modules() if isinstance(m, MoE))


def _banks(moe: MoE) -> dict:
    """The bank objects and a copy of their local values, to tell whether a refused call changed them."""
    return {name: (getattr(moe, name), full(getattr(moe, name))) for name in ("w_in", "w_out")}


def _unchanged(moe: MoE, before: dict) -> bool:
    return all(getattr(moe, n) is obj and torch.equal(full(getattr(moe, n)), vals) for n, (obj, vals) in before.items())


def _refused_twice() -> dict:
    """apply_ep on a model that apply_ep, parallelize("fsdp") or apply_fsdp (root only) already holds."""
    out = {}
    mesh = build_ep_mesh(2)
    cases = {
        "ep_twice": lambda: apply_ep(build_moe_gpt(NUM_EXPERTS, **SMALL_MOE), mesh),
        "ep_after_fsdp": lambda: parallelize(build_moe_gpt(NUM_EXPERTS, **SMALL_MOE), "fsdp").model,
        "ep_after_root_fsdp": lambda: apply_fsdp(build_moe_gpt(NUM_EXPERTS, **SMALL_MOE), build_mesh(),
                                                 block_attr=None),
    }
    for label, make in cases.items():
        model = make()
        moe = _moe(model)
        before, dispatcher = _banks(moe), moe.dispatcher
        out[label] = dict(err=_error(apply_ep, model, mesh),
                          unchanged=_unchanged(moe, before) and moe.dispatcher is dispatcher)
    # parallelize over a model a wrapper already holds: refused, not nested
    ddp = parallelize(build_gpt(**SMALL_MOE), "ddp").model
    fsdp = parallelize(build_gpt(**SMALL_MOE), "fsdp").model
    out["ddp_twice"] = _error(parallelize, ddp, "ddp")
    out["ddp_over_fsdp"] = _error(parallelize, fsdp, "ddp")
    out["fsdp_over_ddp"] = _error(parallelize, ddp, "fsdp")
    return out


def _shared_moe() -> dict:
    """A MoE module used by both blocks: apply_ep slices its banks once, and the loss of each rank's
    batch is the single-process loss of that batch."""
    torch.manual_seed(0)
    cfg = dict(SMALL_MOE, n_layers=2)
    reference = build_moe_gpt(NUM_EXPERTS, **cfg)
    reference.blocks[1].mlp = reference.blocks[0].mlp
    model = build_moe_gpt(NUM_EXPERTS, **cfg)
    model.blocks[1].mlp = model.blocks[0].mlp
    full_w_in = model.blocks[0].mlp.w_in.detach().clone()
    rank = dist.get_rank()
    x = torch.randint(0, 256, (2, cfg["context"] + 1), generator=torch.Generator().manual_seed(10 + rank))
    out = dict(err=None)
    try:
        apply_ep(model, build_ep_mesh(2))
        local = model.blocks[0].mlp.w_in
        local = (local.to_local() if hasattr(local, "to_local") else local).detach()
        num_local = NUM_EXPERTS // 2
        out["bank_is_my_experts"] = torch.equal(local, full_w_in[rank * num_local:(rank + 1) * num_local])
        out["loss"] = float(model(x[:, :-1], x[:, 1:]).detach())
    except Exception as e:  # noqa: BLE001
        out["err"] = f"{type(e).__name__}: {e}"
    with torch.no_grad():
        out["reference_loss"] = float(reference(x[:, :-1], x[:, 1:]))
    return out


def _refused_before_moving() -> dict:
    """parallelize's refusals, each with the move to the rank's device replaced by a recorder: a
    refused call must not have moved (changed) the caller's model."""
    moved = []
    real = parallelize_module.to_rank_device
    parallelize_module.to_rank_device = lambda model: moved.append(type(model).__name__) or model
    try:
        cases = {
            "hsdp_no_mesh": lambda: parallelize(build_gpt(**SMALL_MOE), "hsdp"),
            "fsdp_2d_mesh": lambda: parallelize(build_gpt(**SMALL_MOE), "fsdp", build_mesh(replicate=1, shard=2)),
            "ep_not_divisible": lambda: parallelize(build_moe_gpt(3, **SMALL_MOE), "ep", ep=2),
            "ep_on_a_dense_model": lambda: parallelize(build_gpt(**SMALL_MOE), "ep", ep=2),
            "fsdp_bad_blocks": lambda: parallelize(build_gpt(**SMALL_MOE), "fsdp", block_attr="layers"),
            "ddp_2d_mesh": lambda: parallelize(build_gpt(**SMALL_MOE), "ddp", build_mesh(replicate=1, shard=2)),
            "ddp_block_attr": lambda: parallelize(build_gpt(**SMALL_MOE), "ddp", block_attr="blocks"),
            "ddp_reshard": lambda: parallelize(build_gpt(**SMALL_MOE), "ddp", reshard_after_forward=False),
        }
        out = {}
        for label, call in cases.items():
            moved.clear()
            out[label] = dict(err=_error(call), moved=list(moved))
        # and the options' defaults still reach apply_fsdp/apply_ep when not given
        moved.clear()
        model, _, _ = parallelize(build_gpt(**SMALL_MOE), "fsdp")
        out["fsdp_default"] = dict(moved=list(moved), blocks_sharded=all(hasattr(b, "reshard") for b in model.blocks))
        return out
    finally:
        parallelize_module.to_rank_device = real


def _sizes() -> dict:
    """Mesh sizes as numpy ints (accepted, as train_worker's own check accepts them) and None."""
    return dict(
        ep_none=_error(build_ep_mesh, None),
        ep_float=_error(build_ep_mesh, 2.0),
        ep_numpy=_error(lambda: tuple(build_ep_mesh(np.int64(2), np.int64(1)).shape)),
        mesh_numpy=_error(build_mesh, np.int64(dist.get_world_size())),
        hsdp_numpy=_error(build_mesh, replicate=np.int32(1), shard=np.int64(2)),
        replicate_none=_error(build_mesh, replicate=None),
    )


def _timeout_s(group) -> float:
    backend = group._get_backend(torch.device("cpu"))
    return backend.options._timeout.total_seconds()


def _timeouts() -> dict:
    """The collective timeout of each mesh group (launch gives the default group ``timeout_s``)."""
    ep1, ep2, hsdp = build_ep_mesh(1), build_ep_mesh(2), build_mesh(replicate=2, shard=1)
    return {
        "default": _timeout_s(dist.group.WORLD),
        "ep1.ep": _timeout_s(ep1.get_group("ep")),
        "ep2.fsdp": _timeout_s(ep2.get_group("fsdp")),
        "hsdp.shard": _timeout_s(hsdp.get_group("shard")),
        "hsdp.replicate": _timeout_s(hsdp.get_group("replicate")),
    }


def _train_worker_numpy() -> str | None:
    from muonlab.experiments.train import train_worker
    return _error(train_worker, "ep", ep=np.int64(2), num_experts=np.int64(2), steps=1, d_model=16, n_layers=1,
                  n_heads=2, context=8, batch_per_rank=1)


def wrapper_checks() -> dict:
    # MoE.forward returns a view that FSDP2 warns about in every layer; expected here (see apply_ep).
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module")
    return dict(twice=_refused_twice(), shared=_shared_moe(), before_moving=_refused_before_moving(),
                sizes=_sizes(), timeouts=_timeouts(), train_worker_numpy=_train_worker_numpy())
