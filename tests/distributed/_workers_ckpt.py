"""Worker functions for the checkpoint tests (importable by spawned children).

A case is (layout, precision): "fsdp" (FSDP2 over all ranks), "ep" (MoE GPT, build_ep_mesh(2) +
apply_ep), "ddp" (apply_ddp; Muon keeps replicated momentum on one owner per matrix). Every run
builds its model from seed 0, trains on this rank's slice of deterministic global batches, with a
StepLR scheduler, and leaves one Muon matrix and one AdamW vector without a gradient for the
first ``FROZEN_UNTIL`` steps (never stepped before the save). Results are plain full tensors per
rank, so the parent compares a straight run with a saved-and-resumed one bit for bit.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from muonlab import Muon, checkpoint, muon_param_groups

from ._common import SMALL_GPT, SMALL_MOE, build_gpt, build_moe_gpt, full, rank_rows, shifted, token_batches, world_rank

GPT_CFG = SMALL_GPT
MOE_CFG = dict(num_experts=4, **SMALL_MOE)
HYPER = dict(lr=0.02, weight_decay=0.01, momentum=0.9, adamw_lr=3e-3)
TOTAL_STEPS = 8
SAVE_AT = 4
FROZEN_UNTIL = 4
# no gradient before FROZEN_UNTIL: one Muon matrix and one AdamW vector
FROZEN = {"gpt": ("blocks.1.attn.proj.weight", "blocks.1.norm2.weight"),
          "moe": ("blocks.0.attn.proj.weight", "blocks.0.norm2.weight")}


def build(layout: str, precision: str = "fp32"):
    """(model, inner module, optimizer, scheduler, model kind) for this rank."""
    from muonlab.distributed import parallelize

    kind = "moe" if layout == "ep" else "gpt"
    model = build_moe_gpt(**MOE_CFG) if kind == "moe" else build_gpt(**GPT_CFG)
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    if layout not in ("plain", "fsdp", "ep", "ddp"):
        raise ValueError(layout)
    inner = model
    if layout in ("ep", "ddp") or (layout == "fsdp" and dist.is_initialized()):  # one process: plain
        model, inner, _ = parallelize(model, layout, ep=2 if layout == "ep" else None)
    opt = Muon(muon_param_groups(inner), **HYPER)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return model, inner, opt, sched, kind


def batch(kind: str, step: int):
    """This rank's (inputs, targets) of step ``step``'s global batch, from a generator seeded 100 + step."""
    world, rank = world_rank()
    context = (MOE_CFG if kind == "moe" else GPT_CFG)["context"]
    return shifted(rank_rows(token_batches(100 + step, world, context + 1)[0], rank))


def train(model, inner, opt, sched, kind: str, steps: range) -> list[float]:
    named = dict(inner.named_parameters())
    losses = []
    for step in steps:
        x, y = batch(kind, step)
        loss = model(x, y)
        loss.backward()
        if step < FROZEN_UNTIL:
            for name in FROZEN[kind]:
                named[name].grad = None
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(float(loss.detach().float()))
    return losses


def snapshot(inner, opt, sched) -> dict:
    """Full parameters and optimizer state (every rank holds all of it: consolidate first)."""
    opt.init_state()
    opt.consolidate_state()
    names = {p: n for n, p in inner.named_parameters()}
    state = {}
    for p, s in opt.state.items():
        for key, value in s.items():
            state[(names[p], key)] = full(value) if torch.is_tensor(value) else value
    opt.release_unowned_state()
    return dict(
        params={n: full(p) for n, p in inner.named_parameters()},
        state=state,
        state_dtypes={k: v.dtype for k, v in state.items() if torch.is_tensor(v)},
        sched=sched.state_dict(),
        lrs=[g["lr"] for g in opt.param_groups],
    )


def save_run(cases, root: str) -> dict:
    """Per case: 8 steps straight (snapshot), then 4 steps + save (snapshot right after the save)."""
    out = {}
    for layout, precision in cases:
        parts = build(layout, precision)
        losses = train(*parts, range(TOTAL_STEPS))
        straight = dict(snapshot(*parts[1:4]), losses=losses)
        parts = build(layout, precision)
        losses = train(*parts, range(SAVE_AT))
        path = os.path.join(root, f"{layout}_{precision}_w{dist.get_world_size()}")
        checkpoint.save(path, parts[0], parts[2], SAVE_AT, scheduler=parts[3], extra={"case": layout})
        saved = dict(snapshot(*parts[1:4]), losses=losses)
        out[(layout, precision)] = dict(straight=straight, saved=saved, path=path)
    return out


def resume_run(cases, root: str, world_saved: int) -> dict:
    """Per case: load the checkpoint saved on ``world_saved`` ranks, 4 more steps, snapshot."""
    out = {}
    for layout, precision in cases:
        path = os.path.join(root, f"{layout}_{precision}_w{world_saved}")
        parts = build(layout, precision)
        step = checkpoint.load(path, parts[0], parts[2], scheduler=parts[3])
        loaded = snapshot(*parts[1:4])
        losses = train(*parts, range(step, TOTAL_STEPS))
        out[(layout, precision)] = dict(step=step, loaded=loaded, resumed=dict(snapshot(*parts[1:4]), losses=losses),
                                        meta_extra=checkpoint.read_meta(path)["extra"])
    return out


def reshard_load(root: str, world_saved: int, layout: str = "fsdp") -> dict:
    """Load a checkpoint saved on another world size; snapshot; one more step runs."""
    path = os.path.join(root, f"fsdp_fp32_w{world_saved}")
    parts = build(layout, "fp32")
    step = checkpoint.load(path, parts[0], parts[2], scheduler=parts[3])
    loaded = snapshot(*parts[1:4])
    losses = train(*parts, range(step, step + 1))
    return dict(step=step, loaded=loaded, losses=losses)


def phase(jobs: list) -> dict:
    """Several jobs in one launch: [(name, function name, args)], run in order."""
    torch.set_num_threads(1)
    return {name: globals()[fn](*args) for name, fn, args in jobs}
