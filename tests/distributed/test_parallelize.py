"""parallelize() on 4 real gloo ranks (every mode, its return value, its errors), and MeshAxis.

One launch runs every mode (process start-up is the slow part); the workers return plain data and
the asserts, with the single-process references, run here.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from muonlab.distributed import MeshAxis, parallelize
from muonlab.launcher import launch

from . import _workers_parallelize as W

NUM_RANKS = 4


@pytest.fixture(scope="module")
def reports():
    return launch(W.parallelize_checks, NUM_RANKS, timeout_s=150)


@pytest.fixture(scope="module")
def reference_losses():
    out = {}
    for moe in (False, True):
        x = W.batch()
        with torch.no_grad():
            out[moe] = float(W.build_model(moe)(x, x))
    return out


def test_mesh_axis_is_its_string():
    assert [a.value for a in MeshAxis] == ["dp", "replicate", "shard", "fsdp", "ep", "tp"]
    assert MeshAxis.EP == "ep" and isinstance(MeshAxis.FSDP, str)
    assert str(MeshAxis.SHARD) == "shard" and f"{MeshAxis.DP}" == "dp"
    assert {"ep": 1}[MeshAxis.EP] == 1 and MeshAxis("fsdp") is MeshAxis.FSDP


def test_bad_mode_is_refused_before_any_process_group():
    with pytest.raises(ValueError, match="'zero3'"):
        parallelize(torch.nn.Linear(2, 2), "zero3")


@pytest.mark.timeout(180)
def test_fsdp_and_hsdp(reports, reference_losses):
    for report in reports.values():
        fsdp, hsdp = report["fsdp"], report["hsdp"]
        assert fsdp["inner_is_model"] and hsdp["inner_is_model"]
        assert fsdp["mesh_axes"] == (MeshAxis.DP,) and fsdp["mesh_shape"] == (NUM_RANKS,)
        assert fsdp["head_placements"] == [repr(Shard(0))]
        assert hsdp["mesh_axes"] == (MeshAxis.REPLICATE, MeshAxis.SHARD) and hsdp["mesh_shape"] == (2, 2)
        assert hsdp["head_placements"] == [repr(Replicate()), repr(Shard(0))]
        for r in (fsdp, hsdp):
            assert r["loss"] == pytest.approx(reference_losses[False], rel=1e-6)
        assert report["shard_group_size"] == 2


@pytest.mark.timeout(180)
def test_ddp_returns_the_wrapper_and_the_module_for_the_optimizer(reports, reference_losses):
    for report in reports.values():
        ddp = report["ddp"]
        assert ddp["model_type"] == "DistributedDataParallel" and ddp["inner_type"] == "GPT"
        assert not ddp["inner_is_model"] and ddp["mesh_axes"] is None
        # the optimizer sees the same names as under FSDP: no "module." prefix
        assert ddp["muon_names"] == report["fsdp"]["muon_names"]
        assert ddp["loss"] == pytest.approx(reference_losses[False], rel=1e-6)


@pytest.mark.timeout(180)
def test_ep(reports, reference_losses):
    for rank, report in reports.items():
        ep = report["ep"]
        assert ep["inner_is_model"]
        assert ep["mesh_axes"] == (MeshAxis.FSDP, MeshAxis.EP) and ep["mesh_shape"] == (2, 2)
        assert ep["ep_sizes"] == [2] and ep["ep_rank"] == rank % 2
        assert ep["loss"] == pytest.approx(reference_losses[True], rel=1e-5)


def _assert_errors_say(errors: dict, expected: dict) -> None:
    """Every case of ``expected`` raised, and its error text holds each of the expected parts."""
    assert set(errors) == set(expected)
    for case, parts in expected.items():
        assert errors[case] is not None, f"{case}: no error raised"
        for part in parts:
            assert part in errors[case], (case, part, errors[case])


@pytest.mark.timeout(180)
def test_errors_name_the_bad_value(reports):
    errors = reports[0]["errors"]
    expected = {
        "bad_mode": ["ValueError", "'zero3'", "'fsdp'"],
        "ep_in_fsdp": ["ValueError", "ep=2", "'fsdp'"],
        "hsdp_no_mesh": ["ValueError", "'hsdp'", "build_mesh(replicate="],
        "fsdp_2d_mesh": ["ValueError", "'fsdp'", "1-D", "['replicate', 'shard']"],
        "hsdp_1d_mesh": ["ValueError", "'hsdp'", "2-D", "['dp']"],
        "ep_no_size": ["ValueError", "'ep'", "build_ep_mesh"],
        "ep_and_mesh": ["ValueError", "ep=2", "(4,)"],
        "ep_flat_mesh": ["ValueError", "apply_ep", "['dp']"],
        "mp_policy_ddp": ["ValueError", "mp_policy", "'ddp'"],
    }
    _assert_errors_say(errors, expected)


# ---------------------------------------------------------------------------------- any model


@pytest.fixture(scope="module")
def any_model_references():
    return {kind: W.train_single_process(kind) for kind in ("mlp", "noblocks")}


@pytest.mark.timeout(180)
def test_any_model_sharded_and_trained_with_muon_equals_one_process(reports, any_model_references):
    """An nn.Sequential MLP and a model with no repeated block, under FSDP2, HSDP and DDP, trained
    3 steps with Muon in fp32 on slices of the global batch: one process's parameters."""
    for rank, report in reports.items():
        cases = report["any_model"]
        for kind, mode, options in W.ANY_MODEL_CASES:
            case = cases[f"{kind}/{mode}/{sorted(options)}"]
            ref = any_model_references[kind]
            assert case["params"].keys() == ref.keys(), (rank, kind, mode)
            for name, value in case["params"].items():
                moved = (ref[name] - W.build_any(kind).state_dict()[name]).abs().max()
                assert moved > 1e-4, (kind, name, "the reference did not train")
                torch.testing.assert_close(value, ref[name], rtol=1e-5, atol=1e-6, msg=f"{rank} {kind} {mode} {name}")
            # every hidden Linear weight goes to Muon, as in one process
            assert case["muon"] == sorted(n for n in ref if n.endswith("weight") and ref[n].ndim == 2), case["muon"]


@pytest.mark.timeout(180)
def test_the_units_are_the_repeated_blocks_or_by_size(reports):
    for report in reports.values():
        cases = report["any_model"]
        # the Sequential's Linear layers are its blocks; its activations hold nothing to shard
        for mode in ("fsdp", "hsdp"):
            case = cases[f"mlp/{mode}/[]"]
            assert case["fsdp_units"] == ["0", "2", "4"], case["fsdp_units"]
            expected = [repr(Shard(0))] if mode == "fsdp" else [repr(Replicate()), repr(Shard(0))]
            assert case["placements"]["2.weight"] == expected
        assert cases["mlp/ddp/[]"]["placements"] == {}
        # nothing repeats: the root alone by default (under FSDP's 1e8 parameters), by size when asked
        assert cases["noblocks/fsdp/[]"]["fsdp_units"] == []
        assert cases["noblocks/fsdp/['min_unit_params']"]["fsdp_units"] == ["fc_in", "fc_out"]
        assert set(cases["noblocks/fsdp/[]"]["placements"]) == {n for n in cases["noblocks/fsdp/[]"]["params"]}


@pytest.mark.timeout(180)
def test_any_model_errors_name_the_fix(reports):
    errors = reports[0]["any_model"]["errors"]
    expected = {
        # the message of issue 32, now with what to do
        "sequential_named_blocks": ["TypeError: apply_fsdp expects model.blocks to be an nn.ModuleList or "
                                    "nn.Sequential of blocks, got NoneType on Sequential",
                                    "leave block_attr out to shard the blocks found", "3 x Linear"],
        "noblocks_named_layers": ["TypeError", "model.layers", "NoBlocks", "leave block_attr out to shard it by size"],
        "min_unit_params_ddp": ["ValueError", "min_unit_params is read in 'fsdp' and 'hsdp' modes only", "'ddp'"],
        "min_unit_params_zero": ["ValueError", "min_unit_params must be an integer >= 1", "got 0"],
    }
    _assert_errors_say(errors, expected)
