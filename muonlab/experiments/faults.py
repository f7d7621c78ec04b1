"""A worker that fails on purpose (notebook 05): launch() should name the rank and end the others,
not hang.

It trains the same FSDP2 run as checkpoint.py, so the fault hits a rank that is mid-step with the
others waiting in a collective, as a real failure would.
"""

from __future__ import annotations

from .._base import check_whole
from ..launcher.progress import report_progress
from .checkpoint import _world_rank, build, global_batch

__all__ = ["faulty_training"]


def faulty_training(fail_rank: int, fail_step: int, steps: int = 4) -> int:
    """Train; ``fail_rank`` raises just before its optimizer step at ``fail_step`` (a demo fault).

    A fault that could never happen is refused before training: ``fail_rank`` must be a rank of the
    world, ``fail_step`` a step of the run (0 to ``steps - 1``)."""
    world, rank = _world_rank()
    check_whole("steps", steps, 1)
    for keyword, value, end, what in (("fail_rank", fail_rank, world, "ranks"),
                                      ("fail_step", fail_step, steps, "steps")):
        check_whole(keyword, value, 0)
        if value >= end:
            raise ValueError(f"{keyword}={value} never comes: this run has {what} 0 to {end - 1}")
    model, opt = build()
    for step in range(steps):
        x, y = global_batch(step)
        loss = model(x, y)
        loss.backward()
        if rank == fail_rank and step == fail_step:
            raise RuntimeError(f"injected fault on rank {fail_rank} at step {fail_step}")
        opt.step()
        opt.zero_grad()
        report_progress(step=step + 1, loss=loss.item(), total=steps)
    return rank
