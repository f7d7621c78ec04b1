"""Bad input met after construction: a group edited between steps, a parameter resized, a saved
state or group that doesn't fit, names and items of groups; and two updates that must keep
torch.optim.Muon's bits (bf16 weight decay) or the copy's own step (a scheduler attached).
Each error names what is at fault and comes before anything changes."""

import copy
import pickle

import pytest
import torch

from muonlab import Muon, muon_param_groups


def _pair(seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.nn.Parameter(torch.randn(8, 4, generator=gen))
    b = torch.nn.Parameter(torch.randn(8, generator=gen))
    opt = Muon([{"params": [("w", w)]}, {"params": [("b", b)], "algorithm": "adamw"}], ns_dtype=torch.float32)
    return w, b, opt


def _step(opt, w, b, seed=1):
    gen = torch.Generator().manual_seed(seed)
    w.grad, b.grad = torch.randn(w.shape, generator=gen), torch.randn(b.shape, generator=gen)
    opt.step()


def _snapshot(opt, *params):
    return [p.detach().clone() for p in params], copy.deepcopy({id(p): s for p, s in opt.state.items()})


def _unchanged(opt, params, snap):
    values, state = snap
    assert all(torch.equal(p.detach(), v) for p, v in zip(params, values))
    now = {id(p): s for p, s in opt.state.items() if s}
    assert now.keys() == {k for k, s in state.items() if s}
    for k, s in now.items():
        for key, value in s.items():
            assert torch.equal(value, state[k][key]), key


@pytest.mark.parametrize("key, value, match", [
    ("lr", -0.02, r"lr must be >= 0, got -0.02 in parameter group 0"),
    ("lr", None, r"lr must be a number, got None .* in parameter group 0"),
    ("adjust_lr", "bad", r"unknown adjust_lr 'bad' in parameter group 0"),
    ("momentum_form", "x", r"unknown momentum_form 'x' in parameter group 0"),
    ("ns_steps", 0, r"in parameter group 0"),
])
def test_a_group_setting_written_between_steps_is_refused_before_anything_changes(key, value, match):
    w, b, opt = _pair()
    _step(opt, w, b)
    opt.param_groups[0][key] = value  # what a scheduler or a user may write
    snap = _snapshot(opt, w, b)
    with pytest.raises((ValueError, TypeError), match=match):
        _step(opt, w, b, seed=2)
    _unchanged(opt, (w, b), snap)


def test_a_deleted_setting_is_named():
    w, b, opt = _pair()
    del opt.param_groups[1]["betas"]
    with pytest.raises(ValueError, match=r"missing setting\(s\) \['betas'\] in parameter group 1"):
        _step(opt, w, b)
    assert not opt.state


def test_a_resized_parameter_is_planned_anew():
    """Its state dropped as the resize error advises, the next step plans the new shape: the same
    update as a fresh optimizer's (the plan of the old shape cut it into two 8 x 4 halves)."""
    w, b, opt = _pair()
    _step(opt, w, b)
    w.data = torch.randn(16, 4)
    del opt.state[w]
    fresh_w = torch.nn.Parameter(w.detach().clone())
    fresh = Muon([fresh_w], ns_dtype=torch.float32)
    g = torch.randn(16, 4)
    w.grad, fresh_w.grad, b.grad = g.clone(), g.clone(), None
    opt.step()
    fresh.step()
    assert torch.equal(w.detach(), fresh_w.detach())


def test_a_parameter_that_stops_being_a_matrix_is_named_before_state_is_made():
    w, b, opt = _pair()
    _step(opt, w, b)
    w.data, w.grad = torch.randn(8), torch.randn(8)
    del opt.state[w]
    b.grad = torch.randn(8)
    snap = _snapshot(opt, w, b)
    with pytest.raises(ValueError, match=r"Muon needs parameters with at least 2 dims, got 'w' of shape \(8\)"):
        opt.step()
    _unchanged(opt, (w, b), snap)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
def test_a_gradient_that_is_not_floating_point_is_refused(dtype):
    w, b, opt = _pair()
    w.grad_dtype = None  # torch >= 2.10 lets a gradient differ in dtype only so
    try:
        w.grad = torch.ones(8, 4, dtype=dtype)
    except RuntimeError as err:
        pytest.skip(f"this torch refuses such a gradient itself: {err}")
    b.grad = torch.randn(8)
    with pytest.raises(TypeError, match=rf"'w' of shape \(8, 4\) has a gradient of dtype {dtype}"):
        opt.step()
    assert not opt.state


@pytest.mark.parametrize("edit, error, match", [
    (lambda g: g.__setitem__("lr", float("nan")), ValueError, r"lr must be finite, got nan in saved parameter group 0"),
    (lambda g: g.__setitem__("momentum", 2.0), ValueError, r"momentum must be in \[0, 1\).* saved parameter group 0"),
    (lambda g: g.__setitem__("adjust_lr", "bad"), ValueError, r"unknown adjust_lr 'bad' in saved parameter group 0"),
    (lambda g: g.__setitem__("algorithm", "adamw"), ValueError, r"saved parameter group 0 is a 'adamw' group"),
])
def test_a_saved_group_out_of_range_is_refused_at_load(edit, error, match):
    w, b, opt = _pair()
    _step(opt, w, b)
    sd = copy.deepcopy(opt.state_dict())
    edit(sd["param_groups"][0])
    w2, b2, opt2 = _pair()
    _step(opt2, w2, b2)
    settings = [{k: v for k, v in g.items() if k != "params"} for g in opt2.param_groups]
    snap = _snapshot(opt2, w2, b2)
    with pytest.raises(error, match=match):
        opt2.load_state_dict(sd)
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt2.param_groups] == settings
    _unchanged(opt2, (w2, b2), snap)


def test_a_saved_group_without_a_setting_keeps_this_groups_value():
    """A checkpoint saved before a setting existed: the group keeps the optimizer's own value."""
    w, b, opt = _pair()
    _step(opt, w, b)
    sd = copy.deepcopy(opt.state_dict())
    del sd["param_groups"][0]["momentum_form"]
    w2, b2, opt2 = _pair()
    opt2.param_groups[0]["momentum_form"] = "sum"
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["momentum_form"] == "sum"
    _step(opt2, w2, b2)


@pytest.mark.parametrize("edit, error, match", [
    (lambda sd: sd["state"][1].pop("exp_avg"), ValueError,
     r"'b' of shape \(8\) \(adamw\) has saved state keys \['exp_avg_sq', 'step'\]"),
    (lambda sd: sd["state"][0].__setitem__("momentum_buffer", [0.0]), TypeError,
     r"'w' of shape \(8, 4\) has saved momentum_buffer of type list"),
    (lambda sd: sd["state"][1].__setitem__("step", torch.tensor(-1.0)), ValueError,
     r"'b' of shape \(8\) has a saved AdamW step of -1.0"),
    (lambda sd: sd.pop("state"), TypeError, r"state_dict must be a dict with 'state' and 'param_groups'"),
    (lambda sd: sd.__setitem__("state", []), TypeError, r"state_dict\['state'\] must be a dict"),
])
def test_saved_state_of_the_wrong_kind_is_refused_at_load(edit, error, match):
    w, b, opt = _pair()
    _step(opt, w, b)
    sd = copy.deepcopy(opt.state_dict())
    edit(sd)
    w2, b2, opt2 = _pair()
    with pytest.raises(error, match=match):
        opt2.load_state_dict(sd)
    assert not opt2.state


@pytest.mark.parametrize("eps, algorithm, match", [
    (1e39, "muon", r"eps must be in \(0, 1\], got 1e\+39"),
    (0.0, "adamw", r"eps must be > 0, got 0.0"),
])
def test_eps_out_of_range_is_refused_at_construction(eps, algorithm, match):
    w = torch.nn.Parameter(torch.randn(8, 4))
    with pytest.raises(ValueError, match=match):
        Muon([{"params": [w], "algorithm": algorithm, "eps": eps}])


@pytest.mark.parametrize("params, error, match", [
    ([3], TypeError, r"parameter group 2 holds a int, not a Tensor"),
    ([None], TypeError, r"parameter group 2 holds a NoneType, not a Tensor"),
    ([], ValueError, r"parameter group 2 has an empty parameter list"),
])
def test_add_param_group_checks_its_items_as_the_constructor_does(params, error, match):
    w, b, opt = _pair()
    with pytest.raises(error, match=match):
        opt.add_param_group({"params": params})
    assert len(opt.param_groups) == 2


def test_param_names_name_the_parameters_and_a_name_given_twice_is_refused():
    w, v = torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(8, 4))
    opt = Muon([{"params": [w, v], "param_names": ["enc.w", "dec.w"]}])
    assert (opt.param_name(w), opt.param_name(v)) == ("enc.w", "dec.w")
    assert "param_names" not in opt.param_groups[0]
    with pytest.raises(ValueError, match=r"parameter group 0: param_names must be a list of 2 str"):
        Muon([{"params": [w, v], "param_names": ["enc.w"]}])
    with pytest.raises(ValueError, match=r"the name 'w' is given to two different tensors"):
        Muon([("w", w), ("w", v)])
    with pytest.raises(ValueError, match=r"the name 'enc.w' is given to two different tensors"):
        opt.add_param_group({"params": [("enc.w", torch.nn.Parameter(torch.randn(4, 4)))]})


def test_muon_param_groups_names_its_misused_arguments():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    with pytest.raises(TypeError, match=r"needs the model \(an nn.Module\), got generator"):
        muon_param_groups(model.parameters())
    with pytest.raises(TypeError, match=r"include must be a pattern \(str\) or a list of patterns, got int 3"):
        muon_param_groups(model, include=3)
    assert [len(g["params"]) for g in muon_param_groups(model, exclude=None)] == \
        [len(g["params"]) for g in muon_param_groups(model)]


def test_bf16_weight_decay_keeps_torch_muons_bits():
    """On a CPU _foreach_mul_ rounds its scalar to bf16 (0.998 -> 0.99609375); torch's mul_ does not."""
    gen = torch.Generator().manual_seed(0)
    ours = torch.nn.Parameter(torch.randn(16, 32, generator=gen).bfloat16())
    theirs = torch.nn.Parameter(ours.detach().clone())
    a = Muon([ours], lr=0.02, weight_decay=0.1, ns_dtype=torch.bfloat16, ns_form="plain", ns_backend="torch",
             ns_coefficients=(3.4445, -4.7750, 2.0315))
    b = torch.optim.Muon([theirs], lr=0.02, weight_decay=0.1, adjust_lr_fn="original")
    for _ in range(5):
        g = torch.randn(16, 32, generator=gen).bfloat16()
        ours.grad, theirs.grad = g.clone(), g.clone()
        a.step()
        b.step()
    assert torch.equal(ours.detach(), theirs.detach())


def test_copies_of_a_muon_with_a_scheduler_step_themselves():
    """An LR scheduler wraps the optimizer's step in an instance attribute that refers to that
    optimizer: a copy must keep its own step (and a pickle must not hold the wrapper)."""
    w = torch.nn.Parameter(torch.randn(8, 16))
    opt = Muon([w], lr=0.02, ns_dtype=torch.float32)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    w.grad = torch.randn(8, 16)
    opt.step()
    sched.step()
    for copy_of in (copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o))):
        twin = copy_of(opt)
        w2 = twin.param_groups[0]["params"][0]
        g = torch.randn(8, 16)
        w.grad, w2.grad = g.clone(), g.clone()
        before = w.detach().clone()
        twin.step()
        assert torch.equal(w.detach(), before)  # the original did not move
        opt.step()
        assert torch.equal(w.detach(), w2.detach())


def test_a_saved_group_that_is_not_a_dict_is_named():
    w, b, opt = _pair()
    _step(opt, w, b)
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][1] = list(sd["param_groups"][1].items())
    w2, b2, opt2 = _pair()
    with pytest.raises(TypeError, match=r"saved parameter group 1 is a list, not a dict"):
        opt2.load_state_dict(sd)
    assert not opt2.state
