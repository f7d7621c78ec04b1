"""compare(..., nprocs=2): the runs shared between two launched workers give the very runs one
process gives (one thread each, as launch's CPU workers run)."""

from __future__ import annotations

import pytest
import torch

from muonlab.experiments.compare import compare
from muonlab.models import GPTConfig

TINY = GPTConfig(d_model=32, n_layers=1, n_heads=2, context=16)


@pytest.mark.timeout(300)
def test_runs_launched_on_two_ranks_equal_the_runs_here():
    configs = {"lr 0.02": dict(lr=0.02, ns_dtype="fp32"), "lr 0.01": dict(lr=0.01, ns_dtype="fp32")}
    launched = compare(configs, model=TINY, seeds=(0, 1, 2), steps=4, nprocs=2, progress=False, timeout_s=240)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        here = compare(configs, model=TINY, seeds=(0, 1, 2), steps=4, progress=False)
    finally:
        torch.set_num_threads(before)
    for name in configs:
        ours, theirs = here.configs[name].runs, launched.configs[name].runs
        assert [r.seed for r in theirs] == [0, 1, 2]
        assert [(r.train_loss, r.final_val_loss, r.init_digest, r.batch_digest) for r in theirs] == [
            (r.train_loss, r.final_val_loss, r.init_digest, r.batch_digest) for r in ours]
    assert launched.table() == here.table()
