"""Matrix views on FSDP2 (2 gloo ranks): flattened conv kernels row-sharded on dim 0 and a
transposed Conv1D weight train exactly like one process, and simulate() plans them alike."""

from __future__ import annotations

import pytest
import torch

from muonlab.launcher import launch
from muonlab.simulate import muon_shapes, simulate

from . import _workers_views as W
from ._common import nonzero

WORLD = 2


@pytest.mark.timeout(300)
def test_flattened_conv_kernels_and_conv1d_on_fsdp2_match_one_process():
    results = launch(W.fsdp_views, WORLD, timeout_s=240)
    ref = W.single_process()
    for rank, res in results.items():
        for name, want in ref.items():
            torch.testing.assert_close(res["params"][name], want, rtol=1e-5, atol=1e-6, msg=f"{rank} {name}")
        assert res["plan"] == results[0]["plan"]
        assert nonzero(res["sent"]) == res["plan_sent"] and nonzero(res["recv"]) == res["plan_recv"]
    shapes = results[0]["shapes"]
    assert shapes[("0.weight",)] == ((6, 36), 1) and shapes[("1.weight",)] == ((5, 54), 1)
    assert shapes[("2.weight",)] == ((5, 12), 1)  # stored (in, out): moved and orthogonalized as stored
    assert shapes[("5.weight",)] == ((1, 5), 1)  # one filter: rank 1's shard is empty
    # the kernels are row-sharded matrices (a path moves their rows), not whole local experts
    paths = {row[1]: row[0] for row in results[0]["plan"]}
    assert paths[("0.weight",)] not in ("local", "rebalance")
    sim = simulate(muon_shapes(W.build_model(), conv="muon"), WORLD, profile="cpu_gloo", comm_dtype=torch.float32)
    assert [(b.path, b.names, b.owners, b.bytes_sent, b.flops) for b in sim] == results[0]["plan"]
