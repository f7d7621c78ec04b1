"""Per-head Newton-Schulz on 2 and 4 gloo ranks equals one process (fp32): muonlab's GPT with its
QKV split per head or into q, k, v on FSDP2 (shards cut heads) and DDP, and fused banks whose
shards cut blocks and leave the last rank empty. One launch per world size runs every case."""

from __future__ import annotations

import pytest
import torch

from muonlab.comm.records import Plan
from muonlab.launcher import launch
from muonlab.simulate import lower_bound_bytes, muon_shapes, simulate

from . import _workers_heads as W
from ._common import nonzero

QKV = ("blocks.0.attn.qkv.weight", "blocks.1.attn.qkv.weight")


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def world_results(request):
    return request.param, launch(W.everything, request.param, timeout_s=240)


def _close(got: dict, want: dict, where) -> None:
    for name, ref in want.items():
        torch.testing.assert_close(got[name], ref, rtol=1e-6, atol=1e-6, msg=f"{where} {name}")


@pytest.mark.timeout(300)
def test_split_heads_on_fsdp2_and_ddp_match_one_process(world_results):
    world, results = world_results
    refs = {(split, rule): W.single_process_gpt(world, split, rule)
            for split, rule in (("heads", "muon"), ("qkv", "muon"), ("heads", "normuon"))}
    for case in W.CASES:
        for rank, res in results.items():
            _close(res[case]["params"], refs[(case[1], case[3] if len(case) > 3 else "muon")], (world, case, rank))


@pytest.mark.timeout(300)
def test_blocks_cut_by_the_shards_are_separate_matrices_at_the_byte_bound(world_results):
    world, results = world_results
    model = W.build_gpt(**W.GPT_CFG)
    for case in W.CASES:
        mode, split = case[:2]
        blocks, rows = (9, 8) if split == "heads" else (3, 24)
        plans = [res[case]["plan"] for res in results.values()]
        assert all(p == plans[0] for p in plans)
        if len(case) > 2 and case[2]:  # under a budget of one matrix: a batch per QKV, each at the bound
            cut = [b for b in plans[0] if b.path == "blocks"]
            assert [b.names for b in cut] == [QKV[:1], QKV[1:]] or [b.names for b in cut] == [QKV[1:], QKV[:1]], cut
            assert all(sum(b.bytes_sent) == lower_bound_bytes(Plan((b,))) for b in cut)
            continue
        (qkv,) = [b for b in plans[0] if b.names == QKV]
        assert qkv.matrix_shape == (rows, 24) and qkv.num_matrices == 2 * blocks, (case, qkv)
        # FSDP2's shards cut heads (36 or 18 rows a rank): each block on one owner, moved at the bound;
        # DDP: one owner per parameter orthogonalizes its blocks
        assert qkv.path == ("blocks" if mode == "fsdp" else "owner"), (case, qkv.path)
        if mode == "fsdp":
            assert len(qkv.owners) == 2 * blocks and sum(qkv.bytes_sent) == lower_bound_bytes(Plan((qkv,)))
            sim = simulate(muon_shapes(model), world, fused_banks={n: blocks for n in QKV}, profile="cpu_gloo",
                           comm_dtype=torch.float32, ns_dtype=torch.float32, device="cpu")
            row = lambda b: (b.path, b.names, b.matrix_shape, b.num_matrices, b.owners, b.bytes_sent, b.flops)  # noqa: E731
            assert [row(b) for b in sim] == [row(b) for b in plans[0]], case
        for res in results.values():
            r = res[case]
            # NorMuon's per-head norms travel beside the plan, in an all-reduce counted under its name
            sent, recv = nonzero(r["sent"]), nonzero(r["recv"])
            assert (sent.pop("normuon", 0) > 0) == (recv.pop("normuon", 0) > 0) == (len(case) > 3), case
            assert sent == r["plan_sent"] and recv == r["plan_recv"], case
            (choice,) = [c for c in r["choices"] if c["names"] == QKV]
            assert choice["shape"] == (rows, 24) and choice["matrices"] == 2 * blocks and choice["path"] == qkv.path


@pytest.mark.timeout(300)
def test_fused_banks_cut_anywhere_and_an_empty_shard_match_one_process(world_results):
    world, results = world_results
    opt, params = W.train_banks(None)
    want = {n: p.detach() for n, p in params}
    paths = {}
    for rank, res in results.items():
        r = res["banks"]
        _close(r["params"], want, (world, rank))
        assert nonzero(r["sent"]) == r["plan_sent"] and nonzero(r["recv"]) == r["plan_recv"]
        paths = {b.names: b.path for b in r["plan"]}
        for b in r["plan"]:
            if b.path == "blocks":
                assert sum(b.bytes_sent) == lower_bound_bytes(Plan((b,))) > 0, b
    if world == 4:  # every bank cut, "six" with rank 3's shard empty
        assert paths == {("ten",): "blocks", ("six",): "blocks", ("tall",): "blocks"}, paths
    else:  # "six" lies in whole blocks (3, 3)
        assert paths[("six",)] in ("local", "rebalance") and paths[("ten",)] == paths[("tall",)] == "blocks", paths
