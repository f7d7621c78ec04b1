"""Muon's options are applied or refused, never ignored (muonlab.optim.options): the ``options``
record takes only a MuonOptions, every option set after construction (capture_after included) is
checked or refused, a near-miss of an option's name is refused, the other algorithm's group
settings are refused by name, and the first calls a researcher makes (parallelize, Muon with
ns_backend="triton", newton_schulz) refuse what they can't run before anything starts."""

import copy
import dataclasses
import pickle

import pytest
import torch

import muonlab.kernels.triton_newton_schulz as tns
from muonlab import Muon, muon_param_groups
from muonlab.distributed import apply_ddp, apply_fsdp, fsdp_units, parallelize
from muonlab.kernels.newton_schulz import newton_schulz
from muonlab.optim import muon as muon_module
from muonlab.optim import param_groups as param_groups_module
from muonlab.optim.options import CONSTRUCTOR_ONLY, MuonOptions


def _params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.nn.Parameter(torch.randn(8, 4, generator=gen)), torch.nn.Parameter(torch.randn(4, generator=gen)))


def _muon(params=None, **options):
    w, b = params or _params()
    return Muon([dict(params=[("w", w)]), dict(params=[("b", b)], algorithm="adamw")], **options)


def _step(opt, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = torch.randn(p.shape, generator=gen)
    opt.step()


def _values(opt):
    return [p.detach().clone() for g in opt.param_groups for p in g["params"]]


# ---------------------------------------------------------------- 1. the record takes only a MuonOptions


@pytest.mark.parametrize("value", ["plain", dict(ns_form="plain"), None])
def test_options_takes_only_a_muon_options_record_and_a_refusal_changes_nothing(value):
    opt = _muon()
    before = opt.options
    with pytest.raises(TypeError, match=rf"options must be a MuonOptions .*got {type(value).__name__}"):
        opt.options = value
    assert opt.options is before
    _step(opt)  # still steps
    opt.options = dataclasses.replace(before, ns_form="plain")  # a record is taken
    assert opt.ns_form == "plain"


# ---------------------------------------------------------------- 2. options set after construction


def test_capture_after_is_an_option_of_the_record_and_refused_where_it_cant_run():
    """On the CPU a capture can't run: set after construction it is refused, by the same checks as
    the constructor's, and nothing changes."""
    opt = _muon(nonfinite_decision="device")
    before = opt.options
    assert "capture_after" in {f.name for f in dataclasses.fields(MuonOptions)} and opt.capture_after is None
    with pytest.raises(ValueError, match=r"capture_after needs CUDA parameters: parameter 'w' of shape \(8, 4\)"):
        opt.capture_after = 2
    with pytest.raises(ValueError, match="capture_after must be None or an int >= 1"):
        opt.capture_after = 0
    assert opt.options is before and opt._step_graph is None
    host = _muon(nonfinite_decision="host")  # the record's own check, whatever the parameters
    with pytest.raises(ValueError, match='capture_after needs nonfinite_decision="device"'):
        host.capture_after = 2
    offloaded = _muon(nonfinite_decision="device", state_offload="cpu")
    with pytest.raises(ValueError, match="capture_after needs the state on the parameters' device"):
        offloaded.capture_after = 2


def test_capture_after_set_later_makes_a_new_step_graph_that_the_prepared_key_sees(monkeypatch):
    """Where the parameters could be captured (their checks stubbed here: the CPU has no CUDA),
    setting capture_after makes a new StepGraph counting its own warm-up, and the record (which
    the prepared step's key holds) changes with it; None drops it."""
    for module in (muon_module, param_groups_module):
        monkeypatch.setattr(module, "check_capture_place", lambda *args: None)
    opt = _muon(nonfinite_decision="device")
    _step(opt)
    key = opt._prepared.key
    opt.capture_after = 3
    assert opt._step_graph is not None and opt._step_graph.after == 3
    assert opt.options.capture_after == 3 and key[-1] != opt.options  # a new prepared step
    graph = opt._step_graph
    opt.capture_after = 3  # the same value: the same graph (its warm-up kept)
    assert opt._step_graph is graph
    opt.capture_after = None
    assert opt._step_graph is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_capture_after_set_later_captures_the_step_on_cuda():
    params = [torch.nn.Parameter(p.detach().cuda()) for p in _params()]
    opt = _muon(params, nonfinite_decision="device", ns_backend="torch")
    for p in params:
        p.grad = torch.zeros_like(p)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for step in range(5):
        if step == 2:
            opt.capture_after = 1  # one eager step with the new record, then the capture
        for p in params:
            p.grad.copy_(torch.randn(p.shape, device="cuda", generator=gen))  # in place: a graph reads them there
        opt.step()
        assert opt._step_graph is None or opt._step_graph.captured == (step >= 3), step


def test_capture_after_pickled_beside_the_record_loads_into_it():
    """Pickles made when capture_after was an attribute of its own load it into the record."""
    opt = _muon(nonfinite_decision="device")
    state = opt.__getstate__()
    state["capture_after"] = 2  # as pickled then
    old = Muon.__new__(Muon)
    old.__setstate__(state)
    assert old.options == dataclasses.replace(opt.options, capture_after=2)
    assert "capture_after" not in vars(old) and old._step_graph.after == 2


@pytest.mark.parametrize("name", CONSTRUCTOR_ONLY)
def test_constructor_only_arguments_set_later_are_refused(name):
    opt = _muon()
    with pytest.raises(AttributeError, match=f"{name} can't be changed after construction.*pass it to the constructor"):
        setattr(opt, name, {} if name in ("fused_banks", "matrix_views") else None)
    assert opt.fused_banks == {}


@pytest.mark.parametrize("name, key, algorithm", [("lr", "lr", "Muon"), ("update_rule", "update_rule", "Muon"),
                                                  ("adamw_betas", "betas", "AdamW")])
def test_group_settings_set_on_the_optimizer_are_refused_with_where_they_live(name, key, algorithm):
    opt = _muon()
    with pytest.raises(AttributeError, match=rf"{name} is a parameter-group setting.*group\['{key}'\] in each {algorithm}"):
        setattr(opt, name, 0.1)
    assert name not in vars(opt)


# ---------------------------------------------------------------- 3. near-misses of a name


@pytest.mark.parametrize("typo, meant", [("ns_fomr", "ns_form"), ("capture_afer", "capture_after"),
                                         ("nonfinite_decison", "nonfinite_decision"), ("strategie", "strategy")])
def test_a_near_miss_of_an_option_name_is_refused_with_the_name_meant(typo, meant):
    opt = _muon()
    before = opt.options
    with pytest.raises(AttributeError, match=f"did you mean '{meant}'"):
        setattr(opt, typo, "plain")
    assert typo not in vars(opt) and opt.options is before


def test_other_names_private_names_torch_and_copies_are_untouched():
    opt = _muon()
    opt._anything = 1  # private: never checked
    opt.run_label = "baseline"  # far from every option: a user's own attribute
    opt.ns_form = "plain"  # an option: a new record
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1)  # wraps opt.step
    _step(opt)
    scheduler.step()
    opt.skipped_steps = 0  # a property
    twin = copy.deepcopy(opt)
    loaded = pickle.loads(pickle.dumps(opt))
    assert twin.options == opt.options == loaded.options and loaded.run_label == "baseline"
    with pytest.raises(AttributeError, match="did you mean 'ns_form'"):
        twin.ns_fomr = "plain"  # a copy checks too
    state = opt.state_dict()
    fresh = _muon()
    fresh.load_state_dict(state)
    _step(fresh)


# ---------------------------------------------------------------- 4. the other algorithm's group settings


@pytest.mark.parametrize("algorithm, key, value", [("adamw", "update_rule", "normuon"), ("adamw", "normuon_beta2", 0.9),
                                                   ("adamw", "ns_steps", 3), ("muon", "betas", (0.9, 0.9))])
def test_settings_of_the_other_algorithm_are_refused_by_name(algorithm, key, value):
    w, b = _params()
    p = w if algorithm == "muon" else b
    other = [dict(params=[b], algorithm="adamw")] if algorithm == "muon" else [dict(params=[w])]
    reader = "AdamW" if algorithm == "muon" else "Muon"
    match = rf"\['{key}'\] is a setting of {reader} groups, which an? \w+ group does not read in parameter group"
    with pytest.raises(ValueError, match=match):
        Muon([dict(params=[p], algorithm=algorithm, **{key: value})] + other)
    opt = Muon(other)
    with pytest.raises(ValueError, match=match):
        opt.add_param_group(dict(params=[p], algorithm=algorithm, **{key: value}))
    assert len(opt.param_groups) == 1
    # written into a group later: refused by the step's check of changed settings, before any change
    opt.add_param_group(dict(params=[p], algorithm=algorithm))
    _step(opt)
    opt.param_groups[1][key] = value  # nothing else changed: the new key alone makes the step check
    before = _values(opt)
    with pytest.raises(ValueError, match=match):
        _step(opt)
    assert all(torch.equal(x, y) for x, y in zip(before, _values(opt)))


def test_a_momentum_a_scheduler_cycles_into_an_adamw_group_is_still_read():
    opt = _muon()
    _step(opt)
    opt.param_groups[1]["momentum"] = 0.85  # OneCycleLR's beta1 (see Muon's docstring)
    _step(opt)


# ---------------------------------------------------------------- 5. the entry points' model


@pytest.mark.parametrize("call", [lambda m: parallelize(m, "fsdp"), lambda m: parallelize(m, "ddp"),
                                  lambda m: apply_fsdp(m, None), lambda m: apply_ddp(m), lambda m: fsdp_units(m),
                                  lambda m: muon_param_groups(m)])
def test_entry_points_refuse_a_model_that_is_no_module_naming_its_type(call):
    with pytest.raises(TypeError, match=r"model.*\b(list)\b"):
        call([torch.nn.Parameter(torch.randn(2, 2))])


def test_parallelize_refuses_a_mesh_that_is_no_device_mesh_before_anything_moves():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(TypeError, match="parallelize takes mesh as a DeviceMesh.*got str"):
        parallelize(model, "fsdp", mesh="dp")


# ---------------------------------------------------------------- 6. ns_backend="triton" where it can't run


def test_triton_on_a_cpu_without_the_interpreter_is_refused_at_construction_with_the_reason(monkeypatch):
    monkeypatch.setattr(tns, "INTERPRET", False)  # as in a process started without TRITON_INTERPRET=1
    reason = "TRITON_INTERPRET=1 was not set" if tns.TRITON_AVAILABLE else "triton is not installed"
    w, b = _params()
    with pytest.raises(ValueError, match=rf"ns_backend='triton' can't run on parameter 'w' of shape \(8, 4\).*{reason}"):
        _muon((w, b), ns_backend="triton")
    opt = _muon((w, b))  # and set later: refused, nothing changed
    before = opt.options
    with pytest.raises(ValueError, match=reason):
        opt.ns_backend = "triton"
    assert opt.options is before
    with pytest.raises(ValueError, match=reason):  # newton_schulz: before anything, even for no matrices
        newton_schulz(torch.randn(0, 8, 4), backend="triton")


def test_triton_not_installed_is_the_reason_given(monkeypatch):
    monkeypatch.setattr(tns, "TRITON_AVAILABLE", False)
    with pytest.raises(ValueError, match="triton is not installed"):
        _muon(ns_backend="triton")
