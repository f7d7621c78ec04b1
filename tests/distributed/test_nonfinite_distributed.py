"""muonlab.optim.nonfinite across gloo ranks: DTensor grads, every rank agrees on the bad ranks (the
step's control exchange shares the flags), and a skipped or raised step changes and moves nothing."""

import pytest

from muonlab.launcher import launch

from . import _workers_nonfinite as W
from ._memory import assert_counted


@pytest.mark.timeout(300)
def test_dtensor_grads_nonfinite_on_the_last_rank_only():
    world = 3
    results = launch(W.check_dtensor_grads, world, timeout_s=240)
    last = world - 1
    for rank, out in results.items():
        for dtype in ("torch.float32", "torch.bfloat16"):
            assert out[f"clean_{dtype}"] == ([], []), (rank, dtype)
            assert out[f"nan_{dtype}"] == ([last], ["g2"] if rank == last else []), (rank, dtype)
        if rank in (0, last):
            assert out["subgroup"] == ([last], ["grad 0 of shape (3,)"] if rank == last else []), rank
        else:
            assert "subgroup" not in out


@pytest.mark.timeout(300)
def test_steps_with_the_check_on_are_bit_identical_to_the_check_off():
    results = launch(W.check_on_and_off_are_bit_identical, 2, timeout_s=240)
    for rank, out in results.items():
        for case in range(7):
            assert out[case] == [True, True, True], (rank, case)
        # paths with and without a way out or a way back
        assert len(out["paths0"]) >= 4 and {"all_to_all", "owner", "local"} <= set(out["paths0"]), out["paths0"]
        assert set(out["paths5"]) == {"gather_all", "local"}, out["paths5"]
        assert out["paths0"][0] == out["paths5"][0] == "local"
        for k in range(7):  # planned buffer bytes == counted, gather_all and banks in parts too
            assert_counted({"memory": out[f"memory{k}"]}, (k, rank))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("state_offload, bank, workspace_bytes", [
    (None, True, None),  # batch 0 on the local path
    (None, False, None),  # batch 0 on all_to_all
    ("cpu", True, None),  # offloaded momentum
    (None, True, 1),  # the bank in parts of one matrix per rank
])
def test_nan_on_one_rank_skips_everywhere_and_leaves_no_trace(state_offload, bank, workspace_bytes):
    results = launch(W.skipped_steps_leave_no_trace, 2, state_offload, bank, workspace_bytes, timeout_s=240)
    for rank, out in results.items():
        assert (out["parts"][0] is not None) == (workspace_bytes is not None), out["parts"]
        assert out["paths"][0] == ("local" if bank else "all_to_all"), out["paths"]
        assert out["first"] != out["last"]
        names = [out["first"], out["first"], out["last"], "bias"]
        for k, (skip, name) in enumerate(zip(out["skips"], names)):
            assert skip["unchanged"] and skip["skipped"] and skip["ranks"] == [1], (rank, k, skip)
            assert skip["names"] == ([name] if rank == 1 else []), (rank, k, skip)
            # decided before the step's first collective of its own: nothing moved
            assert skip["comm_spans"] == 0 and skip["stats_bytes"] == (0, 0), (rank, k, skip)
        assert out["skips"][0]["state"] == 0  # a skipped first step makes no state
        assert out["skipped_steps"] == 4
        # the check comes before any batch starts, wherever momentum lives
        assert out["order"] == [["check"]] * 4, (rank, out["order"])
        assert out["equal_to_clean_run"], rank


@pytest.mark.timeout(300)
def test_raise_on_one_rank_raises_everywhere_before_any_change():
    results = launch(W.raise_changes_nothing, 2, timeout_s=240)
    for rank, out in results.items():
        assert len(out["raised"]) == 2, (rank, out)
        for k, raised in enumerate(out["raised"]):
            assert raised["message"].startswith("non-finite gradient on rank(s) [1]"), (rank, raised)
            assert (out["first"] in raised["message"]) == (rank == 1), (rank, raised)
            assert raised["unchanged"], (rank, k)
        assert out["raised"][0]["state"] == 0
        assert out["equal_to_clean_run"], rank


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", [dict(), dict(momentum_form="sum", update_rule="normuon", state_offload="cpu",
                                                tensor_lr=True)])
def test_the_decision_on_the_device_writes_what_the_host_decision_writes(case):
    results = launch(W.device_decision_matches_host, 2, case, timeout_s=240)
    for rank, out in results.items():
        assert out["equal"] == [True] * 6, (rank, out["equal"])
        for step, stats in enumerate(out["stats"]):
            assert stats["device"] == stats["host"], (rank, step, stats)
            assert stats["host"]["skipped"] == (step in (0, 2, 4)), (rank, step, stats)
        assert out["skipped_steps"] == {"host": 3, "device": 3}
        assert out["reads"] == "no host reads", (rank, out["reads"])
