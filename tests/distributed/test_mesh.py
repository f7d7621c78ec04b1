"""build_mesh, mesh_axis_group, apply_fsdp and apply_ddp on 4 real gloo ranks.

One launch (process start-up costs seconds) runs every check in _workers_launch.mesh_checks; the
2-rank cases use the 2-rank "shard" sub-mesh. The workers return what they saw; asserts run here.
"""

from __future__ import annotations

import pytest
from torch.distributed.tensor import Replicate, Shard

from muonlab.launcher import launch
from tests.distributed import _workers_launch as workers

SHARD0 = repr(Shard(0))
REPLICATE = repr(Replicate())
NUM_RANKS = 4


@pytest.fixture(scope="module")
def reports():
    return launch(workers.mesh_checks, NUM_RANKS, timeout_s=150)


def _check_fsdp(report, placements, local_rows, global_rows) -> None:
    assert report["is_dtensor"] and report["grad_is_dtensor"]
    assert report["head_placements"] == placements
    assert report["grad_placements"] == placements
    assert report["head_global_shape"] == (global_rows, 4)
    assert report["head_local_shape"] == (local_rows, 4)
    # forward/backward ran, and the grads match one process on the same per-rank batches
    assert report["max_grad_err"] < 1e-6


@pytest.mark.timeout(180)
def test_launch_returns_each_of_four_ranks_values(reports):
    assert sorted(reports) == list(range(NUM_RANKS))
    for rank, report in reports.items():
        info = report["rank_info"]
        assert (info["rank"], info["world_size"]) == (rank, NUM_RANKS)
        assert info["rank_sum"] == sum(range(NUM_RANKS))
        assert info["num_threads"] == 1


@pytest.mark.timeout(180)
def test_build_mesh_1d_and_2d_axes(reports):
    for rank, report in reports.items():
        assert report["mesh1d"] == (("dp",), (4,), "cpu")
        assert report["dp_group_size"] == 4
        assert report["mesh2d"] == (("replicate", "shard"), (2, 2))
        assert report["mesh2d_inferred"] == (2, 2)
        # mesh [[0, 1], [2, 3]]: shard groups are its rows, replicate groups its columns
        assert report["shard_sum"] == (1 if rank < 2 else 5)
        assert report["replicate_sum"] == (2 if rank % 2 == 0 else 4)


@pytest.mark.timeout(180)
def test_build_mesh_bad_sizes_and_missing_axis(reports):
    report = reports[0]
    assert "dp=3" in report["bad_dp"] and "world size 4" in report["bad_dp"]
    assert "replicate=3" in report["bad_2d"] and "shard=2" in report["bad_2d"]
    assert "world size 4" in report["bad_2d"]
    assert "replicate=3" in report["bad_replicate"]
    assert "either dp" in report["bad_both"]
    assert "'tp'" in report["missing_axis"] and "['dp']" in report["missing_axis"]


@pytest.mark.timeout(180)
def test_fsdp_three_rows_on_two_ranks(reports):
    for rank, report in reports.items():
        _check_fsdp(report["fsdp_3_rows_2_ranks"], [SHARD0], [2, 1][rank % 2], 3)


@pytest.mark.timeout(180)
def test_fsdp_six_rows_on_four_ranks_has_an_empty_shard(reports):
    for rank, report in reports.items():
        _check_fsdp(report["fsdp_6_rows_4_ranks"], [SHARD0], [2, 2, 2, 0][rank], 6)


@pytest.mark.timeout(180)
def test_hsdp_on_a_2x2_mesh(reports):
    # 6 rows sharded over the "shard" axis (2 ranks: 3 + 3) and replicated over "replicate"
    for report in reports.values():
        _check_fsdp(report["hsdp_6_rows"], [REPLICATE, SHARD0], 3, 6)


@pytest.mark.timeout(180)
def test_ddp_forward_backward_on_all_ranks_and_on_a_subgroup(reports):
    for report in reports.values():
        for key in ("ddp_4_ranks", "ddp_2_ranks"):
            assert report[key]["type"] == "DistributedDataParallel"
            assert report[key]["max_grad_err"] < 1e-6


@pytest.mark.timeout(180)
def test_gpt_fsdp_and_hsdp_grads_match_one_process(reports):
    for report in reports.values():
        for key in ("gpt_fsdp_tied", "gpt_hsdp"):
            assert report[key]["is_dtensor"]
            assert report[key]["max_grad_err"] < 1e-5
