"""Worker for tests/distributed/test_qk_clip_distributed.py (importable by spawned children).

Each case (mode, shape, optimizer) builds a GPT whose query/key rows are boosted (so that several heads pass TAU and others
do not), parallelizes it (FSDP2, DDP or expert parallelism), trains STEPS steps of fp32 Muon (or SGD) with
QK-clip attached on this rank's rows of each global batch, and returns, on every rank, every
parameter in full (expert banks gathered over the "ep" axis) and what QK-clip saw and did per step.
:func:`single_process` is the same run on one process with the whole global batches.

Case ("fsdp-hf", "llama", "sgd"): the tiny Hugging Face Llama of the real-model tests (grouped-query
attention: 4 heads, 2 kv heads), sharded with torch's fully_shard, QK-clip through its forward hooks.

Shapes: "cut" (d_model 12, 3 heads of 4): the qkv weight's 36 rows split 18/18 on 2 ranks and
9/9/9/9 on 4, both cutting through heads; "empty" (d_model 3, 3 heads of 1): its 9 rows are 3/3/3/0
on 4 ranks, so the last rank holds no row of any attention weight.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from muonlab import Muon, muon_param_groups
from muonlab.models import GPT
from muonlab.optim.qk_clip import QKClip

from ._common import build_gpt, build_moe_gpt, full_ep, rank_rows, shifted, token_batches

SHAPES = {"cut": dict(d_model=12, n_heads=3, n_layers=2, context=8),
          "empty": dict(d_model=3, n_heads=3, n_layers=2, context=8)}
NUM_EXPERTS = 2
TAU = 6.0
STEPS = 3
BOOST = 4.0


def build(shape: str, moe: bool) -> GPT:
    cfg = SHAPES[shape]
    model = build_moe_gpt(NUM_EXPERTS, **cfg) if moe else build_gpt(**cfg)
    with torch.no_grad():  # q and k rows only: logits of tens, over TAU in some heads
        for b in model.blocks:
            b.attn.qkv.weight[: 2 * cfg["d_model"]].mul_(BOOST)
    return model


def optimizer(model, name: str):
    """fp32 Muon; or plain SGD, whose distributed step differs from one process by the gradient's
    summation order alone (Muon's Newton-Schulz on the 3 x 3 matrices of the "empty" shape turns
    that into 3e-5 of relative displacement with no clip at all, which would hide QK-clip's part)."""
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.5)
    return Muon(muon_param_groups(model, adamw_lr=3e-3), lr=0.02, momentum=0.9, ns_dtype=torch.float32,
                comm_dtype=torch.float32)


def global_batches(world: int, shape: str):
    return [shifted(t) for t in token_batches(23, world, SHAPES[shape]["context"] + 1, STEPS)]


def _records(clip: QKClip) -> list[dict]:
    return [dict(max_logit=[m.tolist() for m in s.max_logit], gamma=[g.tolist() for g in s.gamma])
            for s in clip.history]


def _train(model, inner, batches, tau: float, opt_name: str) -> QKClip:
    opt = optimizer(inner, opt_name)
    clip = QKClip(inner, tau=tau).attach(opt)
    for x, y in batches:
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    return clip


def single_process(world: int, shape: str, opt_name: str, moe: bool = False, tau: float = TAU) -> dict:
    model = build(shape, moe)
    clip = _train(model, model, global_batches(world, shape), tau, opt_name)
    return dict(params={n: p.detach().clone() for n, p in model.named_parameters()}, clip=_records(clip))


def run_case(mode: str, shape: str, opt_name: str, tau: float = TAU) -> dict:
    from muonlab.distributed import parallelize

    world = dist.get_world_size()
    moe = mode == "ep"
    model, inner, mesh = parallelize(build(shape, moe), mode, **({"ep": world} if moe else {}))
    batches = [(rank_rows(x), rank_rows(y)) for x, y in global_batches(world, shape)]
    local_rows = [p.to_local().shape[0] if hasattr(p, "to_local") else p.shape[0]
                  for b in inner.blocks for p in [b.attn.qkv.weight]]
    clip = _train(model, inner, batches, tau, opt_name)
    ep_group = mesh.get_group("ep") if moe else None
    params = {n: full_ep(p, p, ep_group) for n, p in inner.named_parameters()}
    return dict(params=params, clip=_records(clip), qkv_rows=local_rows)


# ---------------------------------------------------------------------------------- Hugging Face


HF_TAU = 30.0


def build_llama():
    """The tiny Llama of the real-model tests (4 heads, 2 kv heads of 8), q/k of layer 0 boosted."""
    from tests.real_models._workers import build_llama as build

    model = build()
    with torch.no_grad():
        attn = model.model.layers[0].self_attn
        attn.q_proj.weight.mul_(30.0)  # from init std 0.02: logits of tens
        attn.k_proj.weight.mul_(30.0)
    return model


def hf_batches(world: int):
    from tests.real_models._workers import global_batch

    return [global_batch(31 + s, world) for s in range(STEPS)]


def _train_hf(model, batches, tau: float) -> QKClip:
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    clip = QKClip(model, tau=tau).attach(opt)
    for x in batches:
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    return clip


def single_process_hf(world: int, tau: float = HF_TAU) -> dict:
    model = build_llama()
    clip = _train_hf(model, hf_batches(world), tau)
    return dict(params={n: p.detach().clone() for n, p in model.named_parameters()}, clip=_records(clip))


def run_hf(tau: float = HF_TAU) -> dict:
    """FSDP2 as a user's script applies it (torch's fully_shard per decoder layer, then the root)."""
    from torch.distributed.fsdp import fully_shard

    from tests.real_models._workers import rows

    world, rank = dist.get_world_size(), dist.get_rank()
    model = build_llama()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    clip = _train_hf(model, [rows(x, rank) for x in hf_batches(world)], tau)
    return dict(params={n: full_ep(p, p, None) for n, p in model.named_parameters()}, clip=_records(clip))


def all_runs(cases) -> dict:
    return {case: run_hf() if case[0] == "fsdp-hf" else run_case(*case) for case in cases}
