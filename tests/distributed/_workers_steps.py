"""Worker for tests/distributed/test_step_recorder.py (importable by spawned children).

``record_steps`` trains the small GPT under FSDP2 and under DDP on every rank with a
``StepRecorder`` attached, and returns what it kept: every rank's rows gathered on rank 0, this
rank's kept step numbers, and the optimizer's own spans of the last step to compare with.
"""

from __future__ import annotations

from dataclasses import asdict

import torch
import torch.distributed as dist

from muonlab import Muon, muon_param_groups
from muonlab.trace import StepRecorder

from ._common import SMALL_GPT, build_gpt, rank_rows, shifted, token_batches, train_steps


def record_steps(modes: list[str], steps: int, keep: int) -> dict:
    """{mode: dict(rows (on rank 0, None elsewhere), steps, completed, last, clock)}."""
    from muonlab.distributed import parallelize

    out = {}
    for mode in modes:
        model, inner, _ = parallelize(build_gpt(**SMALL_GPT), mode)
        opt = Muon(muon_param_groups(inner, adamw_lr=3e-3), lr=0.02, ns_dtype=torch.float32,
                   comm_dtype=torch.float32)
        rec = StepRecorder(opt, keep=keep)
        batches = token_batches(5, dist.get_world_size(), SMALL_GPT["context"] + 1, steps)
        train_steps(model, opt, [shifted(rank_rows(b)) for b in batches])
        out[mode] = dict(rows=rec.gather(), steps=rec.steps, completed=rec.completed,
                         last=[asdict(s) for s in opt.last_step_spans()], clock=rec.clock)
    return out
