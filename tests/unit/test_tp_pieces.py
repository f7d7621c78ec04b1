"""The "pieces" layout (tensor parallel x FSDP2) from global metadata: what each rank holds, and its plan.

What a real DTensor holds is checked on 4 gloo ranks (tests/distributed/test_tensor_parallel.py);
here every rank of bigger meshes is checked against torch's own sharding arithmetic, and the plan's
owners and bytes against the path's definition.
"""

import math

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from muonlab.comm.paths.pieces import piece_shape, put, take
from muonlab.comm.planner import plan_batches
from muonlab.comm.specs import GroupKey, MatrixSpec, _torch_runs, group_pieces, piece_numel
from muonlab.kernels.config import NSConfig

CASES = [
    # FSDP2 over a column-wise Linear, over a row-wise one; uneven and empty pieces
    ((10, 6), (2, 2), (_StridedShard(0, split_factor=2), Shard(0))),
    ((2, 6), (2, 2), (_StridedShard(0, split_factor=2), Shard(0))),
    ((5, 10), (2, 2), (Shard(0), Shard(1))),
    ((7, 9), (4, 2), (_StridedShard(0, split_factor=2), Shard(0))),
    ((13, 8), (2, 4), (Shard(0), Shard(1))),
    # HSDP x TP: a Replicate axis first
    ((12, 6), (2, 2, 2), (Replicate(), _StridedShard(0, split_factor=2), Shard(0))),
    ((6, 12), (2, 2, 2), (Replicate(), Shard(0), Shard(1))),
    # an expert bank split on its experts and inside its matrices
    ((4, 6, 5), (2, 2), (Shard(0), Shard(2))),
    # uneven strided shards; a strided dim 1 across a third axis; one dim split twice plainly
    ((11, 4), (3, 2), (_StridedShard(0, split_factor=2), Shard(0))),
    ((5, 3), (4, 2), (_StridedShard(0, split_factor=2), Shard(0))),
    ((8, 13), (2, 2, 2), (_StridedShard(1, split_factor=2), Shard(0), Shard(1))),
    ((9, 4), (2, 2), (Shard(0), Shard(0))),
    # a split factor that is not the later axis' size: torch's arithmetic throughout
    ((12, 4), (2, 3), (_StridedShard(0, split_factor=2), Shard(1))),
    # a row-wise Linear alone: one Shard(1) on a 1-D mesh (an empty column block), and beside a Replicate axis
    ((6, 6), (4,), (Shard(1),)),
    ((5, 7), (2, 2), (Replicate(), Shard(1))),
]


def _coordinates(mesh_shape, placements):
    """Mesh coordinates of the flattened sharding axes' ranks, in their order (others at 0)."""
    axes = [a for a, pl in enumerate(placements) if not isinstance(pl, Replicate)]
    for flat in range(math.prod(mesh_shape[a] for a in axes)):
        coord, rest = [0] * len(mesh_shape), flat
        for a in reversed(axes):
            coord[a], rest = rest % mesh_shape[a], rest // mesh_shape[a]
        yield coord


@pytest.mark.parametrize("shape, mesh_shape, placements", CASES)
def test_pieces_agree_with_torch_and_cover_the_tensor_once(shape, mesh_shape, placements):
    pieces = group_pieces(shape, mesh_shape, placements)
    covered = torch.zeros(shape, dtype=torch.int64)
    for coord, piece in zip(_coordinates(mesh_shape, placements), pieces, strict=True):
        local, offset = _compute_local_shape_and_global_offset(shape, mesh_shape, coord, placements)
        assert piece == _torch_runs(shape, mesh_shape, coord, placements), (coord, piece)  # every index
        assert piece_shape(piece) == tuple(local), (coord, piece)
        if piece_numel(piece):
            assert tuple(runs[0][0] for runs in piece) == tuple(offset), (coord, piece)
        put(covered, piece, take(covered, piece) + 1)
    assert bool((covered == 1).all()), covered
    # empty pieces: one row per tp rank over 2 dp ranks; 3 (or 2) rows of a tp rank over 4 dp ranks;
    # 4 columns over 3 ranks (whose rows are a strided set: two runs); 6 columns over 4 ranks
    assert any(piece_numel(p) == 0 for p in pieces) == (shape in ((2, 6), (7, 9), (5, 3), (12, 4), (6, 6)))


def _spec(i, name, shape, pieces, size):
    key = GroupKey(mesh_ranks=tuple(range(size)), mesh_shape=(1, size), axis_name="dp+tp", axis_index=1)
    return MatrixSpec(i, name, shape, "pieces", key, pieces=pieces)


def test_plan_balances_owners_and_counts_each_piece_out_and_back():
    col = group_pieces((8, 6), (2, 2), (_StridedShard(0, split_factor=2), Shard(0)))
    row = group_pieces((8, 6), (2, 2), (Shard(0), Shard(1)))
    uneven = group_pieces((10, 6), (2, 2), (_StridedShard(0, split_factor=2), Shard(0)))
    specs = [_spec(0, "a", (8, 6), col, 4), _spec(1, "b", (8, 6), row, 4), _spec(2, "c", (8, 6), col, 4),
             _spec(3, "d", (8, 6), row, 4)]
    plan = plan_batches(specs, [NSConfig()] * len(specs), comm_itemsize=4)
    assert [b.path for b in plan] == ["pieces"] and sorted(plan[0].owners) == [0, 1, 2, 3]  # one batch, one each
    odd = plan_batches([_spec(0, "e", (10, 6), uneven, 4)], [NSConfig()], comm_itemsize=4)
    for b in list(plan) + list(odd):
        assert b.bytes_sent == b.bytes_recv
        # each parameter's pieces other than its owner's travel out and back
        moved = sum(2 * 4 * sum(piece_numel(pc) for q, pc in enumerate(pieces) if q != o)
                    for pieces, o in zip(b.pieces, b.owners))
        assert sum(b.bytes_sent) == moved
    held = [piece_numel(pc) for pc in odd[0].pieces[0]]
    assert held == [18, 18, 12, 12]  # of each tp rank's 5 rows, 3 on dp rank 0 and 2 on dp rank 1
    assert held[odd[0].owners[0]] == max(held)  # ties in load go to the largest holder
    assert "pieces" in plan.table()


def _llama_like(layers: int, d: int, kv: int, ff: int) -> list:
    out = []
    for n in range(layers):
        p = f"model.layers.{n}"
        out += [(f"{p}.self_attn.q_proj.weight", (d, d)), (f"{p}.self_attn.k_proj.weight", (kv, d)),
                (f"{p}.self_attn.v_proj.weight", (kv, d)), (f"{p}.self_attn.o_proj.weight", (d, d)),
                (f"{p}.mlp.gate_proj.weight", (ff, d)), (f"{p}.mlp.up_proj.weight", (ff, d)),
                (f"{p}.mlp.down_proj.weight", (d, ff))]
    return out


def test_simulate_plans_fsdp_over_tp_at_the_bound():
    from muonlab.simulate import simulate, summarize, tp_style

    assert [tp_style(n) for n, _ in _llama_like(1, 8, 4, 16)] == ["colwise"] * 3 + ["rowwise"] + ["colwise"] * 2 + [
        "rowwise"]
    # a Llama-70B-like model (80 layers, GQA) at 1024 ranks, tp=8: owner compute at its byte bound
    plan = simulate(_llama_like(80, 8192, 1024, 28672), 1024, tp=8, profile="h100_node")
    summary = summarize(plan, 1024, "h100_node")
    assert summary["paths"] == ["pieces"] and summary["bytes_over_bound"] == 1.0, summary
    assert summary["flop_imbalance"] < 1.01, summary
    # uneven FSDP pieces on a small mesh: every row-wise weight's rows 3 + 2 over dp=2
    small = simulate(_llama_like(2, 10, 4, 20), 4, tp=2, profile="cpu_gloo")
    assert {b.path for b in small} == {"pieces"}
    bound = sum(2 * (math.prod(shape) - max(map(piece_numel, pieces))) * b.comm_itemsize
                for b in small for shape, pieces in zip(b.param_shapes, b.pieces))
    assert summarize(small, 4, "cpu_gloo")["bound_bytes"] == bound
    assert sum(sum(b.bytes_sent) for b in small) >= bound
    # where bytes cost more than the balance they buy (h100_node: tiny matrices, fast matmuls), each
    # owner holds most of its weight: at the bound
    assert summarize(simulate(_llama_like(2, 10, 4, 20), 4, tp=2, profile="h100_node"), 4, "h100_node")[
        "bytes_over_bound"] == 1.0
    with pytest.raises(ValueError, match="tp=3"):
        simulate(_llama_like(1, 12, 6, 24), 8, tp=3)
    with pytest.raises(ValueError, match="tp_styles"):
        simulate(_llama_like(1, 12, 6, 24), 8, tp=2, tp_styles={"nope": "colwise"})


def test_parallelize_fsdp_tp_refuses_what_it_cannot_place():
    from muonlab.distributed import parallelize
    from muonlab.distributed.parallelize import default_tp_plan
    from muonlab.models import GPT, GPTConfig

    gpt = GPT(GPTConfig(d_model=8, n_layers=2, n_heads=2, context=4))
    assert {n: type(s).__name__ for n, s in default_tp_plan(gpt).items()} == {
        "blocks.0.attn.proj": "RowwiseParallel", "blocks.1.attn.proj": "RowwiseParallel",
        "blocks.0.mlp.fc": "ColwiseParallel", "blocks.0.mlp.out": "RowwiseParallel",
        "blocks.1.mlp.fc": "ColwiseParallel", "blocks.1.mlp.out": "RowwiseParallel"}
    with pytest.raises(ValueError, match="'fsdp\\+tp' needs tp .* or a 2-D mesh"):
        parallelize(gpt, "fsdp+tp")
    with pytest.raises(ValueError, match="tp_axis is read in 'fsdp\\+tp' mode only"):
        parallelize(gpt, "fsdp", tp_axis="tp")


def test_owner_choice_is_least_loaded_for_even_pieces_and_weighs_bytes_for_uneven_ones():
    """``cheapest_owner`` (the pieces layout's owner rule) against ``least_loaded``, its rule before
    uneven pieces were priced: the same pick wherever every rank holds as much (random loads, ties
    included); with uneven and empty pieces a tiny weight goes to a rank holding most of it, a large
    one to where the balance is (the bytes it moves cost less than the makespan it would add)."""
    import random

    from muonlab.comm.planner.loads import cheapest_owner, least_loaded

    rng = random.Random(0)
    for _ in range(500):
        size = rng.choice([2, 3, 4, 8, 16])
        load = [rng.choice([0, 5, 10, 10, 20]) for _ in range(size)]
        held, cost = [rng.choice([3, 4])] * size, rng.choice([1, 5, 50])
        moved = [2 * (size * held[0] - h) * 1e-9 for h in held]
        assert cheapest_owner(load, max(load), cost, held, moved, 1e-12) == least_loaded(load, range(size), held)
    # one row per tp rank of a (2, 6) weight over dp 2: ranks 2 and 3 hold none of it
    held, moved = [6, 6, 0, 0], [2 * (12 - h) * 4 / 1e9 for h in (6, 6, 0, 0)]  # fp32 at 1 GB/s
    assert least_loaded([100, 100, 0, 0], range(4), held) == 2  # the rule before: the least loaded, holding nothing
    assert cheapest_owner([100, 100, 0, 0], 100, 10, held, moved, 1 / 40e9) == 0  # 48 B saved beat 10 FLOPs of growth
    assert cheapest_owner([2e6, 2e6, 0, 0], 2e6, 1e6, held, moved, 1 / 40e9) == 2  # a megaFLOP of growth did not


def test_uneven_pieces_no_longer_go_to_a_rank_holding_none_of_them():
    """The tensor-parallel tests' TinyMLP (tests/distributed/_workers_tp.py): its (2, 6) weight's pieces
    sit on dp rank 0 alone; before, balance gave it to a rank holding nothing (656 B against a 576 B
    bound). Now every owner holds a piece of what it owns, and under h100_node the plan is at the bound."""
    from muonlab.comm.specs import piece_numel
    from muonlab.simulate import simulate, summarize

    shapes = [("up.weight", (10, 6)), ("down.weight", (6, 10)), ("sq_a.weight", (6, 6)), ("sq_b.weight", (6, 6)),
              ("narrow_up.weight", (2, 6)), ("narrow_down.weight", (6, 2))]
    for profile in ("cpu_gloo", "h100_node"):
        plan = simulate(shapes, 4, tp=2, profile=profile, device="cpu")
        for b in plan:
            for name, pieces, o in zip(b.names, b.pieces, b.owners):
                assert piece_numel(pieces[o]) > 0, (profile, name, o)
        summary = summarize(plan, 4, profile)
        assert summary["total_bytes"] < 656, (profile, summary)
    assert summary["bytes_over_bound"] == 1.0, summary
