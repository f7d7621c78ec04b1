"""apply_ep on 4 real gloo ranks: loss and every full gradient equal one process on the global batch.

One launch runs every case (process start-up is the slow part): ep in {1, 2, 4} with 4, 6 or 8
experts, and "starved" routers under which whole EP ranks and single experts receive no tokens.
The workers return plain tensors; the asserts and the single-process references run here.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard

from muonlab.launcher import launch

from . import _workers_ep as W

NUM_RANKS = 4
CASES = [
    (1, 4, False), (1, 8, False), (2, 4, False), (2, 6, False), (2, 8, False), (4, 4, False),
    (4, 8, False), (2, 4, True), (2, 8, True), (4, 8, True),
]
BAD_MESHES = [(3, None), (2, 3), (0, None)]
BAD_EXPERTS = [(2, 3), (4, 6)]
RTOL = 1e-5


@pytest.fixture(scope="module")
def results():
    return launch(W.everything, NUM_RANKS, CASES, BAD_MESHES, BAD_EXPERTS, timeout_s=240)


@pytest.fixture(scope="module")
def references():
    return {case: W.single_process(NUM_RANKS, case[1], case[2], case[0]) for case in CASES}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"ep{c[0]}-E{c[1]}{'-starved' if c[2] else ''}")
def test_loss_and_grads_match_single_process(results, references, case):
    ref_loss, ref_grads = references[case]
    for rank, res in results.items():
        got = res["cases"][case]
        assert got["loss"] == pytest.approx(ref_loss, rel=RTOL), (rank, got["loss"], ref_loss)
        assert set(got["grads"]) == set(ref_grads)
        for name, ref in ref_grads.items():
            g = got["grads"][name]
            assert g.shape == ref.shape, (rank, name)
            err = float((g - ref).norm() / ref.norm().clamp_min(1e-30))
            assert err <= RTOL, (rank, name, err)


@pytest.mark.timeout(300)
def test_starved_experts_get_zero_grads(results, references):
    for ep, num_experts, starved in CASES:
        if not starved:
            continue
        dead = W.dead_experts(num_experts, ep)
        live = [e for e in range(num_experts) if e not in dead]
        _, ref = references[(ep, num_experts, starved)]
        for res in results.values():
            g = res["cases"][(ep, num_experts, starved)]["grads"]["blocks.0.mlp.w_in"]
            assert torch.count_nonzero(g[dead]) == 0
            assert all(torch.count_nonzero(g[e]) > 0 for e in live)


@pytest.mark.timeout(300)
def test_mesh_layout_ep_groups_are_consecutive_ranks(results):
    for rank, res in results.items():
        assert res["mesh_ranks"] == {1: [[0], [1], [2], [3]], 2: [[0, 1], [2, 3]], 4: [[0, 1, 2, 3]]}
        for ep, coords in res["coords"].items():
            assert coords == (rank // ep, rank % ep), (rank, ep)


@pytest.mark.timeout(300)
def test_expert_banks_hold_local_experts_sharded_over_fsdp(results):
    for rank, res in results.items():
        for (ep, num_experts, _), got in res["cases"].items():
            num_local = num_experts // ep
            ep_rank, fsdp = rank % ep, NUM_RANKS // ep
            assert set(got["banks"]) == {"blocks.0.mlp.w_in", "blocks.0.mlp.w_out"}
            for name, bank in got["banks"].items():
                assert bank["ep_rank"] == ep_rank and bank["ep_size"] == ep
                assert bank["num_global"] == num_experts
                assert bank["global_experts"] == list(range(ep_rank * num_local, (ep_rank + 1) * num_local))
                assert bank["global_shape"][0] == num_local
                assert bank["mesh_dims"] == ("fsdp",) and bank["placements"] == repr((Shard(0),))
                # torch.chunk over the fsdp axis: 3 local experts on 2 ranks are 2 + 1
                chunks = torch.arange(num_local).chunk(fsdp)
                fsdp_rank = rank // ep
                expected = len(chunks[fsdp_rank]) if fsdp_rank < len(chunks) else 0
                assert bank["local_shape"][0] == expected, (rank, ep, num_experts, name)


@pytest.mark.timeout(300)
def test_bad_sizes_raise_clear_value_errors(results):
    res = results[0]
    assert "ep=3" in res["mesh_errors"][(3, None)] and "world size 4" in res["mesh_errors"][(3, None)]
    assert "ep=2" in res["mesh_errors"][(2, 3)] and "fsdp=3" in res["mesh_errors"][(2, 3)]
    assert "ep must be a positive int" in res["mesh_errors"][(0, None)]
    assert "'ep'" in res["mesh_errors"]["1-D"]
    for (ep, num_experts), (msg, unchanged) in res["expert_errors"].items():
        assert msg is not None and f"num_experts={num_experts}" in msg and f"ep={ep}" in msg
        assert unchanged, "apply_ep changed the model before raising"
