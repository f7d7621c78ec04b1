"""Megabatches across gloo ranks: several matrices per owner in one all_to_all batch equal one process.

One launch per world size runs the FSDP2 cases and the hand-made path batches.
"""

from collections import Counter

import pytest
import torch

from muonlab.launcher import launch
from muonlab.kernels.newton_schulz import newton_schulz

from . import _workers_megabatch as W
from ._common import nonzero
from ._memory import assert_counted

# (workspace_bytes, waves): None, the default budget (every bucket one batch); 1 byte: one matrix
# per owner per batch, so the buckets are cut into several. waves: the default CPU profile, under
# which these small batches travel as waves; without, a profile of no latency (each batch alone)
CASES = [(None, False), (1, False), (None, True)]
TOLERANCE = 1e-6  # fp32 on the wire and in Newton-Schulz


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def world_results(request):
    world = request.param
    return world, launch(W.everything, world, CASES, timeout_s=240)


@pytest.mark.timeout(600)
def test_fsdp2_updates_equal_one_process_with_several_matrices_per_owner(world_results):
    """Parameters within 1e-6 of one process's (relative to their largest entry), and so are the
    displacements where both run Newton-Schulz one matrix per call (the 1-byte budget: exact here).
    Without a budget an owner orthogonalizes its matrices as one stack and the single process a
    bucket's as another, and batched products round differently with the stack (up to 1e-6 of an
    entry per Newton-Schulz in fp32): the displacements then agree to 1e-5 (6e-6 measured)."""
    world, results = world_results
    start = {n: W.init_tensor(shape, seed) for seed, (n, shape) in enumerate(W.fsdp_shapes(world))}
    for case in CASES:
        ref = W.single_process(world, case[0])
        moved_tolerance = TOLERANCE if case[0] == 1 else 10 * TOLERANCE
        plans = [res["fsdp"][case]["plan"] for res in results.values()]
        assert all(p == plans[0] for p in plans), case
        for rank, res in results.items():
            got = res["fsdp"][case]["params"]
            for name, want in ref.items():
                err = _relative(got[name], want)
                moved = _relative(got[name] - start[name], want - start[name])
                assert err <= TOLERANCE and moved <= moved_tolerance, (world, case, rank, name, err, moved)


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.mark.timeout(600)
def test_fsdp2_megabatches_count_the_bytes_and_calls_they_plan(world_results):
    world, results = world_results
    unbudgeted, budgeted, _ = (results[0]["fsdp"][case]["plan"] for case in CASES)
    moving = [row for row in unbudgeted if row[0] in ("all_to_all", "agrs")]
    # one batch per shape: the FSDP2 model has four
    assert len(moving) == 4, unbudgeted
    assert any(len(set(row[2])) < len(row[2]) for row in moving)  # an owner of several in one batch
    assert any(0 in row[3] for row in moving) == (world == 4)  # empty trailing shards at 4 ranks
    # a budget of one matrix: no owner gathers two at once, in more batches
    assert all(len(set(row[2])) == len(row[2]) for row in budgeted if row[0] in ("all_to_all", "agrs"))
    assert len(budgeted) > len(unbudgeted)
    for case in CASES:
        for rank, res in results.items():
            r = res["fsdp"][case]
            assert nonzero(r["sent"]) == r["plan_sent"], (case, rank)
            assert nonzero(r["recv"]) == r["plan_recv"], (case, rank)
            assert_counted(r, (case, rank))  # planned buffer bytes == counted, waves too
            planned = Counter()
            for path, *_, collectives, _wave in r["plan"]:
                planned[path] += collectives
            assert all(calls == {p: n for p, n in planned.items() if n} for calls in r["calls"]), (case, rank)
    calls = sum(results[0]["fsdp"][(None, False)]["calls"][-1].values())
    assert calls == 8, calls  # 4 shapes, one collective each way


@pytest.mark.timeout(600)
def test_fsdp2_waves_send_small_batches_together_with_the_same_updates(world_results):
    """Under the default CPU profile these small batches are latency-bound: consecutive all_to_all
    batches travel as one wave (one collective each way for the wave), and the parameters are bit
    for bit those of the same plan's batches sent one by one."""
    world, results = world_results
    alone, waves = (None, False), (None, True)
    for rank, res in results.items():
        plan = res["fsdp"][waves]["plan"]
        assert [row[:4] for row in plan] == [row[:4] for row in res["fsdp"][alone]["plan"]], rank
        in_waves = [row for row in plan if row[5] is not None]
        assert len(in_waves) >= 3 and all(row[0] == "all_to_all" for row in in_waves), plan
        first_batches = {row[5] for row in in_waves}
        collectives = sum(row[4] for row in plan)
        assert collectives == 2 * len(first_batches) + sum(row[4] for row in plan if row[5] is None), plan
        assert all(sum(calls.values()) == collectives for calls in res["fsdp"][waves]["calls"]), rank
        assert collectives < 8
        for name, want in res["fsdp"][alone]["params"].items():
            assert torch.equal(res["fsdp"][waves]["params"][name], want), (rank, name)


@pytest.mark.timeout(600)
def test_each_path_returns_every_rank_its_rows_of_the_orthogonalized_matrices(world_results):
    """all_to_all and agrs with owners chosen by hand: repeated, and at 4 ranks owners with one
    row or none; each rank's outputs are its rows of Newton-Schulz on the whole matrix."""
    world, results = world_results
    batches = W.path_batches(world)
    for rank, res in results.items():
        for batch, got in zip(batches, res["paths"]):
            assert got["calls"] == 2 and got["counted"] == got["planned"], (batch.path, rank, got)
            offset = sum(batch.rows[:rank])
            for whole, out in zip(_orthogonalized_as_owners_stack_them(batch), got["outputs"]):
                want = whole[offset:offset + batch.rows[rank]]  # empty on a rank holding no rows
                assert out.shape == want.shape, (batch.path, rank)
                assert torch.allclose(out, want, rtol=0, atol=TOLERANCE * float(whole.abs().max())), \
                    (batch.path, batch.owners, rank, out, want)


def _orthogonalized_as_owners_stack_them(batch) -> list[torch.Tensor]:
    """Newton-Schulz of each matrix of ``batch``, computed as its owner does, in one stack of the
    owner's matrices in batch order (batched products round a little differently from one matrix
    alone: up to 1e-6 of the largest entry in fp32 here)."""
    mats = W.path_matrices(batch)
    out = [None] * len(mats)
    for o in set(batch.owners):
        mine = [pos for pos, owner in enumerate(batch.owners) if owner == o]
        for pos, result in zip(mine, newton_schulz(torch.stack([mats[p] for p in mine]), batch.ns_config)):
            out[pos] = result
    return out
