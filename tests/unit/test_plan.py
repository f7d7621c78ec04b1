"""The planner on metadata alone: no processes, any world size."""

import math
from collections import Counter

import pytest

from muonlab.comm.planner import plan_batches
from muonlab.comm.records import flops_per_rank
from muonlab.comm.specs import GroupKey, MatrixSpec, chunk_sizes
from muonlab.kernels.config import NSConfig, ns_flops
from muonlab.kernels.newton_schulz import resolve_form

CFG = NSConfig()
CFG_OF_SIMULATE = NSConfig(**resolve_form("auto"))  # simulate()'s default form


def group(size):
    return GroupKey(mesh_ranks=tuple(range(size)), mesh_shape=(size,), axis_name="dp")


def row_specs(shapes, size):
    g = group(size)
    return [MatrixSpec(i, f"m{i}", s, "row_shard", g, chunk_sizes(s[0], size)) for i, s in enumerate(shapes)]


def test_chunk_sizes_follow_torch_chunk():
    import torch

    for dim, parts in [(6, 4), (10, 4), (8, 4), (3, 5), (0, 3), (1, 2)]:
        got = chunk_sizes(dim, parts)
        want = [c.shape[0] for c in torch.arange(dim).chunk(parts)] if dim else []
        assert list(got[: len(want)]) == want and sum(got) == dim and len(got) == parts


@pytest.mark.parametrize("size", [2, 3, 4, 7, 64])
def test_sharded_bytes_meet_the_lower_bound_and_flops_balance(size):
    shapes = [(96, 32), (32, 96), (64, 64)] * 5  # 15 matrices: full batches and remainders
    specs = row_specs(shapes, size)
    plan = plan_batches(specs, [CFG] * len(specs))
    # every matrix exactly once
    assert sorted(i for b in plan for i in b.param_indices) == list(range(len(specs)))
    bound = sum(2 * (size - 1) / size * a * b * 2 for a, b in shapes)
    total = sum(b.total_bytes for b in plan)
    assert total == sum(sum(b.bytes_recv) for b in plan)
    assert total <= 1.05 * bound, (total, bound)
    per_matrix = [ns_flops(s) for s in shapes]
    target = max(sum(per_matrix) / size, max(per_matrix))
    worst = max(flops_per_rank(plan))
    if size <= 4:  # enough matrices per rank: within 10% of max(mean, largest matrix)
        assert worst <= 1.1 * target, (worst, target)
    else:  # few matrices per rank: LPT's guarantee, 4/3 of a bound below the optimum
        assert worst <= 4 / 3 * target, (worst, target)


def test_a_bucket_is_one_all_to_all_batch_and_a_small_bucket_follows_the_remainder_option():
    # 6 matrices of one shape on 4 ranks: one batch, owners 2, 2, 1, 1 under the structured rule
    # (was a batch of 4 and a remainder of 2); a bucket of 2 < 4 matrices is a remainder batch on
    # the option's path
    specs = row_specs([(16, 8)] * 6 + [(16, 12)] * 2, 4)
    plan = plan_batches(specs, [CFG] * 8, row_assignment="structured")
    by_shape = {b.matrix_shape: b for b in plan}
    assert len(plan) == 2 and by_shape[(16, 8)].path == "all_to_all"
    assert sorted(Counter(by_shape[(16, 8)].owners).values()) == [1, 1, 2, 2]
    assert len(set(by_shape[(16, 12)].owners)) == 2
    agrs = {b.matrix_shape: b for b in plan_batches(specs, [CFG] * 8, remainder_path="agrs",
                                                    row_assignment="structured")}
    assert agrs[(16, 8)].path == "all_to_all" and agrs[(16, 12)].path == "agrs"
    assert agrs[(16, 12)].total_bytes > by_shape[(16, 12)].total_bytes  # the gather moves more


def test_empty_trailing_shards_send_nothing_and_do_not_own_remainders():
    specs = row_specs([(6, 10)], 4)  # rows 2, 2, 2, 0
    (batch,) = plan_batches(specs, [CFG])
    assert batch.rows == (2, 2, 2, 0)
    assert batch.owners[0] != 3  # the owner holds rows, so fewer bytes move
    assert batch.bytes_sent[3] == 0 and batch.bytes_recv[3] == 0


def test_different_ns_settings_or_groups_never_share_a_batch():
    g2, g4 = group(2), group(4)
    specs = [MatrixSpec(0, "a", (8, 8), "row_shard", g2, (4, 4)), MatrixSpec(1, "b", (8, 8), "row_shard", g4, (2, 2, 2, 2)),
             MatrixSpec(2, "c", (8, 8), "row_shard", g2, (4, 4))]
    plan = plan_batches(specs, [CFG, CFG, NSConfig(steps=6)])
    assert sorted(b.param_indices for b in plan) == [(0,), (1,), (2,)]


def test_replicated_matrices_get_one_owner_each_balanced_by_flops():
    g = group(3)
    shapes = [(64, 64), (64, 64), (32, 32), (32, 32), (128, 64)]
    specs = [MatrixSpec(i, f"m{i}", s, "replicated", g) for i, s in enumerate(shapes)]
    plan = plan_batches(specs, [CFG] * len(specs))
    assert {b.path for b in plan} == {"owner"}
    owners = {i: o for b in plan for i, o in zip(b.param_indices, b.owners)}
    assert set(owners) == set(range(5))
    loads = flops_per_rank(plan)
    assert max(loads) == ns_flops((128, 64))  # LPT: the largest alone on one rank
    # every rank receives what the others computed: (W-1)/W of all update bytes per rank on average
    total = sum(a * b * 2 for a, b in shapes)
    assert sum(sum(b.bytes_recv) for b in plan) == (3 - 1) * total


def test_whole_experts_stay_local_with_their_flops_where_the_data_is():
    g = group(4)
    spec = MatrixSpec(0, "experts", (5, 6, 8), "whole", g, chunk_sizes(5, 4))  # 2, 2, 1, 0 experts
    (batch,) = plan_batches([spec], [CFG])
    assert batch.path == "local" and batch.total_bytes == 0
    assert batch.flops == tuple(n * ns_flops((6, 8)) for n in (2, 2, 1, 0))


def test_bad_options():
    with pytest.raises(ValueError, match="remainder_path"):
        plan_batches([], [], remainder_path="ring")
    with pytest.raises(ValueError, match="strategy"):
        plan_batches([], [], strategy="magic")


def test_whole_experts_move_only_to_fix_imbalance():
    g = group(8)
    banks = [MatrixSpec(i, f"bank{i}", (4, 6, 8), "whole", g, chunk_sizes(4, 8)) for i in range(2)]  # 1,1,1,1,0,0,0,0
    plan = plan_batches(banks, [CFG, CFG])
    assert [b.path for b in plan] == ["rebalance"]
    (batch,) = plan.batches
    assert len(batch.moves) == 4 and all(src < 4 <= owner for _, _, src, owner in batch.moves)
    assert batch.flops == (ns_flops((6, 8)),) * 8  # one matrix per rank
    assert batch.total_bytes == 4 * 2 * 6 * 8 * 2  # each moved matrix goes out and back once


def test_fused_banks_by_how_experts_fall_on_the_shards():
    from muonlab.comm.specs import fused_row_layout

    assert fused_row_layout(24, 8, 4) == "whole"  # 2 whole experts of 3 rows per rank
    assert fused_row_layout(16, 2, 4) == "subgroup"  # each expert over 2 ranks, 4 rows each
    assert fused_row_layout(16, 2, 3) == "blocks"  # rows 6, 6, 4: the shards cut the experts
    g = group(4)
    spec = MatrixSpec(0, "bank", (16, 8), "subgroup", g, chunk_sizes(16, 4), num_fused=2)
    assert spec.matrix_shape == (8, 8) and spec.num_matrices == 2
    (batch,) = plan_batches([spec], [CFG])
    assert batch.path == "subgroup"
    # each rank sends its 4 x 8 rows to the one other rank of its sub-group, nothing back
    assert batch.bytes_sent == batch.bytes_recv == (4 * 8 * 2,) * 4
    assert batch.flops == (ns_flops((8, 8)),) * 4


def _loop_all_to_all_bytes(rows, cols, owners, itemsize):
    """The readable reference: walk every (owner, rank) pair."""
    sent, recv = [0] * len(rows), [0] * len(rows)
    for o in owners:
        for q in range(len(rows)):
            if q != o:
                chunk = rows[q] * cols * itemsize
                sent[q] += chunk
                recv[o] += chunk
                sent[o] += chunk
                recv[q] += chunk
    return sent, recv


def _loop_agrs_bytes(rows, cols, owners, itemsize):
    size, k = len(rows), len(owners)
    sent, recv = [0] * size, [0] * size
    for q in range(size):
        for p in range(size):
            if p != q:
                sent[q] += k * rows[q] * cols * itemsize
                recv[p] += k * rows[q] * cols * itemsize
    for o in owners:
        for q in range(size):
            if q != o:
                sent[o] += rows[q] * cols * itemsize
                recv[q] += rows[q] * cols * itemsize
    return sent, recv


@pytest.mark.parametrize("size, dim, owners", [(4, 6, [0, 1]), (4, 10, [0, 1, 2, 3]), (3, 7, [2]), (8, 5, [4, 0, 6]),
                                               # owners of several matrices (megabatches), empty shards among them
                                               (4, 10, [0, 1, 2, 3, 0, 1]), (4, 2, [0, 0, 3, 1, 2]), (2, 7, [1, 1, 1])])
def test_closed_form_bytes_match_the_pairwise_reference(size, dim, owners):
    from muonlab.comm.paths import agrs, all_to_all

    rows = chunk_sizes(dim, size)
    assert list(map(list, all_to_all.bytes_per_rank(rows, 9, owners, 2))) == list(map(list, _loop_all_to_all_bytes(rows, 9, owners, 2)))
    assert list(map(list, agrs.bytes_per_rank(rows, 9, owners, 2))) == list(map(list, _loop_agrs_bytes(rows, 9, owners, 2)))


def test_a_60_layer_model_plans_at_2048_ranks():
    from muonlab.simulate import simulate, summarize
    from muonlab.viz.planner import dense_shapes

    plan = simulate(dense_shapes(layers=60), 2048)
    assert sorted(i for b in plan for i in b.param_indices) == list(range(60 * 7))
    s = summarize(plan, 2048)
    assert s["bytes_over_bound"] <= 1.0001 and s["flop_imbalance"] <= 1.1


def test_simulate_takes_a_one_dimensional_mesh_shape_as_init_device_mesh_does():
    from muonlab.simulate import simulate

    shapes = [(64, 32), (32, 64)] * 3
    assert simulate(shapes, (4,)) == simulate(shapes, 4)
    with pytest.raises(ValueError, match=r"mesh_shape must be W, \(W,\) or \(fsdp, ep\)"):
        simulate(shapes, (2, 2, 1))


def test_the_readme_names_resolve_after_a_plain_import():
    import subprocess
    import sys

    code = ("import muonlab; from muonlab.launcher import launch; "
            "assert muonlab.launch is launch; "
            "print(muonlab.checkpoint.save.__module__, muonlab.simulate.simulate.__module__, "
            "muonlab.distributed.parallelize.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["muonlab.checkpoint", "muonlab.simulate", "muonlab.distributed.parallelize"]


def test_changing_a_setting_the_plan_depends_on_replans():
    """The plan cache key holds every setting the plan depends on: change one, get a new plan."""
    import torch

    from muonlab import Muon
    from muonlab.comm.cost import get_profile

    params = [torch.nn.Parameter(torch.randn(16, 8)) for _ in range(3)]
    opt = Muon(params, ns_dtype=torch.float32)

    def plan_after_step():
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        return opt.plan()

    plan_after_step()
    # another profile than the default, which is the H100 one on a CUDA machine
    other = "cpu_gloo" if get_profile(opt.hardware_profile).name == "h100_node" else "h100_node"
    for attr, value in [("comm_dtype", torch.float32), ("strategy", "redundant"), ("remainder_path", "agrs"),
                        ("hardware_profile", get_profile(other)), ("ns_form", "gram")]:
        cached = len(opt._plans)
        setattr(opt, attr, value)
        plan = plan_after_step()
        assert len(opt._plans) == cached + 1, f"changing {attr} kept the cached plan"
    assert plan[0].ns_config.form == "gram"


def test_local_batches_split_evenly_within_the_workspace_budget():
    """24 matrices under a budget of 7 per batch run as 6+6+6+6 (one batch shape for the matmul
    library), not 7+7+7+3."""
    import torch

    import muonlab

    params = [torch.nn.Parameter(torch.randn(64, 32)) for _ in range(24)]
    per_matrix = 4 * (2 * 32 * 64 + 2 * 32 * 32)  # fp32: the input (also the output), an iterate, two products
    opt = muonlab.Muon(params, ns_dtype=torch.float32, workspace_bytes=7 * per_matrix)
    assert [len(b.param_indices) for b in opt.plan()] == [6, 6, 6, 6]
    opt = muonlab.Muon(params, ns_dtype=torch.float32, workspace_bytes=7 * per_matrix - 1)
    assert [len(b.param_indices) for b in opt.plan()] == [6, 6, 6, 6]  # a limit of 6: 24 / 6
    opt = muonlab.Muon(params[:23], ns_dtype=torch.float32, workspace_bytes=7 * per_matrix)
    assert sorted(len(b.param_indices) for b in opt.plan()) == [5, 6, 6, 6]


def test_simulate_with_a_workspace_budget_plans_the_parts_a_run_takes():
    """simulate(workspace_bytes=...) cuts a bank as Muon with that budget does (one process here;
    on 4 gloo ranks with expert parallelism: tests/distributed/test_muon_ep.py)."""
    import pytest
    import torch

    import muonlab
    from muonlab.simulate import simulate

    shapes = [("bank", (10, 16, 48)), ("w", (16, 48))]
    budget = 4 * 4 * (2 * 16 * 48 + 2 * 16 * 16)  # four fp32 16x48 matrices
    params = [(n, torch.nn.Parameter(torch.randn(s))) for n, s in shapes]
    opt = muonlab.Muon(params, ns_dtype=torch.float32, ns_form="plain", workspace_bytes=budget)
    sim = simulate(shapes, 1, workspace_bytes=budget, ns_dtype=torch.float32, ns_form="plain")

    def rows(plan):
        return [(b.names, b.part, b.num_matrices, b.param_shapes) for b in plan]

    assert rows(sim) == rows(opt.plan())
    assert sum(b.part is not None for b in sim) == 3
    assert all(b.part is None for b in simulate(shapes, 1))  # no budget: no parts
    with pytest.raises(ValueError, match="workspace_bytes must be >= 1"):
        simulate(shapes, 1, workspace_bytes=0)


def test_simulate_sizes_batches_for_the_triton_backend_as_a_triton_run_does():
    """simulate(ns_backend="triton") plans the local batches and bank parts of a run with
    Muon(ns_backend="triton") under the same budget (Triton's interpreter stands in for a GPU
    here): one more iterate per matrix than the torch path, so fewer matrices per batch."""
    import pytest
    import torch

    import muonlab
    from muonlab.kernels.backends import BACKENDS
    from muonlab.simulate import simulate

    if not BACKENDS["triton"].usable(torch.device("cpu")):
        pytest.skip("needs triton (its interpreter, TRITON_INTERPRET=1, on a CPU)")
    shapes = [("bank", (10, 16, 48)), ("w", (16, 48))] + [(f"v{i}", (48, 16)) for i in range(9)]
    budget = 4 * 4 * (3 * 16 * 48 + 2 * 16 * 16)  # four fp32 16x48 matrices on the Triton path
    params = [(n, torch.nn.Parameter(torch.randn(s))) for n, s in shapes]
    opt = muonlab.Muon(params, ns_dtype=torch.float32, ns_form="plain", ns_backend="triton", workspace_bytes=budget)

    def rows(plan):
        return sorted((b.names, b.part, b.num_matrices, b.param_shapes) for b in plan)

    sim = simulate(shapes, 1, workspace_bytes=budget, ns_dtype=torch.float32, ns_form="plain", ns_backend="triton")
    assert rows(sim) == rows(opt.plan())
    assert max(b.num_matrices for b in sim) == 4
    torch_sim = simulate(shapes, 1, workspace_bytes=budget, ns_dtype=torch.float32, ns_form="plain")
    assert max(b.num_matrices for b in torch_sim) > 4  # the torch path fits more in the same budget
    with pytest.raises(ValueError, match="'auto' is timed on the device itself"):
        simulate(shapes, 1, workspace_bytes=budget, ns_backend="auto")


@pytest.mark.parametrize("experts, mesh, budget_matrices", [
    (8, 1, 3), (64, 1, 7), (6, 4, 1), (6, (2, 2), 1), (16, (4, 2), 1), (12, 8, 1), (32, (2, 4), 3), (5, 2, 2)])
def test_parts_cover_every_matrix_once_within_the_budget_and_change_no_totals(experts, mesh, budget_matrices):
    """Whatever the mesh and budget: each bank's parts hold its matrices once between them, no
    rank holds more of a part than the budget allows, and the per-rank FLOPs and bytes are those of
    the plan without parts (parts only cut the same work into batches)."""
    from collections import Counter

    import torch

    from muonlab.kernels.workspace import batch_bytes_per_matrix
    from muonlab.simulate import simulate
    from muonlab.viz.planner import moe_shapes

    shapes = moe_shapes(layers=2, experts=experts, d=64, hidden=32)
    world = mesh if isinstance(mesh, int) else mesh[0] * mesh[1]
    per_matrix = batch_bytes_per_matrix(32, 64, 4, reuses_input=True)
    budget = budget_matrices * per_matrix
    whole = simulate(shapes, mesh, profile="h100_node", ns_dtype=torch.float32)
    parted = simulate(shapes, mesh, profile="h100_node", ns_dtype=torch.float32, workspace_bytes=budget)
    def matrices_of(plan, name):  # {batch index: (part, matrices of ``name`` in it, their sources)}
        return {b.index: (b.part, math.prod(b.param_shapes[k][:-2]), b.sources[k])
                for b in plan for k, n in enumerate(b.names) if n == name}

    cut = 0
    for name in {n for n, s in shapes if len(s) == 3}:
        mine, (unparted,) = matrices_of(parted, name), matrices_of(whole, name).values()
        assert sum(count for _, count, _ in mine.values()) == unparted[1], name
        parts = [part for part, _, _ in mine.values() if part]
        if parts:
            cut += 1
            assert sorted(parts) == [(p, len(mine)) for p in range(len(mine))], name
            assert all(max(Counter(src).values(), default=0) <= budget_matrices for _, _, src in mine.values()), name
        if max(Counter(unparted[2]).values()) > budget_matrices:  # more on a rank than fit: must be cut
            assert parts, name
    assert cut
    for key in ("flops", "sent", "recv"):
        assert parted.per_rank(world)[key] == whole.per_rank(world)[key], key


def test_replicated_batches_split_within_the_budget_evenly_over_owners():
    """DDP: every rank receives a replicated batch's whole all-gather, so a budget of about L
    matrices gives batches of L / W per owner: 24 matrices on 4 ranks under L = 21 (5 per owner)
    run as 12 + 12 (3 per owner), not 20 + 4; under L = 4, six batches of one per owner. Bytes
    and per-rank FLOPs are those of the single batch without a budget."""
    from collections import Counter

    import torch

    from muonlab.kernels.workspace import batch_bytes_per_matrix
    from muonlab.simulate import simulate

    shapes = [(f"w{i}", (256, 128)) for i in range(24)]
    per_matrix = batch_bytes_per_matrix(128, 256, 4, reuses_input=True)
    whole = simulate(shapes, 4, layout="ddp", ns_dtype=torch.float32, profile="cpu_gloo")
    assert [len(b.param_indices) for b in whole] == [24]
    for limit, sizes in ((21, [12, 12]), (4, [4] * 6)):
        plan = simulate(shapes, 4, layout="ddp", ns_dtype=torch.float32, profile="cpu_gloo",
                        workspace_bytes=limit * per_matrix)
        assert [len(b.param_indices) for b in plan] == sizes, limit
        assert all(set(Counter(b.owners).values()) == {len(b.owners) // 4} for b in plan), limit  # even
        for key in ("flops", "sent", "recv"):
            assert plan.per_rank(4)[key] == whole.per_rank(4)[key], (limit, key)


def test_best_search_judges_balance_per_global_rank_on_an_expert_mesh():
    """Dense matrices on a 6-rank group and experts on a (3, 2) mesh's fsdp axis: the search
    added group-local rank r of both groups as if they were one rank, and kept a plan both less
    balanced (max-rank FLOPs) and slower (its own cost model) than one it threw away."""
    from muonlab.comm.cost import get_profile, step_seconds
    from muonlab.comm.planner import ROW_RULES, RulePlanner
    from muonlab.comm.records import per_rank
    from muonlab.simulate import mesh_specs

    shapes = [("d0", (4096, 2048)), ("e0", (2, 2048, 1024)), ("e1", (2, 4096, 2048))]
    specs, profile = mesh_specs(shapes, 6, ep=2), get_profile("h100_node")
    configs = [CFG] * len(specs)
    chosen = plan_batches(specs, configs, comm_itemsize=2, profile=profile)
    options = [RulePlanner(specs, configs, comm_itemsize=2, remainder_path="auto", profile=profile,
                           row_assignment=rule, rebalance=move).plan() for rule in ROW_RULES for move in (True, False)]
    worst = max(per_rank(chosen, 6)["flops"])
    better = [p for p in options
              if max(per_rank(p, 6)["flops"]) < worst and step_seconds(p, profile) < step_seconds(chosen, profile)]
    assert not better, (worst, [max(per_rank(p, 6)["flops"]) for p in better])


def test_whole_matrices_move_when_small_ones_that_stay_fill_every_idle_rank():
    """Two one-expert banks on rank 0 and eight small experts spread over 4 ranks: no move kept
    every rank under the LPT cap (the small ones count against it), so both big experts stayed
    on rank 0 at twice any other rank's load. Moving one, and the small ones off its new rank,
    reaches the LPT makespan: one big expert's FLOPs."""
    from muonlab.simulate import simulate

    plan = simulate([("e1", (1, 256, 256)), ("e2", (1, 256, 256)), ("s", (8, 16, 16))], 4)
    big, small = ns_flops((256, 256), CFG_OF_SIMULATE), ns_flops((16, 16), CFG_OF_SIMULATE)
    assert max(plan.per_rank(4)["flops"]) == big > 8 * small
    (experts,) = [b for b in plan if b.names == ("e1", "e2")]
    assert len(experts.moves) == 1  # one of the two moved


@pytest.mark.parametrize("world, shape, fused", [(4, (16, 8), 2), (8, (64, 32), 4), (8, (64, 32), 2)])
def test_the_byte_bound_holds_for_fused_banks_on_the_subgroup_path(world, shape, fused):
    """Each matrix of a fused bank spanning k ranks can be all-gathered among them (k - 1 of its
    bytes, nothing back): the bound charged 2 (1 - largest/rows) of the whole bank, above what
    the subgroup path moves (0.67 and 0.57 of it)."""
    from muonlab.simulate import simulate, summarize

    plan = simulate([("w", shape)], world, fused_banks={"w": fused})
    assert [b.path for b in plan] == ["subgroup"]
    totals = summarize(plan, world)
    assert totals["total_bytes"] >= totals["bound_bytes"] > 0
    if world // fused == 2:  # two ranks per matrix: the all-gather is the cheapest move
        assert totals["total_bytes"] == totals["bound_bytes"]


def test_simulate_plans_a_model_of_two_dtypes_as_its_run_does_and_checks_options_as_muon():
    import torch

    from muonlab import Muon, muon_param_groups
    from muonlab.comm.cost import HardwareProfile
    from muonlab.simulate import simulate

    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8, bias=False) for _ in range(3)])  # a plain stack: all on Muon
    model[1].to(torch.bfloat16)
    run = [(b.path, b.names) for b in Muon(muon_param_groups(model)).plan()]
    assert len(run) == 2 and [(b.path, b.names) for b in simulate(model, 1)] == run
    bank = [("experts", (4, 8, 8))]
    assert [(b.path, b.group) for b in simulate(bank, 1, layout="ddp")] == [("local", None)]
    for bad, match in [(dict(comm_dtype=torch.float16), "comm_dtype"), (dict(comm_dtype="bf16"), "comm_dtype"),
                       (dict(ns_dtype=torch.int8, workspace_bytes=1 << 20), "ns_dtype")]:
        with pytest.raises((TypeError, ValueError), match=match):
            simulate([("w", (8, 8))], 2, **bad)
    with pytest.raises(ValueError, match="'w' appears twice"):
        simulate([("w", (8, 8)), ("w", (8, 4))], 2)
    good = dict(name="x", intra_bw=1e9, inter_bw=1e9, ranks_per_node=8, latency_s=1e-5, matmul_flops=1e12)
    for field, value in [("intra_bw", 0), ("matmul_flops", float("nan")), ("latency_s", -1.0), ("ranks_per_node", 0)]:
        with pytest.raises(ValueError, match=field):
            HardwareProfile(**{**good, field: value})


def test_simulate_for_a_device_plans_the_forms_and_flops_a_run_there_takes(monkeypatch):
    """simulate(device=...) follows a run's device as Muon does: "auto" dtype, and the plain form
    where the gram form would iterate wider than a 16-bit dtype (a CPU without fp16 matmul)."""
    import importlib

    import torch

    import muonlab
    from muonlab.simulate import simulate

    ns = importlib.import_module("muonlab.kernels.newton_schulz")
    shapes = [("wide", (16, 64)), ("tall", (96, 32)), ("square", (32, 32))]
    for native_fp16 in (False, True):
        monkeypatch.setattr(ns, "native_fp16_matmul", lambda device: native_fp16)
        for dtype in (torch.bfloat16, torch.float32, "auto"):
            params = [(n, torch.nn.Parameter(torch.randn(s))) for n, s in shapes]
            opt = muonlab.Muon(params, ns_dtype=dtype)
            sim = simulate(shapes, 1, ns_dtype=dtype, device="cpu")
            assert [(b.names, b.flops) for b in sim] == [(b.names, b.flops) for b in opt.plan()], (native_fp16, dtype)
    # without a device: a GPU's rule (the gram form on the rectangular shapes in bf16)
    monkeypatch.setattr(ns, "native_fp16_matmul", lambda device: device is None or torch.device(device).type != "cpu")
    gpu, cpu = simulate(shapes, 1), simulate(shapes, 1, device="cpu")
    assert sum(sum(b.flops) for b in gpu) < sum(sum(b.flops) for b in cpu)
