"""muonlab.Muon on a tiny Llama that the user sharded or replicated with torch's own APIs.

Two launches of 2 gloo ranks cover every case (process start-up dominates on 2 cores):
  1  FSDP2 (fully_shard per decoder layer + root), 3 steps; DDP, 3 steps; the checkpoint run:
     4 steps straight, then 2 steps + save
  2  new processes: load the checkpoint, train steps 2 and 3
"""

from __future__ import annotations

import pytest
import torch

from muonlab.launcher import launch
from tests.distributed._common import rel_displacement

from . import _workers as W


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("hf_ckpt"))
    first = launch(W.first_launch, W.WORLD, root, timeout_s=240)
    second = launch(W.second_launch, W.WORLD, root, timeout_s=180)
    return first, second


@pytest.fixture(scope="module")
def reference():
    start = {n: p.detach().clone() for n, p in W.build_llama().named_parameters()}
    return start, W.single_process()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["fsdp2", "ddp"])
def test_user_wrapped_llama_matches_single_process(runs, reference, mode):
    first, _ = runs
    start, ref = reference
    for rank, res in first.items():
        got = res[mode]
        assert got["params"].keys() == ref.keys()
        err = rel_displacement(got["params"], ref, start)
        assert err <= 1e-5, (mode, rank, err)
        # each matrix on its own too: a matrix orthogonalized from the wrong shard or sent back to
        # the wrong rows hides in the total when the other matrices are right
        for name in ref:
            if ref[name].ndim == 2:
                e = rel_displacement({name: got["params"][name]}, {name: ref[name]}, {name: start[name]})
                assert e <= 1e-4, (mode, rank, name, e)
    # every rank planned the same collectives, and none fell back to gathering everything
    plans = [res[mode]["plan"] for res in first.values()]
    assert all(p == plans[0] for p in plans)
    paths = {path for path, _ in plans[0]}
    assert "gather_all" not in paths, paths
    if mode == "ddp":
        assert paths == {"owner"}, paths


@pytest.mark.timeout(600)
def test_user_sharded_gpt2_under_normuon_matches_single_process(runs):
    """HF GPT-2's Conv1D weights are stored (in, out): NorMuon normalises their stored columns,
    whose sums of squares span the ranks holding their rows under FSDP2."""
    first, _ = runs
    start = {n: p.detach().clone() for n, p in W.build_gpt2().named_parameters()}
    ref = W.single_process(build=W.build_gpt2, update_rule="normuon")
    for rank, res in first.items():
        got = res["gpt2_normuon"]
        assert len(got["transposed"]) == 4 * W.GPT2_CFG["n_layer"], got["transposed"]
        assert all(sums > 0 for _, names, sums in got["plan"] if set(names) & set(got["transposed"]))
        for name in got["transposed"]:  # 4e-6 measured: summation order
            e = rel_displacement({name: got["params"][name]}, {name: ref[name]}, {name: start[name]})
            assert e <= 2e-5, (rank, name, e)
        # not the AdamW parameters as a whole: the key bias of c_attn has a gradient of 0 up to
        # rounding (softmax ignores a constant added to every key), which AdamW scales up to a step,
        # so its displacement is rounding noise (3.6e-4 of it between ranks and one process)


def test_fsdp2_parameters_were_really_sharded(runs):
    # the comparison above only means something if fully_shard turned every parameter into a
    # DTensor (and DDP left them plain)
    first, _ = runs
    names = {n for n, _ in W.build_llama().named_parameters()}
    for res in first.values():
        assert set(res["fsdp2"]["sharded"]) == names
        assert res["ddp"]["sharded"] == []


@pytest.mark.timeout(600)
def test_fsdp2_checkpoint_resumes_bit_for_bit_in_new_processes(runs):
    first, second = runs
    for rank in first:
        saved, resumed = first[rank]["ckpt"], second[rank]["resume"]
        assert resumed["step"] == W.CKPT_SAVE_AT
        for name, p in saved["saved"].items():
            assert torch.equal(resumed["loaded"][name], p), f"rank {rank}: {name} differs right after load"
        for name, p in saved["straight"].items():
            assert torch.equal(resumed["params"][name], p), f"rank {rank}: {name} differs at step {W.CKPT_TOTAL}"
        # the losses of the straight run's steps 2, 3 come back exactly: the resumed optimizer
        # state (momentum, AdamW moments, step counts) is the saved one, not a fresh one
        assert saved["saved_losses"] + resumed["losses"] == saved["straight_losses"]
    # training moved the parameters between the save and step 4 (the check above is not vacuous)
    any_rank = first[0]["ckpt"]
    assert any(not torch.equal(any_rank["saved"][n], any_rank["straight"][n]) for n in any_rank["saved"])
