"""Worker functions for the device rule's tests (test_device.py, test_workers.py on the CPU,
test_workers_cuda.py on a GPU); importable, so launch() can start them."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn as nn

from muonlab import Muon
from muonlab.distributed import apply_ddp
from muonlab.distributed.device import DEVICE_ENV, collective_device, rank_device, to_rank_device
from muonlab.experiments.checkpoint import resume_and_train, train_and_save
from muonlab.experiments.train import MODES, train_worker

TINY = dict(steps=2, d_model=16, n_layers=1, n_heads=2, context=16, batch_per_rank=2)
"""train_worker's model for the CPU runs of every mode (a start-up dominates them anyway)."""
CKPT = dict(steps=4, save_at=2, width=16)
"""The checkpoint workers' run: save after 2 of 4 steps, resume for the last 2."""


def device_info() -> dict:
    """What the rule gave this rank: backend, devices, where a CPU-built model goes, one all_reduce."""
    model = to_rank_device(nn.Linear(2, 2))
    total = torch.ones(1, device=collective_device())
    dist.all_reduce(total)
    return dict(
        rank=dist.get_rank(), backend=str(dist.get_backend()), rank_device=str(rank_device()),
        collective_device=str(collective_device()), model_device=str(model.weight.device),
        world_sum=total.item(), env=os.environ.get(DEVICE_ENV),
    )


def every_worker(root: str, ep: int = 2) -> dict:
    """train_worker in every mode, then the checkpoint workers' save and resume, in one launch."""
    out = {mode: train_worker(mode, ep=ep, num_experts=4, **TINY) for mode in MODES}
    path = os.path.join(root, "ckpt")
    out["saved"] = train_and_save(path, CKPT["steps"], CKPT["save_at"], width=CKPT["width"])
    out["resumed"] = resume_and_train(path, CKPT["steps"], width=CKPT["width"])
    return out


def nonfinite_over_the_group() -> dict:
    """A NaN gradient with Muon's non-finite check run over an explicit group (a collective even on
    one rank): its flags tensor must sit where the group's backend can send it."""
    w = nn.Parameter(torch.ones(4, 4, device=rank_device()))
    opt = Muon([w], process_group=dist.group.WORLD, nonfinite="skip")
    w.grad = torch.full_like(w, float("nan"))
    opt.step()
    stats = opt.last_step_stats()
    return dict(skipped=stats["skipped"], ranks=stats["nonfinite_ranks"], unchanged=bool((w == 1).all()))


def ddp_of_a_cpu_model() -> str:
    """apply_ddp of a model left on the CPU: the error text ("" if none)."""
    try:
        apply_ddp(nn.Linear(2, 2))
    except ValueError as e:
        return str(e)
    return ""
