"""Megabatches: a bucket of same-shape row-sharded matrices travels as one all_to_all each way,
an owner gathering several of its matrices at once, cut only where the workspace budget says."""

from collections import Counter

import pytest

from muonlab.comm.planner import plan_batches
from muonlab.comm.records import flops_per_rank
from muonlab.comm.specs import GroupKey, MatrixSpec, chunk_sizes
from muonlab.kernels.config import NSConfig
from muonlab.models import GPT, GPTConfig
from muonlab.simulate import lower_bound_bytes, muon_shapes, simulate

CFG = NSConfig()
SMALL_GPT_SHAPES = [(24, 8), (8, 8), (32, 8), (8, 32)]
"""One layer's Muon matrices of GPT(d_model=8): qkv, attention out, mlp fc, mlp out."""


def _small_gpt():
    return GPT(GPTConfig(d_model=8, n_layers=12, n_heads=2))


def _row_specs(shapes, size):
    g = GroupKey(mesh_ranks=tuple(range(size)), mesh_shape=(size,), axis_name="dp")
    return [MatrixSpec(i, f"m{i}", s, "row_shard", g, chunk_sizes(s[0], size)) for i, s in enumerate(shapes)]


def _owned_per_rank(batch) -> list[int]:
    counts = Counter(batch.owners)
    return [counts[r] for r in range(batch.group.size)]


@pytest.mark.parametrize("world", [2, 4])
def test_48_small_matrices_travel_as_one_all_to_all_batch_per_shape(world):
    model = _small_gpt()
    assert sorted({s for _, s, _ in muon_shapes(model)}) == sorted(SMALL_GPT_SHAPES)
    plan = simulate(model, world, workspace_bytes=8 << 20)  # the CPU's default budget: 12 fit easily
    assert len(plan) == len(SMALL_GPT_SHAPES), plan.table()  # was 48 / world batches
    assert {b.path for b in plan} == {"all_to_all"}
    assert sorted(b.matrix_shape for b in plan) == sorted(SMALL_GPT_SHAPES)
    for b in plan:  # 12 matrices per bucket: each rank owns 12 / world of them
        assert b.num_matrices == 12 and _owned_per_rank(b) == [12 // world] * world
    assert sum(b.total_bytes for b in plan) == lower_bound_bytes(plan)
    loads = flops_per_rank(plan)
    assert max(loads) == min(loads), loads


@pytest.mark.parametrize("world", [2, 4])
def test_a_budget_cuts_a_bucket_so_no_owner_gathers_more_than_it_and_changes_no_totals(world):
    specs = _row_specs(SMALL_GPT_SHAPES * 12, world)
    unlimited = plan_batches(specs, [CFG] * len(specs))
    for cap in (1, 2, 4, 5):
        plan = plan_batches(specs, [CFG] * len(specs), max_local_matrices=lambda shape, cfg, cap=cap: cap)
        per_owner = 12 // world
        runs = -(-per_owner // cap)
        assert len(plan) == len(SMALL_GPT_SHAPES) * runs, (cap, plan.table())
        for b in plan:
            owned = _owned_per_rank(b)
            assert max(owned) <= cap and len(set(owned)) == 1, (cap, owned)  # even cuts: 6 under 4 -> 3 + 3
        assert sorted(i for b in plan for i in b.param_indices) == list(range(len(specs)))
        assert flops_per_rank(plan) == flops_per_rank(unlimited)
        assert [sum(x) for x in zip(*(b.bytes_sent for b in plan))] == \
            [sum(x) for x in zip(*(b.bytes_sent for b in unlimited))]


def test_uneven_and_empty_shards_keep_owner_shares_and_the_byte_formula():
    # 10 rows on 4 ranks: 3, 3, 3, 1; 2 rows on 4 ranks: 1, 1, 0, 0
    specs = _row_specs([(10, 6)] * 6 + [(2, 5)] * 5, 4)
    plan = plan_batches(specs, [CFG] * len(specs), row_assignment="structured", remainder_path="all_to_all")
    by_shape = {b.matrix_shape: b for b in plan}
    assert len(plan) == 2 and {b.path for b in plan} == {"all_to_all"}
    assert sorted(_owned_per_rank(by_shape[(10, 6)])) == [1, 1, 2, 2]
    assert sorted(_owned_per_rank(by_shape[(2, 5)])) == [1, 1, 1, 2]
    for b in plan:  # rank q: its rows of each matrix it does not own out, the rest of each it owns back
        rows = b.rows
        total = sum(rows) * b.matrix_shape[1] * 2
        for q, m in enumerate(_owned_per_rank(b)):
            chunk = rows[q] * b.matrix_shape[1] * 2
            assert b.bytes_sent[q] == b.bytes_recv[q] == chunk * (b.num_matrices - m) + m * (total - chunk)
