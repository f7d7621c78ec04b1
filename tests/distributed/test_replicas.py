"""Replicated (DDP) Muon matrices across steps whose owners change, calls that must not involve
the other ranks (muonlab.optim.muon: _relocate_momentum, plan(), process_group), gradients
laid out unlike their parameters, and replicas given different gradients (a model without DDP
on each rank's own data: check_ranks_agree when a plan is made, the step's control exchange at
any later step)."""

import math

import pytest
import torch

from muonlab.launcher import launch

from . import _workers_replicas as W
from ._common import rel_displacement


@pytest.mark.timeout(300)
def test_momentum_follows_a_replicated_matrix_to_its_new_owner():
    """With 'big' out of step 1, p1 or p2 changes owner: its momentum must move with it (it
    restarted from zero there, 0.41 off one process after 3 steps), and stays on one rank."""
    alone = W.train()
    results = launch(W.train, 2, timeout_s=120)
    for rank, out in results.items():
        for n, p in out["params"].items():
            torch.testing.assert_close(p, alone["params"][n], rtol=1e-5, atol=1e-5, msg=f"{n} on rank {rank}")
    holder = [{n: next(r for r in results if results[r]["held"][step][n]) for n in W.SHAPES}
              for step in range(W.STEPS)]  # (each momentum lives on exactly one rank)
    for step in range(W.STEPS):
        for n in W.SHAPES:
            holders = [r for r in results if results[r]["held"][step][n]]
            assert len(holders) == (1 if W.has_grad(n, 0) else 0), (step, n, holders)
    # each move's broadcast is in last_step_stats(): the bytes of the moved fp32 momentum, sent
    # by its old home, received by the other rank
    moves = 0
    for step in range(W.STEPS):
        moved = [n for n in W.SHAPES if step and holder[step][n] != holder[step - 1][n]]
        moves += len(moved)
        want = sum(4 * math.prod(W.SHAPES[n]) for n in moved)
        assert [sum(results[r]["moved"][step][k] for r in results) for k in (0, 1)] == [want, want], (step, moved)
    assert moves  # the test saw a move


@pytest.mark.timeout(300)
def test_matrices_of_one_shape_and_two_dtypes_batch_apart():
    """fp32 p1 and bf16 p2 (both 4 x 4): a batch of both handed Newton-Schulz pieces of two dtypes
    and failed, in one process (local path) and on the owner path alike. Each dtype is a batch."""
    alone = W.train(bf16=("p2",))
    assert alone["params"]["p2"].dtype == torch.bfloat16
    results = launch(W.train, 2, None, ("p2",), timeout_s=120)
    for rank, out in results.items():
        for n, p in out["params"].items():
            torch.testing.assert_close(p, alone["params"][n], rtol=1e-5, atol=1e-5, msg=f"{n} on rank {rank}")


@pytest.mark.timeout(300)
def test_consolidated_momentum_comes_from_where_it_lives():
    """consolidate_state() after the owners changed: every rank gets the current momentum (it
    broadcast from the all-parameter plan's owner, which may not hold it)."""
    alone = W.train(consolidate_at=1)
    results = launch(W.train, 2, 1, timeout_s=120)
    for rank, out in results.items():
        for n, buf in out["consolidated"].items():
            torch.testing.assert_close(buf, alone["consolidated"][n], rtol=1e-5, atol=1e-5, msg=f"{n} on {rank}")
        for n, p in out["params"].items():
            torch.testing.assert_close(p, alone["params"][n], rtol=1e-5, atol=1e-5, msg=f"{n} on rank {rank}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("init_first, then", [(False, None), (True, None), (False, "consolidate"), (False, "init")])
def test_each_rank_resuming_from_its_own_state_dict_finds_where_momentum_lies(init_first, then):
    """After owners moved, a rank's own state_dict holds the momentum it was home to, which need
    not be the owner a new optimizer plans: the first step asks which rank holds what (momentum
    was lost, 0.041 off an uninterrupted run). init_state()'s zeros, before the first step or
    after the load (consolidate_state makes them too), must not pass for that momentum."""
    alone = W.train()
    results = launch(W.resume_from_each_ranks_state_dict, 2, 1, init_first, then, timeout_s=120)
    for rank, out in results.items():
        for n, p in out["params"].items():
            torch.testing.assert_close(p, alone["params"][n], rtol=1e-5, atol=1e-5, msg=f"{n} on rank {rank}")


@pytest.mark.timeout(300)
def test_switching_to_the_redundant_strategy_and_back_keeps_momentum():
    """Under "redundant" every rank orthogonalizes every replicated matrix, so each needs the
    momentum that lived on its owner only (non-owners used zeros, the replicas drifted apart)."""
    alone = W.train()
    results = launch(W.switch_strategy, 2, 1, timeout_s=120)
    for rank, out in results.items():
        for n, p in out["params"].items():
            torch.testing.assert_close(p, alone["params"][n], rtol=1e-5, atol=1e-5, msg=f"{n} on rank {rank}")


@pytest.mark.timeout(300)
def test_release_on_one_rank_after_a_consolidation_runs_no_collective():
    results = launch(W.release_alone_after_consolidate, 2, timeout_s=60)
    held = [set(out["held"]) for out in results.values()]
    assert not held[0] & held[1] and held[0] | held[1] == set(W.SHAPES), held  # each on one rank


@pytest.mark.timeout(300)
def test_plan_on_one_rank_alone_runs_no_collective():
    results = launch(W.plan_on_one_rank, 2, timeout_s=60)
    assert results[0]["names"] == sorted(W.SHAPES) and results[1]["names"] is None


@pytest.mark.timeout(300)
def test_a_model_per_rank_under_a_group_of_its_own_runs_no_collective_with_the_others():
    results = launch(W.one_model_per_rank, 2, timeout_s=60)
    assert all(out["steps"] == 3 for out in results.values())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind, placements", [("replicate", r"\(Replicate\(\),\)"), ("shard1", r"\(Shard\(dim=1\),\)"),
                                              ("partial", r"\(Partial\(sum\),\)"),
                                              ("partial_on_replicate", r"\(Partial\(sum\),\)")])
def test_a_gradient_laid_out_unlike_its_parameter_is_refused_by_name(kind, placements):
    """It failed deep in the momentum code (other rows), or, a Partial gradient of a Replicate
    parameter, silently used the owner's share of the sum."""
    import re

    results = launch(W.grad_laid_out_unlike_its_parameter, 2, kind, timeout_s=60)
    for rank, out in results.items():
        assert out["error"] and re.search(rf"parameter 'w' of shape \(6, 4\) has a gradient with placements "
                                          rf"{placements}", out["error"]), (rank, out)
        assert out["unchanged"], rank


def _assert_every_rank_names_the_replica(results: dict, case, evidence: str = "") -> None:
    """Both ranks raised the same different-gradients error, naming a replicated parameter by its
    true shape (``evidence``: a pattern for the values compared) and the two ways out."""
    import re

    errors = {rank: out[case]["error"] for rank, out in results.items()}
    assert errors[0] and errors[0] == errors[1], (case, errors)
    m = re.match(r"replicated parameter '([\w.]+)' of shape (\(\d+, \d+\)) has equal weights but a different "
                 r"gradient on rank\(s\) 1 than on rank 0" + evidence, errors[0])
    assert m and str(results[0][case]["muon"][m[1]]) == m[2], (case, errors[0])
    assert 'parallelize(model, "ddp")' in errors[0] and "process_group=dist.new_group([rank])" in errors[0]


@pytest.mark.timeout(300)
def test_replicas_with_different_gradients_are_refused_by_name_before_anything_changes():
    """Forgot DDP: equal weights, each rank its own data, plain tensors under the default group.
    Each matrix took its owner rank's update on every rank, both ranks ended equal and 6e-4 to
    2.2e-2 away from training alone, with no error. The plan's checksum exchange compares the
    replicas' gradients too, fp32 and bf16 ones, on a fresh optimizer and after a step with equal
    gradients (state and AdamW step counts exist when the new plan refuses); a plan made outside
    a step (consolidate_state) or whose gradients held a NaN (skipped) is compared by the next
    step."""

    cases = [("fp32", None), ("bf16", None), ("fp32", "step"), ("fp32", "nan"), ("fp32", "consolidate")]
    results = launch(W.forgot_ddp_runs, 2, cases, timeout_s=120)
    for case in cases:
        _assert_every_rank_names_the_replica(results, case)
        for rank, out in results.items():
            assert out[case]["unchanged"], (case, rank)
            assert (out[case]["state"] > 0) == (case[1] in ("step", "consolidate")), (case, rank)
            assert out[case]["skipped"] == (case[1] == "nan"), (case, rank)


@pytest.mark.timeout(300)
def test_replicas_whose_gradients_part_ways_after_the_plan_are_refused_at_that_step():
    """The late form of forgetting DDP: the same rows on every rank at the first step(s), each
    rank's own from step 1 or 2, with the plan made and checked. Each matrix took its owner rank's
    gradient, the replicas stayed equal and 3e-4 to 2.9e-2 off their own one-process runs, with no
    error. Each step's control exchange carries a fingerprint of the replicated gradients: every
    rank raises the first-step case's error at the step it happens, before anything changes."""

    cases = [("fp32", 1), ("bf16", 1), ("fp32", 2)]
    results = launch(W.late_form_runs, 2, cases, timeout_s=120)
    for case in cases:
        _assert_every_rank_names_the_replica(results, case, r" \(gradient fingerprints -?\d+ vs -?\d+\)")
        for rank, out in results.items():
            assert out[case]["at"] == case[1], (case, rank, out[case]["at"])
            assert out[case]["unchanged"] and out[case]["momentum"] > 0, (case, rank)  # momentum existed, kept


@pytest.mark.timeout(300)
def test_ddp_replicas_pass_the_per_step_check_and_a_nan_on_one_rank_is_skipped():
    """Under DDP the fingerprints (taken at every step: none is 0) agree for many steps. A NaN
    put into one rank's gradient after the all-reduce makes that rank's fingerprint differ: the
    non-finite check's business (every rank skips, or raises its error), never a replica mismatch;
    the steps after it pass, and the replicas stay equal."""
    steps = 8
    results = launch(W.with_ddp, 2, "fp32", steps, None, timeout_s=120)
    for rank, out in results.items():
        assert not out["errors"] and out["skipped"] == 0, (rank, out["errors"])
        assert len(out["sent"]) == steps and all(out["sent"]), (rank, out["sent"])
    assert results[0]["sent"] == results[1]["sent"]
    for nonfinite in ("skip", "raise"):
        results = launch(W.with_ddp, 2, "fp32", 4, 2, nonfinite, timeout_s=120)
        got = [out["params"] for out in results.values()]
        assert all(torch.equal(got[0][n], got[1][n]) for n in got[0]), nonfinite
        for rank, out in results.items():
            if nonfinite == "skip":
                assert not out["errors"] and out["skipped"] == 1, (rank, out["errors"])
            else:
                assert list(out["errors"]) == [2] and out["errors"][2].startswith("non-finite gradient on rank(s) [1]"), \
                    (rank, out["errors"])


@pytest.mark.timeout(300)
def test_replicas_under_ddp_pass_the_gradient_check():
    """The same run under parallelize(model, "ddp"): gradients all-reduced, bit-identical on every
    rank (fp32 and bf16), so the check passes and the replicas train as one process on all rows."""
    results = launch(W.with_ddp_runs, 2, ("fp32", "bf16"), timeout_s=120)
    for precision in ("fp32", "bf16"):
        got = [out[precision] for out in results.values()]
        assert all(torch.equal(got[0][n], got[1][n]) for n in got[0]), precision
    start = {n: p.detach().clone() for n, p in W._gpt("fp32").named_parameters()}
    assert rel_displacement(results[0]["fp32"], W.single_process_global("fp32"), start) <= 1e-5


@pytest.mark.timeout(300)
def test_a_model_per_rank_under_its_own_group_trains_on_its_own_data():
    """process_group=dist.new_group([rank]), the other way the error suggests: each rank trains
    independently, as one process on its rows alone."""
    alone = W.model_per_rank(alone=True)
    results = launch(W.model_per_rank, 2, timeout_s=120)
    for rank, out in results.items():
        for n, p in out[rank].items():
            torch.testing.assert_close(p, alone[rank][n], rtol=1e-5, atol=1e-5, msg=f"{n} on rank {rank}")
    assert not all(torch.equal(alone[0][n], alone[1][n]) for n in alone[0])
