"""Ranks that drift apart after the first step are refused on every rank, naming what differs,
before anything changes (muonlab.optim.agreement), instead of hanging or silently diverging."""

import pytest

from muonlab.launcher import launch

from . import _workers_agreement as W

EXPECTED = {
    "grad": r"muon parameter 'w1' has a gradient on rank 0 and none on rank 1",
    "lr": r"muon parameter 'w0': lr 0.02 on rank 0, 0.04 on rank 1",
    "adamw_grad": r"adamw parameter 'bias' has a gradient on rank 0 and none on rank 1",
    "extra": r"muon parameter 'extra' has a gradient on rank 1 and none on rank 0",
    "tensor_lr": r"muon parameter 'w0': lr 0.02 on rank 0, 'tensor 0.02 \(torch.float32 on cpu\)' on rank 1",
    "decision": r"options of the step: nonfinite_decision 'host' on rank 0, 'device' on rank 1",
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout, drift", [("fsdp", "grad"), ("fsdp", "lr"), ("ddp", "adamw_grad"),
                                           ("ddp", "extra"), ("fsdp", "tensor_lr"), ("ddp", "decision")])
def test_a_rank_that_drifts_after_the_first_step_is_named_on_every_rank(layout, drift):
    import re

    results = launch(W.drift_after_the_first_step, 2, layout, drift, timeout_s=120)
    for rank, out in results.items():
        assert out["error"] is not None and re.search(EXPECTED[drift], out["error"]), (rank, out["error"])
        assert out["unchanged"], rank


@pytest.mark.timeout(300)
def test_momentum_offloaded_on_one_rank_only_is_named_on_every_rank():
    results = launch(W.momentum_offloaded_on_one_rank, 2, timeout_s=120)
    for rank, out in results.items():
        assert out["error"] is not None and "momentum offload" in out["error"], (rank, out["error"])
        assert "'none' on rank 0, 'cpu' on rank 1" in out["error"] and out["state"] == 0, (rank, out)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("drift", [None, "lr"])
def test_the_side_group_used_under_nccl_agrees_and_names_a_drift(drift):
    """Under NCCL the check runs on a gloo side group made with use_local_synchronization; CI has
    no NCCL, so this runs that branch over a gloo world: made once, over the same ranks, and it
    names a drift as the step's own group does."""
    import re

    results = launch(W.drift_after_the_first_step, 2, "fsdp", drift, True, timeout_s=120)
    for rank, out in results.items():
        # made once, over the same ranks, and the digests of both steps went over it
        assert out["side_groups"] == 1 and out["own_group"] and out["side_used"] == 2, (rank, out)
        if drift is None:
            assert out["error"] is None and not out["unchanged"], (rank, out)
        else:
            assert out["error"] is not None and re.search(EXPECTED[drift], out["error"]), (rank, out["error"])
            assert out["unchanged"], rank
