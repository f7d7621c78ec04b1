"""Muon.resolved_choices: what "auto" settings mean per batch, before and after a step."""

import torch

from muonlab.optim.muon import Muon


def _params():
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(96, 32)), torch.nn.Parameter(torch.randn(8, 8))]


def test_forced_settings_are_reported_as_given():
    ps = _params()
    opt = Muon(ps, lr=0.02, ns_dtype=torch.float32, ns_form="gram")
    rows = {r["shape"]: r for r in opt.resolved_choices()}
    assert rows[(96, 32)]["dtype"] == "float32" and rows[(96, 32)]["form"] == "gram"
    assert rows[(96, 32)]["backend"] == "torch" and rows[(96, 32)]["path"] == "local"


def test_after_a_step_rows_are_what_ran_and_match_the_prediction():
    ps = _params()
    opt = Muon(ps, lr=0.02)
    before = opt.resolved_choices()
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()
    after = opt.resolved_choices()
    assert after == before
    assert set(opt._runner.ran) == {(96, 32), (8, 8)}  # the rows came from what ran, not from the rules
    assert {r["names"] for r in after} == {("param0",), ("param1",)}
