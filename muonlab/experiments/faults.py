"""A worker that fails on purpose (notebook 05): launch() should name the rank and end the others,
not hang.

It trains the same FSDP2 run as checkpoint.py, so the fault hits a rank that is mid-step with the
others waiting in a collective, as a real failure would.
"""

from __future__ import annotations

import torch.distributed as dist

from ..distributed.progress import report_progress

from .checkpoint import build, global_batch

__all__ = ["faulty_training"]


def faulty_training(fail_rank: int, fail_step: int, steps: int = 4) -> int:
    """Train; ``fail_rank`` raises just before its optimizer step at ``fail_step`` (a demo fault)."""
    model, opt = build()
    for step in range(steps):
        x, y = global_batch(step)
        loss = model(x, y)
        loss.backward()
        if dist.get_rank() == fail_rank and step == fail_step:
            raise RuntimeError(f"injected fault on rank {fail_rank} at step {fail_step}")
        opt.step()
        opt.zero_grad()
        report_progress(step=step + 1, loss=loss.item(), total=steps)
    return dist.get_rank()
