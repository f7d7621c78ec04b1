"""Worker functions for the fault-injection tests (importable by spawned children).

:func:`train_with_fault` trains the small GPT with Muon (FSDP2 over all ranks) and injects one
fault on one rank; every worker first writes its pid to ``pid_dir`` so the parent can check that
no process outlives the launch.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

import muonlab.kernels.runner as runner_module
from muonlab import Muon
from tests.distributed import _workers_ckpt as W

STEPS = 4


def _inject_in_step(rank_to_fail: int, at_step: int, action) -> None:
    """Replace Newton-Schulz (each chunk the runner runs inside Muon.step, between collectives) with one that
    runs ``action`` on ``rank_to_fail`` from its ``at_step``-th call on (calls counted per step)."""
    real = runner_module.run_resolved
    calls = {"step": 0}

    def faulty(*args, **kwargs):
        if dist.get_rank() == rank_to_fail and calls["step"] >= at_step:
            action()
        return real(*args, **kwargs)

    runner_module.run_resolved = faulty
    return calls


def _raise_in_step():
    raise RuntimeError("injected fault inside Muon.step (newton_schulz)")


def _sleep_forever():
    while True:
        time.sleep(1)


def train_with_fault(fault: str, pid_dir: str) -> int:
    rank = dist.get_rank()
    with open(os.path.join(pid_dir, f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    if fault == "shape":
        # replicated matrices whose shapes differ on the last rank: Muon's check raises before
        # any collective of the step
        last = dist.get_world_size() - 1
        w = torch.nn.Parameter(torch.zeros(4, 9 if rank == last else 8))
        opt = Muon([("w", w)], lr=0.02)
        w.grad = torch.ones_like(w)
        opt.step()
        return rank
    model, inner, opt, sched, kind = W.build("fsdp")
    counter = None
    if fault == "raise_in_step":
        counter = _inject_in_step(1, 1, _raise_in_step)
    elif fault in ("hang_in_step", "hang_in_step_rank1"):
        counter = _inject_in_step(1 if fault.endswith("rank1") else 0, 1, _sleep_forever)
    for step in range(STEPS):
        if counter is not None:
            counter["step"] = step
        x, y = W.batch(kind, step)
        model(x, y).backward()
        if fault == "raise_before" and rank == 1 and step == 0:
            raise RuntimeError("injected fault before the first optimizer step")
        if fault == "sigkill" and rank == 2 and step == 2:
            os.kill(os.getpid(), 9)
        opt.step()
        opt.zero_grad()
        sched.step()
    return rank
