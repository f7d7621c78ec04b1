"""Muon's prepared step (muonlab.optim.prepared): made once, reused while nothing it depends on
changes, remade when something does; settings read per step are still checked and applied."""

import pytest
import torch

from muonlab import Muon


def _setup(n=3, **kwargs):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(16, 8)) for _ in range(n)]
    bias = torch.nn.Parameter(torch.randn(8))
    opt = Muon([{"params": params}, {"params": [bias], "algorithm": "adamw"}], ns_dtype=torch.float32, **kwargs)
    return params, bias, opt


def _grads(params, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    for p in (*params, bias):
        p.grad = torch.randn(p.shape, generator=gen)


def _counting_collect(opt, monkeypatch):
    calls = []
    real = opt._collect
    monkeypatch.setattr(opt, "_collect", lambda: calls.append(1) or real())
    return calls


def test_a_steady_step_reuses_the_prepared_step(monkeypatch):
    params, bias, opt = _setup()
    calls = _counting_collect(opt, monkeypatch)
    for step in range(4):
        _grads(params, bias, step)
        opt.step()
    assert len(calls) == 1
    prepared = opt._prepared
    _grads(params, bias, 9)
    opt.step()
    assert opt._prepared is prepared and len(calls) == 1


@pytest.mark.parametrize("change", ["grad_none", "ns_steps", "coefficients_in_place", "new_group_dict",
                                    "ns_form", "resized"])
def test_a_change_it_depends_on_makes_a_new_one(change, monkeypatch):
    params, bias, opt = _setup(ns_coefficients=[(3.4445, -4.7750, 2.0315)] * 5)
    _grads(params, bias, 0)
    opt.step()
    calls = _counting_collect(opt, monkeypatch)
    _grads(params, bias, 1)
    if change == "grad_none":
        params[1].grad = None
    elif change == "ns_steps":
        opt.param_groups[0]["ns_steps"] = 4
        opt.param_groups[0]["ns_coefficients"] = opt.param_groups[0]["ns_coefficients"][:4]
    elif change == "coefficients_in_place":  # the same list object, changed: frozen in the key
        opt.param_groups[0]["ns_coefficients"][0] = (3.0, -3.0, 1.0)
    elif change == "new_group_dict":  # the hot step reads settings from the group dict itself
        opt.param_groups[0] = dict(opt.param_groups[0], lr=0.05)
    elif change == "ns_form":
        opt.ns_form = "gram"
    elif change == "resized":  # its state is dropped too, or the new prepared step refuses it
        params[2].data = torch.randn(16, 4)
        params[2].grad = torch.randn(16, 4)
        del opt.state[params[2]]
    before = opt._prepared
    opt.step()
    assert len(calls) == 1 and opt._prepared is not before
    assert len(opt._prepared.checked) == (3 if change == "grad_none" else 4)


def test_per_step_settings_are_applied_without_a_new_prepared_step(monkeypatch):
    """A schedule's lr, momentum and weight decay reach the step as a fresh optimizer with those
    values would take it, bit for bit; nothing is prepared again."""
    params, bias, opt = _setup()
    twin_params, twin_bias, _ = _setup()
    _grads(params, bias, 0)
    opt.step()
    calls = _counting_collect(opt, monkeypatch)
    twin = Muon([{"params": twin_params}, {"params": [twin_bias], "algorithm": "adamw"}], ns_dtype=torch.float32)
    _grads(twin_params, twin_bias, 0)
    twin.step()
    for step, (lr, wd, mu) in enumerate([(0.01, 0.1, 0.9), (0.005, 0.0, 0.8)], start=1):
        for o in (opt, twin):
            o.param_groups[0].update(lr=lr, weight_decay=wd, momentum=mu)
            o.param_groups[1]["lr"] = lr / 10
        _grads(params, bias, step)
        _grads(twin_params, twin_bias, step)
        opt.step()
        twin.step()
    assert len(calls) == 0
    assert all(torch.equal(a, b) for a, b in zip((*params, bias), (*twin_params, twin_bias)))


def test_a_bad_setting_written_between_steps_is_refused_before_anything_changes():
    params, bias, opt = _setup()
    _grads(params, bias, 0)
    opt.step()
    before = [p.detach().clone() for p in (*params, bias)]
    opt.param_groups[0]["lr"] = -1.0
    _grads(params, bias, 1)
    with pytest.raises(ValueError, match="lr must be >= 0.*parameter group 0"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, (*params, bias)))
    opt.param_groups[1]["betas"] = (0.9, 1.5)
    opt.param_groups[0]["lr"] = 0.02
    with pytest.raises(ValueError, match="parameter group 1"):
        opt.step()
    opt.param_groups[1]["betas"] = (0.9, 0.95)
    opt.param_groups[0]["lr"] = torch.tensor([0.02, 0.01])  # a tensor lr of two elements
    with pytest.raises(ValueError, match="a tensor lr must have exactly one element in parameter group 0"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, (*params, bias)))
    opt.param_groups[0]["lr"] = torch.tensor(0.02)
    opt.step()  # fixed: steps again


def test_a_copy_and_a_loaded_optimizer_prepare_anew():
    import copy

    params, bias, opt = _setup()
    _grads(params, bias, 0)
    opt.step()
    assert opt._prepared is not None
    twin = copy.deepcopy(opt)
    assert twin._prepared is None
    opt.load_state_dict(opt.state_dict())
    assert opt._prepared is None  # a loaded state is checked against its parameters again
    opt.step()
    assert opt._prepared is not None
