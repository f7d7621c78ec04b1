"""Muon on tensor parallel x FSDP2 (layout "pieces", path "pieces") equals one process, at the planned bytes.

torch's ColwiseParallel / RowwiseParallel on a tiny MLP over the "tp" axis of a 2 x 2 gloo mesh, then
``fully_shard`` over "dp" (tests/distributed/_workers_tp.py): uneven pieces and empty ones. One launch
runs every check (worker start-up is the slow part); one thread per rank. A second launch, of 8
ranks, runs HSDP x TP on a (2, 2, 2) mesh and EP x FSDP x TP on another.
"""

import pytest

from muonlab.launcher import launch

from . import _workers_tp as W
from ._memory import assert_counted

TOLERANCE = 1e-6
"""fp32 everywhere (comm_dtype and ns_dtype): the pieces are put back exactly; NorMuon's row sums
add the ranks' parts in another order than one process (1.2e-7 measured)."""


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch(W.everything, 4, str(tmp_path_factory.mktemp("tp_checkpoints")), timeout_s=500)


@pytest.mark.timeout(600)
def test_pieces_are_what_each_dtensor_holds(results):
    """The spec's pieces, from global metadata only, are each rank's local tensor, read out of
    ``full_tensor()``; shapes and first offsets agree with torch's own arithmetic."""
    for rank, res in results.items():
        kinds = set()
        for name, got in res["pieces"].items():
            assert got["layout"] == "pieces", (rank, name, got)
            assert got["same_values"] and got["same_shape"] and got["same_offset"], (rank, name, got)
            kinds.add(got["placements"])
        assert kinds == {"(_StridedShard(dim=0, sf=2), Shard(dim=0))", "(Shard(dim=0), Shard(dim=1))"}, kinds
    # uneven (3 + 2 rows) and empty (dp rank 1 of narrow_up) pieces are among them
    assert results[0]["pieces"]["up.weight"]["shape"] == (3, 6) and results[2]["pieces"]["up.weight"]["shape"] == (2, 6)
    assert results[2]["pieces"]["narrow_up.weight"]["shape"] == (0, 6)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("rule", ["muon", "normuon"])
def test_tp_fsdp_equals_one_process_at_the_planned_bytes(results, rule):
    for rank, res in results.items():
        got = res[rule]
        for name, err in got["errors"].items():
            assert err <= TOLERANCE, (rule, rank, name, err)
        for name, err in got["variances"].items():
            assert err <= TOLERANCE, (rule, rank, name, err)
        assert {row[0] for row in got["plan"]} == {"pieces"}, got["plan"]
        assert got["plan"] == results[0][rule]["plan"]  # one plan on every rank
        # the counters at the call equal the plan, per rank; nothing was gathered whole in the step
        assert {"pieces": got["sent"]["pieces"]} == got["planned_sent"], (rank, got["sent"], got["planned_sent"])
        assert {"pieces": got["recv"]["pieces"]} == got["planned_recv"], (rank, got["recv"], got["planned_recv"])
        assert got["planned_rule"] == got["counted_rule"], (rank, got["planned_rule"], got["counted_rule"])
        assert got["gathers"] == [0] * (W.STEPS - 1), got["gathers"]
        # uneven and empty pieces: no parameter is owned by a rank holding none of it (before the
        # owner choice priced bytes, narrow_up went to a dp rank 1 rank, 656 B against a 576 B bound)
        assert got["owners_hold"], got["plan"]
        assert_counted(got, (rule, rank))  # planned buffer bytes == counted, exactly
    assert (results[0][rule]["counted_rule"] > 0) == (rule == "normuon")
    # the tiny batches are latency-bound: some travel together in a wave (one collective each way)
    assert any(row[5] is not None for row in results[0][rule]["plan"]), results[0][rule]["plan"]


@pytest.mark.timeout(600)
def test_no_full_gather_in_the_hot_step_on_any_layout(results):
    """DTensor.full_tensor / redistribute (explicit or inside a DTensor op) counted in each step
    after the first: none on FSDP2, HSDP, EP x FSDP, DDP owner, uneven and empty shards (and the
    tensor-parallel layout, above)."""
    expected_paths = {"fsdp": "all_to_all", "hsdp": "all_to_all", "ddp": "owner", "ep": "local", "uneven": "all_to_all"}
    for rank, res in results.items():
        for layout, got in res["layouts"].items():
            assert got["gathers"] == [0], (rank, layout, got)
            assert expected_paths[layout] in got["paths"], (rank, layout, got["paths"])
    assert results[3]["layouts"]["uneven"]["shards"] == [(0, 10), (1, 7)]  # an empty shard and a short one


@pytest.mark.timeout(600)
@pytest.mark.parametrize("rule", ["muon", "normuon"])
def test_a_rowwise_weight_alone_takes_pieces_and_equals_one_process(results, rule):
    """One Shard(1) on a 1-D mesh (an empty column block among them) and beside a Replicate axis:
    owner compute over the sharding axis, no full gather, no warning; within 1e-6 of one process
    (NorMuon's row variances too)."""
    for rank, res in results.items():
        got = res["rowwise"][rule]
        assert sorted(name for path, names in got["plan"] if path == "pieces" for name in names) == \
            ["alone", "replicated"], got["plan"]
        assert got["gathers"] == [0] * (W.STEPS - 1) and got["warnings"] == [], got
        assert len(got["errors"]) == (4 if rule == "normuon" else 2), got["errors"]
        for name, err in got["errors"].items():
            assert err <= TOLERANCE, (rule, rank, name, err)


@pytest.mark.timeout(600)
def test_replicated_slices_each_run_their_own_group(results):
    """HSDP x TP's shape (a Replicate axis, then two sharding axes): each replica's flattened group is
    a process group of its own, and both equal one process."""
    for rank, res in results.items():
        got = res["replicated"]
        assert got["slices"] == [[0, 1], [2, 3]] and got["paths"] == ["pieces"], got
        for name, err in got["errors"].items():
            assert err <= TOLERANCE, (rank, name, err)


@pytest.mark.timeout(600)
def test_parallelize_fsdp_tp_gpt_equals_one_process(results):
    """parallelize(gpt, "fsdp+tp", mesh, tp_axis="tp"): the MLPs split column- and row-wise over
    "tp" (the attention's output projection row-wise) and every block sharded over "dp"; Muon within 2e-5 (relative displacement, fp32) of one
    process over 3 steps (3.4e-6 measured: the TP forward adds the gradients' parts in another order)."""
    for rank, res in results.items():
        got = res["gpt"]
        assert got["displacement"] <= 2e-5, (rank, got["displacement"])
        assert {v for n, v in got["placements"].items() if "mlp" in n} == {
            "(_StridedShard(dim=0, sf=2), Shard(dim=0))", "(Shard(dim=0), Shard(dim=1))"}, got["placements"]
        assert got["paths"] == ["all_to_all", "pieces"], got["paths"]  # attention: FSDP rows; MLPs: pieces


@pytest.mark.timeout(600)
def test_parallelize_fsdp_tp_makes_its_mesh_and_knows_llama(results):
    """parallelize(model, "fsdp+tp", tp=2): a (dp 2, tp 2) mesh of muonlab's own; a tiny Hugging Face
    Llama (4 query, 2 key/value heads) split q/k/v/gate/up column-wise and o/down row-wise, and
    muonlab's GPT (MLP and attention output), each within 2e-5 of one process over 3 steps; a model
    TP and FSDP2 already sharded passes as it is; the refusals name the argument."""
    col, row = "(_StridedShard(dim=0, sf=2), Shard(dim=0))", "(Shard(dim=0), Shard(dim=1))"
    for rank, res in results.items():
        got = res["default_mesh"]
        llama, gpt = got["llama"], got["gpt"]
        for model in (llama, gpt):
            assert model["mesh"] == (("dp", "tp"), (2, 2)), model["mesh"]
            assert model["displacement"] <= 2e-5, (rank, model["displacement"])
        for name, placements in llama["placements"].items():
            kind = name.split(".")[-2]
            want = col if kind in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj") else \
                row if kind in ("o_proj", "down_proj") else "(Shard(dim=0),)"
            assert placements == want, (name, placements)
        assert llama["paths"] == ["pieces"], llama["paths"]  # every matrix TP-split; the embeddings go to AdamW
        assert gpt["placements"]["blocks.0.attn.proj.weight"] == row
        assert gpt["placements"]["blocks.0.attn.qkv.weight"] == "(Shard(dim=0),)"  # the fused qkv stays whole on TP
        assert got["passed"] == dict(same=True, mesh=(("dp", "tp"), [[0, 1], [2, 3]])), got["passed"]
        errors = got["errors"]
        assert errors["tp=3"] == "tp=3 does not divide the world size 4", errors
        assert "no TP plan known for Sequential" in errors["no plan"] and "pass parallelize_plan=" in errors["no plan"]
        assert errors["heads"].startswith("tp=4 must divide the heads of attention 'model.layers.0.self_attn'"), errors
        assert "already sharded" in errors["again with tp"] and "so tp is not read" in errors["again with tp"], errors


@pytest.mark.timeout(600)
def test_checkpoint_reshards_across_tp_sizes_bit_for_bit(results):
    """DCP: saved on (dp 2, tp 2), loaded on (dp 4, tp 1), saved there and loaded back on (dp 2, tp 2):
    every parameter and Muon/AdamW state tensor equal bit for bit at each load; the next step from
    the load back equals the first model's exactly (from the (4, 1) load within 1e-6: its gradients
    are summed in another order)."""
    for rank, res in results.items():
        got = res["checkpoint"]
        assert got["steps"] == (2, 2) and got["extra"] == [], got
        assert got["state_keys"] == ["momentum_buffer"], got["state_keys"]
        assert got["keys"] == 40
        for where in ("wide", "back"):
            assert all(v == 0.0 for v in got[where].values()), (rank, where, got[where])
        assert got["placements"]["blocks.0.mlp.fc.weight"] == ("(_StridedShard(dim=0, sf=2), Shard(dim=0))",
                                                              "(Shard(dim=0), Shard(dim=0))"), got["placements"]
        assert got["next_back"] == 0.0 and got["next_wide"] <= 1e-6, got


@pytest.mark.timeout(600)
def test_split_heads_under_tp_need_the_fsdp_axis_only(results):
    """split_heads on the tiny Llama under (dp 2, tp 2): each TP rank holds whole heads of q, k and v,
    so their Newton-Schulz is planned over "dp" alone (q: one whole head per rank, no bytes at all;
    k/v: a head's rows on both dp ranks, FSDP2's all_to_all within the TP slice), the rest over the
    flattened "dp+tp" group; bytes counted = planned; fp32 Muon within 1e-6 of one process over 3
    steps from the same gradients (0 measured)."""
    for rank, res in results.items():
        got = res["heads"]["muon"]
        for name, err in got["errors"].items():
            assert err <= TOLERANCE, (rank, name, err)
        assert got["sent"] == got["planned_sent"], (rank, got["sent"], got["planned_sent"])
        by_kind = {}
        for path, axis, names, num_matrices, shape, sent in got["plan"]:
            for name in names:
                by_kind.setdefault(name.split(".")[-2], set()).add((path, axis, num_matrices, shape, sent))
        # q: 4 heads of (4, 16), 2 per TP slice, 1 per rank: each orthogonalized where it lies
        assert by_kind["q_proj"] == {("local", "dp", 4, (4, 16), 0)}, by_kind
        # k, v: 2 kv heads, 1 per TP slice, its 4 rows on 2 dp ranks: moved within the slice only
        assert {k[:4] for kind in ("k_proj", "v_proj") for k in by_kind[kind]} == {("all_to_all", "dp", 4, (4, 16))}
        for kind in ("o_proj", "gate_proj", "up_proj", "down_proj"):
            assert {k[:2] for k in by_kind[kind]} == {("pieces", "dp+tp")}, by_kind[kind]


def test_normuon_keeps_split_heads_under_tp_on_pieces_and_equals_one_process(results):
    """NorMuon's per-row state is laid out for "pieces" (every row on every rank), so with it the
    heads of q, k and v stay on "pieces" over "dp+tp" (not their TP slice): within 1e-6 of one
    process over 3 steps, the paths' bytes counted = planned (the slice layout gave a shape error)."""
    for rank, res in results.items():
        got = res["heads"]["normuon"]
        for name, err in got["errors"].items():
            assert err <= TOLERANCE, (rank, name, err)
        # the paths' bytes as planned, beside the rule's own all-reduce of row sums
        paths_sent = {k: v for k, v in got["sent"].items() if k != "normuon"}
        assert paths_sent == got["planned_sent"] and got["sent"]["normuon"] > 0, (rank, got["sent"], got["planned_sent"])
        paths = {(path, axis) for path, axis, names, *_ in got["plan"]
                 for name in names if name.split(".")[-2] in ("q_proj", "k_proj", "v_proj")}
        assert paths == {("pieces", "dp+tp")}, paths


@pytest.mark.timeout(600)
def test_qk_clip_under_tp_takes_each_head_where_it_lives(results):
    """QK-clip on the tiny Llama (4 heads, 2 kv heads) under (dp 2, tp 2): each TP rank records its
    own heads, the max is global over the data-parallel ranks; one forward and a clip at tau 27 (heads
    on both TP ranks clipped, one not) equal one process: gamma within 1e-6, every weight whole within
    1e-6 (0 measured), max logits within 2e-6 (3.8e-7 measured, layer 1's logits of 0.05 after the
    TP forward's row-wise sums). 3 SGD steps with the clip attached: within 1e-4 (1.0e-5 measured; FSDP2
    alone is held to 1e-5 in test_qk_clip_distributed, and the TP forward adds its sums)."""
    for rank, res in results.items():
        got = res["qk_clip"]
        assert got["q_placements"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
        once = got["once"]
        assert once["gammas"][0] == pytest.approx(once["want_gammas"][0], rel=1e-6), (rank, once)
        assert sum(g < 1 for g in once["want_gammas"][0][:4]) == 3, once["want_gammas"]  # heads 0, 2, 3
        assert once["logit_error"] <= 2e-6, (rank, once["logit_error"])
        for name, err in once["errors"].items():
            assert err <= TOLERANCE, (rank, name, err)
        steps = got["steps"]
        assert sum(steps["gammas"], []) == pytest.approx(sum(steps["want_gammas"], []), rel=1e-4), (rank, steps)
        assert steps["logit_error"] <= 1e-4, (rank, steps["logit_error"])
        for name, err in steps["errors"].items():
            assert err <= 1e-4, (rank, name, err)


@pytest.fixture(scope="module")
def hsdp_results():
    return launch(W.hsdp_tp, 8, timeout_s=500)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("rule", ["muon", "normuon"])
def test_hsdp_tp_on_8_ranks_equals_one_process_at_the_planned_bytes(hsdp_results, rule):
    """HSDP x TP on a (2, 2, 2) gloo mesh: the column-wise weights' placements have all three kinds
    (Replicate, _StridedShard, Shard) and every matrix steps as in one process, with the bytes the
    plan says and no full gather."""
    for rank, res in hsdp_results.items():
        got = res[rule]
        assert got["placements"]["up.weight"] == "(Replicate(), _StridedShard(dim=0, sf=2), Shard(dim=0))"
        for name, err in [*got["errors"].items(), *got["variances"].items()]:
            assert err <= TOLERANCE, (rule, rank, name, err)
        assert {row[0] for row in got["plan"]} == {"pieces"} and got["plan"] == hsdp_results[0][rule]["plan"]
        assert {"pieces": got["sent"]["pieces"]} == got["planned_sent"], (rank, got["sent"], got["planned_sent"])
        assert {"pieces": got["recv"]["pieces"]} == got["planned_recv"], (rank, got["recv"], got["planned_recv"])
        assert got["planned_rule"] == got["counted_rule"] and got["gathers"] == [0] * (W.STEPS - 1)
        # each replica (ranks 0-3, 4-7) moves what the 2 x 2 mesh above moves: nothing crosses replicas
        assert got["sent"] == hsdp_results[rank % 4][rule]["sent"], (rank, got["sent"])
        assert_counted(got, (rule, rank))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("rule", ["muon", "normuon"])
def test_ep_fsdp_tp_on_8_ranks_equals_one_process_at_the_planned_bytes(hsdp_results, rule):
    """EP x FSDP x TP on a (dp 2, ep 2, tp 2) gloo mesh: each ep rank's own expert banks, sharded
    over dp on the expert dim (3 experts: 2 + 1) and over tp inside each expert, step as one process
    steps that ep rank's banks whole; bytes as planned, within each ep slice's ("dp", "tp") group;
    no full gather."""
    for rank, res in hsdp_results.items():
        got = res[f"ep_{rule}"]
        assert got["placements"] == {"experts.w_in": "(Shard(dim=0), Shard(dim=1))",
                                     "experts.w_out": "(Shard(dim=0), Shard(dim=2))"}, got["placements"]
        for name, err in got["errors"].items():
            assert err <= TOLERANCE, (rule, rank, name, err)
        assert got["paths"] == ["pieces"] and got["groups"] == ["dp+tp"], got
        assert {"pieces": got["sent"]["pieces"]} == got["planned_sent"], (rank, got["sent"], got["planned_sent"])
        assert {"pieces": got["recv"]["pieces"]} == got["planned_recv"], (rank, got["recv"], got["planned_recv"])
        assert got["gathers"] == [0] * (W.STEPS - 1) and got["owners_hold"], got
        assert_counted(got, (rule, rank))
    # the other ep rank's experts, on the same plan: the same bytes one ep slice over
    assert hsdp_results[0][f"ep_{rule}"]["sent"] == hsdp_results[2][f"ep_{rule}"]["sent"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("rule", ["muon", "normuon"])
def test_simulate_plans_split_heads_under_tp_as_the_run_does(results, rule):
    """``simulate(model, 4, tp=2, fused_banks=attention_blocks(model))`` on the tiny Llama gives the
    run's plan above row for row (path, axis, names, matrices, shape, bytes): with Muon the q/k/v
    heads over "dp" alone, with NorMuon on "pieces"; without fused_banks it planned every head on
    "pieces" and counted 1.29x the run's bytes."""
    import torch

    from muonlab.optim.heads import attention_blocks
    from muonlab.simulate import simulate

    model = W._llama()
    plan = simulate(model, 4, tp=2, fused_banks=attention_blocks(model), update_rule=rule,
                    comm_dtype=torch.float32, ns_dtype=torch.float32, device="cpu")
    rows = [(b.path, b.group.axis_name if b.group else None, b.names, b.num_matrices, b.matrix_shape,
             sum(b.bytes_sent)) for b in plan]
    assert sorted(rows) == sorted(tuple(r) for r in results[0]["heads"][rule]["plan"]), rows
