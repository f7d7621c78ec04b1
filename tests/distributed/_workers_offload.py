"""Worker functions for the state-offload tests (importable by spawned children).

A case is (layout, precision) as in the checkpoint tests: "fsdp" (FSDP2), "ddp" (replicated
matrices, momentum on one owner), "ep" (MoE GPT, apply_ep with ep=2). Every run builds its model
from seed 0 and trains on this rank's rows of deterministic global batches; results are this
rank's parameters and optimizer state in full, so the parent compares places bit for bit.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from muonlab import Muon, checkpoint, muon_param_groups

from ._common import DTYPES, SMALL_GPT, SMALL_MOE, build_gpt, build_moe_gpt, full, rank_rows, shifted, token_batches

HYPER = dict(lr=0.02, weight_decay=0.01, momentum=0.9, adamw_lr=3e-3)
STEPS = 3
PLACES = (None, "cpu", "disk")
# (None, None) is the reference: a fresh DDP's first step buckets gradients differently from a
# long-running one's, so a resumed run is compared with a resumed run, not with a straight one
RESUMES = ((None, None), ("disk", None), (None, "disk"), ("cpu", "disk"))


def build(layout: str, precision: str, place, offload_dir):
    from muonlab.distributed import parallelize

    kind = "moe" if layout == "ep" else "gpt"
    model = build_moe_gpt(4, **SMALL_MOE) if kind == "moe" else build_gpt(**SMALL_GPT)
    model = model.to(DTYPES[precision])
    model, inner, _ = parallelize(model, layout, ep=2 if layout == "ep" else None)
    opt = Muon(muon_param_groups(inner), state_offload=place, offload_dir=offload_dir if place == "disk" else None,
               **HYPER)
    return model, inner, opt, kind


def train(model, opt, kind: str, steps) -> None:
    context = (SMALL_MOE if kind == "moe" else SMALL_GPT)["context"]
    for step in steps:
        x, y = shifted(rank_rows(token_batches(100 + step, dist.get_world_size(), context + 1)[0]))
        model(x, y).backward()
        opt.step()
        opt.zero_grad()


def snapshot(inner, opt) -> dict:
    """This rank's parameters and every state tensor in full (owners broadcast replicated momentum)."""
    opt.init_state()
    opt.consolidate_state()
    names = {p: n for n, p in inner.named_parameters()}
    state = {(names[p], k): full(v) for p, s in opt.state.items() for k, v in s.items()}
    opt.release_unowned_state()
    return dict(params={n: full(p) for n, p in inner.named_parameters()}, state=state,
                residency=opt.state_residency())


def _dir(root: str, *parts) -> str:
    return os.path.join(root, "_".join(str(p) for p in parts))


def place_runs(cases, root: str) -> dict:
    """Per case and place: STEPS steps, then a snapshot."""
    out = {}
    for layout, precision in cases:
        for place in PLACES:
            model, inner, opt, kind = build(layout, precision, place, _dir(root, layout, precision, place))
            train(model, opt, kind, range(STEPS))
            out[(layout, precision, place)] = snapshot(inner, opt)
    return out


def resume_runs(cases, root: str) -> dict:
    """Per case and (saved place, loaded place): 2 steps, save, load into a new optimizer, 1 step."""
    out = {}
    for layout, precision in cases:
        for saved_place, loaded_place in RESUMES:
            tag = (layout, precision, saved_place, loaded_place)
            path = _dir(root, "ckpt", *tag)
            model, inner, opt, kind = build(layout, precision, saved_place, _dir(root, "save", *tag))
            train(model, opt, kind, range(STEPS - 1))
            checkpoint.save(path, model, opt, STEPS - 1)
            model, inner, opt, kind = build(layout, precision, loaded_place, _dir(root, "load", *tag))
            checkpoint.load(path, model, opt)
            on_disk = opt.state_residency()
            train(model, opt, kind, range(STEPS - 1, STEPS))
            out[tag] = dict(snapshot(inner, opt), loaded_residency=on_disk)
    return out


def everything(cases, root: str) -> dict:
    return dict(places=place_runs(cases, root), resumed=resume_runs(cases, root))
