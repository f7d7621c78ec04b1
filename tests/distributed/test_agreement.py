"""Ranks that drift apart after the first step are refused on every rank, naming what differs,
before anything changes (muonlab.optim.agreement), instead of hanging or silently diverging."""

import pytest

from muonlab.distributed import launch

from . import _workers_agreement as W

EXPECTED = {
    "grad": r"muon parameter 'w1' has a gradient on rank 0 and none on rank 1",
    "lr": r"muon parameter 'w0': lr 0.02 on rank 0, 0.04 on rank 1",
    "adamw_grad": r"adamw parameter 'bias' has a gradient on rank 0 and none on rank 1",
    "extra": r"muon parameter 'extra' has a gradient on rank 1 and none on rank 0",
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout, drift", [("fsdp", "grad"), ("fsdp", "lr"), ("ddp", "adamw_grad"),
                                           ("ddp", "extra")])
def test_a_rank_that_drifts_after_the_first_step_is_named_on_every_rank(layout, drift):
    import re

    results = launch(W.drift_after_the_first_step, 2, layout, drift, timeout_s=120)
    for rank, out in results.items():
        assert out["error"] is not None and re.search(EXPECTED[drift], out["error"]), (rank, out["error"])
        assert out["unchanged"], rank
