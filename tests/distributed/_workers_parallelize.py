"""Worker for tests/distributed/test_parallelize.py (importable by spawned children).

``parallelize_checks`` applies every mode of :func:`muonlab.distributed.parallelize` to a small GPT
(the MoE GPT for "ep") built from seed 0, runs one forward and backward on a batch that is the
same on every rank, and returns what it saw plus the text of each error case; the parent asserts.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from muonlab.distributed import MeshAxis, build_mesh, mesh_axis_group, parallelize
from muonlab.models import GPT, GPTConfig
from muonlab.models.gpt import moe_config
from muonlab.optim import muon_param_groups

MODEL_CFG = dict(d_model=16, n_layers=2, n_heads=2, context=8)
NUM_EXPERTS = 4


def build_model(moe: bool) -> GPT:
    torch.manual_seed(0)
    return GPT(moe_config(num_experts=NUM_EXPERTS, **MODEL_CFG) if moe else GPTConfig(**MODEL_CFG))


def batch() -> torch.Tensor:
    return torch.randint(0, 256, (2, MODEL_CFG["context"]), generator=torch.Generator().manual_seed(3))


def _error(fn, *args, **kwargs) -> str | None:
    try:
        fn(*args, **kwargs)
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _mode_report(mode: str, **kwargs) -> dict:
    model, inner, mesh = parallelize(build_model(mode == "ep"), mode, **kwargs)
    x = batch()
    loss = model(x, x)
    loss.backward()
    head = inner.lm_head.weight
    return dict(
        model_type=type(model).__name__,
        inner_is_model=inner is model,
        inner_type=type(inner).__name__,
        mesh_axes=None if mesh is None else tuple(mesh.mesh_dim_names),
        mesh_shape=None if mesh is None else tuple(mesh.shape),
        head_placements=[repr(p) for p in head.placements] if hasattr(head, "placements") else None,
        muon_names=sorted(r.name for r in muon_param_groups(inner).routes if r.algorithm == "muon"),
        ep_sizes=sorted({getattr(p, "_ep_size", 0) for p in inner.parameters()} - {0}),
        ep_rank=mesh.get_local_rank(MeshAxis.EP) if mode == "ep" else None,
        loss=float(loss.detach()),
    )


def parallelize_checks() -> dict:
    # MoE.forward returns a view that FSDP2 warns about in every layer; expected here (see apply_ep).
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPMoE\) returned a view")
    report = {
        "fsdp": _mode_report("fsdp"),
        "hsdp": _mode_report("hsdp", mesh=build_mesh(replicate=2)),
        "ddp": _mode_report("ddp"),
        "ep": _mode_report("ep", ep=2),
    }
    flat, mesh2d = build_mesh(), build_mesh(replicate=2)
    report["errors"] = {
        "bad_mode": _error(parallelize, build_model(False), "zero3"),
        "ep_in_fsdp": _error(parallelize, build_model(False), "fsdp", ep=2),
        "hsdp_no_mesh": _error(parallelize, build_model(False), "hsdp"),
        "fsdp_2d_mesh": _error(parallelize, build_model(False), "fsdp", mesh2d),
        "hsdp_1d_mesh": _error(parallelize, build_model(False), "hsdp", flat),
        "ep_no_size": _error(parallelize, build_model(True), "ep"),
        "ep_and_mesh": _error(parallelize, build_model(True), "ep", flat, ep=2),
        "ep_flat_mesh": _error(parallelize, build_model(True), "ep", flat),
        "mp_policy_ddp": _error(parallelize, build_model(False), "ddp", mp_policy=object()),
    }
    # a MeshAxis member works wherever torch takes an axis name
    report["shard_group_size"] = dist.get_world_size(mesh_axis_group(mesh2d, MeshAxis.SHARD))
    return report
