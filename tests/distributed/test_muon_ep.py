"""Muon on the expert-parallel MoE GPT (EP x FSDP2 on 4 gloo ranks) equals single-process Muon.

One launch runs every case (process start-up dominates): E in {2, 3, 4, 6, 8} experts with ep in
{1, 2} (E=3 with ep=2 must be refused by apply_ep), 3 steps with fp32 Newton-Schulz and an fp32
wire, plus one case with a bf16 wire and bf16 Newton-Schulz. Checked per case: the parameters after
training (expert banks gathered back into global banks) against one process on the global batch,
the plan identical on every rank, the bytes counted at the collectives equal to the plan's bytes
for this rank, and the plan equal to ``muonlab.simulate.simulate`` from shapes alone.
"""

from __future__ import annotations

import pytest

from muonlab.launcher import launch

from . import _workers_muon_ep as W
from ._common import cloned, nonzero, rel_displacement
from ._memory import assert_counted

NUM_RANKS = 4
INVALID = [(2, 3, "fp32")]
DENSE = (2, 0, "fp32")  # a model without MoE layers: apply_ep was silently FSDP over the world
# E=2 with ep=2: one expert per EP rank, a (1, out, in) bank that must still route to Muon
# ep=4 == world: a (1, 4) mesh whose one-rank fsdp axis leaves each rank its experts (each rank's
# load, not rank 0's alone, decides where the dense matrices go)
CASES = ([(ep, e, "fp32") for ep in (1, 2) for e in (2, 3, 4, 6, 8) if e % ep == 0] + [(2, 6, "bf16")]
         + [(4, 4, "fp32")])
# expert banks cut into parts by a workspace budget of one matrix: evenly held (8 on 4 ranks) and
# rebalanced (6 on 4 ranks: 2,2,2,0)
PART_CASES = [(1, 8, W.PARTS), (1, 6, W.PARTS)]
# NorMuon (its row second moments with the experts; the dense matrices' norms summed over fsdp),
# on EP x FSDP2 and with banks in parts
RULE_CASES = [(2, 6, W.NORMUON), (1, 6, W.NORMUON_PARTS)]
TOLERANCE = {"fp32": 1e-5, "bf16": 3e-2, W.PARTS: 1e-5, W.NORMUON: 1e-5, W.NORMUON_PARTS: 1e-5}


def _id(case) -> str:
    ep, e, precision = case
    return f"ep{ep}-E{e}-{precision}"


@pytest.fixture(scope="module")
def results():
    return launch(W.everything, NUM_RANKS, INVALID + [DENSE] + CASES + PART_CASES + RULE_CASES, timeout_s=300)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", INVALID, ids=_id)
def test_experts_not_divisible_by_ep_are_refused(results, case):
    ep, num_experts, _ = case
    for rank, res in results.items():
        msg = res[case]["error"]
        assert msg is not None, f"apply_ep accepted {num_experts} experts with ep={ep} on rank {rank}"
        assert f"num_experts={num_experts}" in msg and f"ep={ep}" in msg, msg


@pytest.mark.timeout(400)
def test_a_model_without_experts_is_refused(results):
    for rank, res in results.items():
        msg = res[DENSE]["error"]
        assert msg is not None and "found no muonlab MoE layer under model.blocks" in msg, (rank, msg)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", CASES + PART_CASES + RULE_CASES, ids=_id)
def test_matches_single_process(results, case):
    ep, num_experts, precision = case
    # banks in parts: against the reference without parts (one process, no budget)
    unparted = {W.PARTS: "fp32", W.NORMUON_PARTS: W.NORMUON}
    ref = W.single_process(NUM_RANKS, num_experts, unparted.get(precision, precision))
    start = cloned(W.build_model(num_experts).named_parameters())
    tol = TOLERANCE[precision]
    for rank, res in results.items():
        got = res[case]["params"]
        assert set(got) == set(ref)
        assert all(got[n].shape == ref[n].shape for n in ref), rank
        err = rel_displacement(got, ref, start)
        assert err <= tol, (case, rank, err)
        # each expert bank on its own: a matrix orthogonalized on the wrong rank shows up here
        for n in ("blocks.0.mlp.w_in", "blocks.0.mlp.w_out"):
            e = rel_displacement({n: got[n]}, {n: ref[n]}, {n: start[n]})
            assert e <= 10 * tol, (case, rank, n, e)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", CASES + PART_CASES, ids=_id)
def test_plan_identical_and_bytes_measured_equal_plan_bytes(results, case):
    plans = [res[case]["plan"] for res in results.values()]
    assert all(p == plans[0] for p in plans), "ranks planned differently"
    paths = sorted({row[0] for row in plans[0]})
    assert "gather_all" not in paths
    groups = results[0][case]["groups"]
    for row, group in zip(plans[0], groups):
        path, names = row[0], row[1]
        if any(n.endswith(("w_in", "w_out")) for n in names):
            # expert banks: whole matrices on the "fsdp" axis of the (fsdp, ep) mesh
            assert path in ("local", "rebalance"), (names, path)
            assert group == ("fsdp", NUM_RANKS // case[0]), group
            assert (sum(row[3]) > 0) == (path == "rebalance") == bool(row[6]), row
        else:
            assert path in ("all_to_all", "agrs"), (names, path)
            assert group[1] == NUM_RANKS, group
    for rank, res in results.items():
        r = res[case]
        assert r["expert_group_ranks_agree"], rank  # GroupKey.local_ranks == mesh["fsdp"] coordinate
        assert nonzero(r["sent"]) == r["plan_sent"], (rank, r["sent"], r["plan_sent"])
        assert nonzero(r["recv"]) == r["plan_recv"], (rank, r["recv"], r["plan_recv"])
        assert_counted(r, (case, rank))  # planned buffer bytes == counted, exactly
        expected = {"comm_out", "comm_back", "momentum", "update"} | ({"newton_schulz"} if r["plan_flops"] else set())
        assert expected <= set(r["spans"]), (rank, r["spans"])


SIM_CASES = CASES + PART_CASES


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", PART_CASES, ids=_id)
def test_banks_over_the_budget_run_in_parts(results, case):
    """A budget of one matrix: each bank runs as P parts, P the most matrices of it a rank holds,
    and moves the bytes of the plan without parts (that the parts cover every matrix once, within
    the budget on every rank: tests/unit/test_plan.py)."""
    ep, num_experts, _ = case
    plan = results[0][case]["plan"]
    banks = [row for row in plan if any(n.endswith(("w_in", "w_out")) for n in row[1])]
    parts = {}
    for row in banks:
        assert row[7] is not None, row
        parts.setdefault(row[1], []).append(row[7])
    per_rank = -(-num_experts // (NUM_RANKS // ep))  # matrices of a bank a rank holds at most
    for name, ps in parts.items():
        assert sorted(ps) == [(p, per_rank) for p in range(per_rank)], (name, ps)

    def bank_bytes(rows):
        return sum(sum(r[3]) for r in rows if any(n.endswith(("w_in", "w_out")) for n in r[1]))

    assert bank_bytes(plan) == bank_bytes(results[0][(ep, num_experts, "fp32")]["plan"])


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", SIM_CASES, ids=_id)
def test_simulated_plan_equals_the_runtime_plan(results, case):
    """muonlab.simulate.simulate with mesh (fsdp, ep) gives the plan the workers ran and measured."""
    from muonlab.simulate import simulate

    ep, num_experts, precision = case
    dtype = W.DTYPES["fp32" if precision == W.PARTS else precision]
    budget = dict(workspace_bytes=1) if precision == W.PARTS else {}
    sim = simulate(W.build_model(num_experts), (NUM_RANKS // ep, ep), profile="cpu_gloo", comm_dtype=dtype,
                   ns_dtype=dtype, device="cpu", **budget)  # the workers' dtype and device (gloo on the CPU)
    runtime = [row[:4] + row[5:6] + row[7:8] for row in results[0][case]["plan"]]
    assert [(b.path, b.names, b.owners, b.bytes_sent, b.flops, b.part) for b in sim] == runtime


@pytest.mark.timeout(400)
def test_paths_taken_across_cases(results):
    seen = {case: sorted({row[0] for row in results[0][case]["plan"]}) for case in CASES}
    for case, paths in seen.items():
        print(f"{_id(case)}: {paths}")
    union = set().union(*seen.values())
    assert {"local", "all_to_all"} <= union, seen
    # experts that don't spread evenly over the fsdp axis (6 on 4 ranks: 2,2,2,0; 3 on 2: 2,1;
    # 1 on 2: 1,0) leave a rank idle or overloaded: the planner moves whole matrices for balance
    rebalanced = [case for case, paths in seen.items() if "rebalance" in paths]
    assert rebalanced, seen
    per_ep_rank, fsdp = (lambda case: case[1] // case[0]), (lambda case: NUM_RANKS // case[0])
    assert all(per_ep_rank(case) % fsdp(case) for case in rebalanced), rebalanced
