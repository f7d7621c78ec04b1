"""Worker for tests/distributed/test_parallelize.py (importable by spawned children).

``parallelize_checks`` applies every mode of :func:`muonlab.distributed.parallelize` to a small GPT
(the MoE GPT for "ep") built from seed 0, runs one forward and backward on a batch that is the
same on every rank, and returns what it saw plus the text of each error case; the parent asserts.
Then models that are not muonlab's GPT (``ANY_MODEL_CASES``: an nn.Sequential MLP, a model with no
repeated block), sharded and trained with Muon in fp32, each rank on its slice of the global batch:
their final parameters, compared in the parent with ``train_single_process``.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from muonlab.distributed import MeshAxis, build_mesh, mesh_axis_group, parallelize
from muonlab.models import GPT, GPTConfig
from muonlab.models.gpt import moe_config
from muonlab.optim import Muon, muon_param_groups

from ._common import full

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
    report["any_model"] = any_model_checks()
    return report


# ---------------------------------------------------------------------------------- any model


class NoBlocks(nn.Module):
    """A model that repeats no block: two Linear layers of different shapes and a norm between."""

    def __init__(self):
        super().__init__()
        self.fc_in = nn.Linear(8, 24)
        self.norm = nn.LayerNorm(24)
        self.fc_out = nn.Linear(24, 4)

    def forward(self, x):
        return self.fc_out(torch.tanh(self.norm(self.fc_in(x))))


def build_any(kind: str) -> nn.Module:
    torch.manual_seed(1)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    return NoBlocks()


# (model, mode, parallelize's keywords); min_unit_params=100: NoBlocks' two Linear layers (216 and
# 100 parameters) become units by size, the norm (48) stays in the root
ANY_MODEL_CASES = [("mlp", "fsdp", {}), ("mlp", "hsdp", {}), ("mlp", "ddp", {}), ("noblocks", "fsdp", {}),
                   ("noblocks", "fsdp", {"min_unit_params": 100}), ("noblocks", "hsdp", {})]
ANY_STEPS = 3
GLOBAL_ROWS = 8


def any_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    return [(torch.randn(GLOBAL_ROWS, 8, generator=gen), torch.randn(GLOBAL_ROWS, 4, generator=gen))
            for _ in range(ANY_STEPS)]


def any_optimizer(model: nn.Module) -> Muon:
    return Muon(muon_param_groups(model), lr=0.02, adamw_lr=3e-3, ns_dtype=torch.float32, comm_dtype=torch.float32)


def train_single_process(kind: str) -> dict[str, torch.Tensor]:
    """The reference: one process, the whole global batch each step."""
    model = build_any(kind)
    opt = any_optimizer(model)
    for x, y in any_batches():
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _any_model_report(kind: str, mode: str, options: dict) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = build_mesh(replicate=2) if mode == "hsdp" else None
    model, inner, _ = parallelize(build_any(kind), mode, mesh, **options)
    opt = any_optimizer(inner)
    share = GLOBAL_ROWS // world
    for x, y in any_batches():
        mine = slice(rank * share, (rank + 1) * share)
        F.mse_loss(model(x[mine]), y[mine]).backward()
        opt.step()
        opt.zero_grad()
    return dict(
        params={n: full(p) for n, p in inner.named_parameters()},
        fsdp_units=sorted(n for n, m in inner.named_modules() if n and hasattr(m, "reshard")),
        placements={n: [repr(pl) for pl in p.placements] for n, p in inner.named_parameters() if hasattr(p, "placements")},
        muon=sorted(r.name for r in muon_param_groups(inner).routes if r.algorithm == "muon"),
    )


def any_model_checks() -> dict:
    report = {f"{kind}/{mode}/{sorted(options)}": _any_model_report(kind, mode, options)
              for kind, mode, options in ANY_MODEL_CASES}
    report["errors"] = {
        "sequential_named_blocks": _error(parallelize, build_any("mlp"), "fsdp", block_attr="blocks"),
        "noblocks_named_layers": _error(parallelize, build_any("noblocks"), "fsdp", block_attr="layers"),
        "min_unit_params_ddp": _error(parallelize, build_any("mlp"), "ddp", min_unit_params=10),
        "min_unit_params_zero": _error(parallelize, build_any("mlp"), "fsdp", min_unit_params=0),
    }
    return report
