"""The distributed wrappers' fixes on 2 real gloo ranks: apply_ep and parallelize refuse a model that a
wrapper already holds (before changing it), a MoE shared by two blocks is placed once, parallelize
checks everything before it moves the model, mesh sizes follow check_whole's rule, and mesh
sub-groups get the collective timeout of the default group.

One launch runs every case (_workers_dist_wrapper_fixes.wrapper_checks); the asserts run here.
"""

from __future__ import annotations

import pytest

from muonlab.launcher import launch
from tests.distributed import _workers_dist_wrapper_fixes as workers

NUM_RANKS = 2
TIMEOUT_S = 60


@pytest.fixture(scope="module")
def reports():
    return launch(workers.wrapper_checks, NUM_RANKS, timeout_s=TIMEOUT_S)


@pytest.mark.timeout(240)
def test_apply_ep_refuses_a_parallelized_model_before_changing_it(reports):
    for report in reports.values():
        twice = report["twice"]
        assert twice["ep_twice"]["err"].startswith("ValueError: MoE layer 0's w_in already holds this rank's experts")
        assert "apply_ep was already applied" in twice["ep_twice"]["err"]
        for label in ("ep_after_fsdp", "ep_after_root_fsdp"):
            assert twice[label]["err"].startswith("ValueError: MoE layer 0's w_in is already a DTensor"), label
        for label in ("ep_twice", "ep_after_fsdp", "ep_after_root_fsdp"):
            assert twice[label]["unchanged"], f"{label}: apply_ep changed the model before refusing it"


@pytest.mark.timeout(240)
def test_parallelize_refuses_to_nest_wrappers(reports):
    for report in reports.values():
        # None: the call nested one wrapper in another without a word
        errors = {label: report["twice"][label] or "" for label in ("ddp_twice", "ddp_over_fsdp", "fsdp_over_ddp")}
        assert "already wrapped in DistributedDataParallel" in errors["ddp_twice"], errors
        assert "already wrapped in DistributedDataParallel" in errors["fsdp_over_ddp"], errors
        assert "already FSDP-sharded" in errors["ddp_over_fsdp"], errors
        for label, err in errors.items():
            assert err.startswith("ValueError: parallelize(mode"), (label, err)


@pytest.mark.timeout(240)
def test_a_moe_shared_by_two_blocks_is_sliced_once(reports):
    for rank, report in reports.items():
        shared = report["shared"]
        assert shared["err"] is None, shared["err"]
        assert shared["bank_is_my_experts"], rank
        assert shared["loss"] == pytest.approx(shared["reference_loss"], rel=1e-5)


@pytest.mark.timeout(240)
def test_parallelize_checks_everything_before_moving_the_model(reports):
    for report in reports.values():
        cases = report["before_moving"]
        expected = {
            "hsdp_no_mesh": "ValueError: mode 'hsdp' needs a 2-D mesh",
            "fsdp_2d_mesh": "ValueError: mode 'fsdp' needs a 1-D mesh",
            "ep_not_divisible": "ValueError: num_experts=3 (MoE layer 0) is not divisible by ep=2",
            "ep_on_a_dense_model": "ValueError: apply_ep found no muonlab MoE layer",
            "fsdp_bad_blocks": "TypeError: apply_fsdp expects model.layers to be an nn.ModuleList",
            "ddp_2d_mesh": "ValueError: mode 'ddp' needs a 1-D mesh",
            "ddp_block_attr": "ValueError: block_attr is read in 'fsdp', 'hsdp' and 'ep' modes only, "
                              "got block_attr='blocks' with mode 'ddp'",
            "ddp_reshard": "ValueError: reshard_after_forward is read in 'fsdp', 'hsdp' and 'ep' modes only, "
                           "got reshard_after_forward=False with mode 'ddp'",
        }
        for label, start in expected.items():
            assert (cases[label]["err"] or "").startswith(start), (label, cases[label]["err"])
            assert cases[label]["moved"] == [], f"{label}: the model was moved before the call was refused"
        # options left out still mean "blocks" and resharding in fsdp mode, and a good call moves once
        assert cases["fsdp_default"] == dict(moved=["GPT"], blocks_sharded=True)


@pytest.mark.timeout(240)
def test_mesh_sizes_follow_check_whole(reports):
    sizes = reports[0]["sizes"]
    assert sizes["ep_none"] == "ValueError: ep must be a positive int (a whole number >= 1), got None"
    assert sizes["ep_float"].startswith("ValueError: ep must be a positive int")
    assert sizes["replicate_none"].startswith("ValueError: replicate must be a positive int")
    for label in ("ep_numpy", "mesh_numpy", "hsdp_numpy"):
        assert sizes[label] is None, (label, sizes[label])
    # train_worker's own check accepts numpy ints; so do the meshes it builds
    assert reports[0]["train_worker_numpy"] is None, reports[0]["train_worker_numpy"]


@pytest.mark.timeout(240)
def test_mesh_groups_get_the_default_groups_timeout(reports):
    for report in reports.values():
        assert report["timeouts"] == dict.fromkeys(report["timeouts"], float(TIMEOUT_S))
