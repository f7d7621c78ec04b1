import copy

import pytest
import torch
import torch.optim._muon as torch_muon

from muonlab import Muon, muon_param_groups
from muonlab.models import GPT, GPTConfig
from muonlab.kernels.reference import reference_newton_schulz
from muonlab.optim.reference import reference_muon_step

SHAPES = [(24, 64), (64, 24), (40, 40)]  # wide, tall, square


def _params(shapes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


def _grads(shapes, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen) for s in shapes] for _ in range(steps)]


def _rel_displacement(p_fast, p_ref, p0):
    return max(((a - b).norm() / (b - c).norm()).item() for a, b, c in zip(p_fast, p_ref, p0))


def _fp32_torch_ns(grad, ns_coefficients, ns_steps, eps):
    # torch.optim.Muon's iteration (one (a, b, c) repeated, input / max(norm, eps)) with its bf16
    # cast removed, for a tight comparison
    return reference_newton_schulz(grad, ns_steps, [ns_coefficients], eps, dtype=torch.float32)


def _run_pair(monkeypatch, ns_dtype, fp32_torch, wd=0.01):
    if fp32_torch:
        monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", _fp32_torch_ns)
    ours, theirs = _params(SHAPES), _params(SHAPES)
    p0 = [p.detach().clone() for p in ours]
    a = Muon(ours, lr=0.02, weight_decay=wd, ns_dtype=ns_dtype)
    b = torch.optim.Muon(theirs, lr=0.02, weight_decay=wd, adjust_lr_fn="original")
    for grads in _grads(SHAPES, 10):
        for p, q, g in zip(ours, theirs, grads):
            p.grad, q.grad = g.clone(), g.clone()
        a.step()
        b.step()
    return _rel_displacement(ours, theirs, p0)


def test_parity_with_torch_muon_bf16(monkeypatch):
    assert _run_pair(monkeypatch, torch.bfloat16, fp32_torch=False) <= 3e-2


def test_parity_with_torch_muon_fp32_is_tight(monkeypatch):
    # both in fp32: measured ~1e-7; the bound leaves room for BLAS differences only
    assert _run_pair(monkeypatch, torch.float32, fp32_torch=True) <= 1e-5


@pytest.mark.parametrize("form", ["ema", "sum"])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr", ["original", "match_rms_adamw", "spectral", None])
def test_batched_optimizer_matches_readable_reference(form, nesterov, adjust_lr):
    shapes = SHAPES + [(3, 16, 32), (24, 64)]  # a 3-D expert bank and a same-shape pair
    ours, ref = _params(shapes), _params(shapes)
    hyper = dict(lr=0.01, momentum=0.9, nesterov=nesterov, weight_decay=0.1, ns_steps=5,
                 ns_coefficients="xtuner", eps=1e-7, adjust_lr=adjust_lr, momentum_form=form)
    opt = Muon(ours, ns_dtype=torch.float32, **hyper)
    bufs = [torch.zeros_like(p) for p in ref]
    for grads in _grads(shapes, 4):
        for p, g in zip(ours, grads):
            p.grad = g.clone()
        opt.step()
        reference_muon_step(ref, grads, bufs, ns_dtype=torch.float32, **hyper)
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_3d_bank_equals_loop_over_2d_slices():
    bank = _params([(4, 16, 48)])[0]
    slices = [torch.nn.Parameter(bank.detach()[e].clone()) for e in range(4)]
    a = Muon([bank], ns_dtype=torch.float32, weight_decay=0.1)
    b = Muon(slices, ns_dtype=torch.float32, weight_decay=0.1)
    for (g,) in _grads([(4, 16, 48)], 3):
        bank.grad = g.clone()
        for e, s in enumerate(slices):
            s.grad = g[e].clone()
        a.step()
        b.step()
    torch.testing.assert_close(bank.detach(), torch.stack([s.detach() for s in slices]), rtol=1e-6, atol=1e-6)


def _gpt_and_opt(seed=0):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(d_model=32, n_layers=2, context=16))
    opt = Muon(muon_param_groups(model), lr=0.02, weight_decay=0.01, adamw_lr=1e-3)
    return model, opt


def _train(model, opt, steps, seed, sched=None):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, 256, (4, 16), generator=gen)
        opt.zero_grad()
        model(x, x).backward()
        opt.step()
        if sched is not None:
            sched.step()


def test_resume_from_state_dict_is_exact():
    straight, opt = _gpt_and_opt()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    _train(straight, opt, 4, seed=10, sched=sched)
    model_sd = copy.deepcopy(straight.state_dict())
    opt_sd = copy.deepcopy(opt.state_dict())
    sched_sd = copy.deepcopy(sched.state_dict())
    _train(straight, opt, 4, seed=11, sched=sched)

    resumed, opt2 = _gpt_and_opt(seed=99)  # different init: everything must come from the checkpoint
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=3, gamma=0.5)
    resumed.load_state_dict(model_sd)
    opt2.load_state_dict(opt_sd)
    sched2.load_state_dict(sched_sd)
    _train(resumed, opt2, 4, seed=11, sched=sched2)
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    assert opt.param_groups[0]["lr"] == opt2.param_groups[0]["lr"] == 0.02 * 0.25


def test_state_dict_has_no_names_and_state_is_fp32_for_bf16_params():
    model, opt = _gpt_and_opt()
    model.to(torch.bfloat16)
    _train(model, opt, 1, seed=0)
    sd = opt.state_dict()
    assert all("param_names" not in g for g in sd["param_groups"])
    flat = repr(sd["param_groups"])
    assert "blocks" not in flat and "tok_emb" not in flat
    assert opt.param_name(model.blocks[0].attn.qkv.weight) == "blocks.0.attn.qkv.weight"
    for state in opt.state.values():
        for k, v in state.items():
            if k != "step":
                assert v.dtype == torch.float32
    opt.load_state_dict(sd)  # reloading keeps fp32 state for bf16 params
    assert all(v.dtype == torch.float32 for s in opt.state.values() for k, v in s.items() if k != "step")


def test_zero_grads_at_lr_zero_leave_params_unchanged_and_state_finite():
    model, opt = _gpt_and_opt()
    before = copy.deepcopy(model.state_dict())
    for group in opt.param_groups:
        group["lr"] = 0.0
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert len(opt.state) == len(list(model.parameters()))
    assert all(torch.isfinite(v).all() for s in opt.state.values() for v in s.values())


def test_params_without_grad_are_skipped():
    ps = _params([(8, 16), (8, 16)])
    before = ps[1].detach().clone()
    opt = Muon(ps)
    ps[0].grad = torch.randn(8, 16)
    opt.step()
    assert torch.equal(ps[1].detach(), before) and ps[1] not in opt.state


def test_named_parameters_are_accepted():
    model = torch.nn.Linear(8, 4, bias=False)
    opt = Muon(model.named_parameters())
    assert opt.param_name(model.weight) == "weight"
    assert "param_names" not in opt.param_groups[0]


def test_adamw_group_matches_torch_adamw():
    p, q = _params([(6,)]), _params([(6,)])
    opt = Muon([{"params": p, "algorithm": "adamw", "lr": 1e-2, "weight_decay": 0.1}])
    ref = torch.optim.AdamW(q, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for (g,) in _grads([(6,)], 5):
        p[0].grad, q[0].grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    torch.testing.assert_close(p[0], q[0], rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------- bad input


def _one(shape=(4, 8), name=None):
    p = torch.nn.Parameter(torch.randn(shape))
    return [(name, p)] if name else [p]


@pytest.mark.parametrize("make, kwargs, exc, match", [
    (lambda: _one((8,), "norm.weight"), {}, ValueError, r"'norm.weight' of shape \(8\)"),
    (lambda: _one((8,)), {}, ValueError, r"at least 2 dims, got of shape \(8\)"),
    (lambda: [], {}, ValueError, "empty parameter list"),
    (lambda: _one(), dict(lr=-1.0), ValueError, "lr must be >= 0"),
    (lambda: _one(), dict(momentum=1.0), ValueError, r"momentum must be in \[0, 1\)"),
    (lambda: _one(), dict(momentum=-0.1), ValueError, r"momentum must be in \[0, 1\)"),
    (lambda: _one(), dict(ns_coefficients="magic"), ValueError, "unknown Newton-Schulz preset 'magic'"),
    (lambda: _one(), dict(adjust_lr="bogus"), ValueError, "unknown adjust_lr"),
    (lambda: _one(), dict(momentum_form="heavy"), ValueError, "unknown momentum_form"),
    (lambda: [{"params": _one(), "algorithm": "sgd"}], {}, ValueError, "unknown algorithm 'sgd'"),
    (lambda: [{"params": _one(), "algorithm": "adamw", "momentum": 0.9}], {}, ValueError, "unknown option"),
    (lambda: [torch.randn(4, 4, requires_grad=True) * 2], {}, ValueError, "non-leaf"),
    (lambda: [torch.nn.Parameter(torch.randn(4, 4, dtype=torch.complex64))], {}, ValueError, "complex"),
])
def test_bad_construction(make, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        Muon(make(), **kwargs)


def test_param_in_two_groups_names_it():
    (name, p), = _one(name="w")
    with pytest.raises(ValueError, match="'w' of shape \\(4, 8\\) appears in more than one"):
        Muon([{"params": [(name, p)]}, {"params": [(name, p)]}])


@pytest.mark.parametrize("bad_grad, match", [
    (lambda: torch.randn(4, 8).to_sparse(), "sparse gradient"),
    (lambda: torch.randn(4, 8, dtype=torch.complex64), "complex gradient"),
])
def test_bad_grads_raise_before_anything_changes(bad_grad, match):
    good = torch.nn.Parameter(torch.randn(4, 8))
    bad = torch.nn.Parameter(torch.randn(4, 8))
    opt = Muon([("good", good), ("bad", bad)])
    good.grad = torch.randn(4, 8)
    bad.grad_dtype = None  # let autograd's dtype check through, to reach the optimizer's
    bad.grad = bad_grad()
    before = good.detach().clone()
    with pytest.raises(ValueError, match=f"'bad' of shape \\(4, 8\\) has a {match}"):
        opt.step()
    assert torch.equal(good.detach(), before) and len(opt.state) == 0


def test_changing_ns_settings_replans():
    ps = _params([(8, 16), (8, 16)])
    opt = Muon(ps, ns_dtype=torch.float32)
    for p in ps:
        p.grad = torch.ones(8, 16)
    opt.step()
    assert opt.plan()[0].ns_config.steps == 5
    opt.param_groups[0]["ns_steps"] = 7
    opt.step()
    assert opt.plan()[0].ns_config.steps == 7


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_nonfinite_grad_skips_the_step_untouched(bad):
    model, opt = _gpt_and_opt()
    _train(model, opt, 1, seed=0)  # state exists
    before = copy.deepcopy(model.state_dict())
    state_before = copy.deepcopy(opt.state_dict())
    x = torch.randint(0, 256, (2, 16))
    opt.zero_grad()
    model(x, x).backward()
    model.blocks[0].mlp.fc.weight.grad[0, 0] = bad
    opt.step()
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    after = opt.state_dict()
    for pid, state in state_before["state"].items():
        for key, value in state.items():
            assert torch.equal(after["state"][pid][key], value), (pid, key)
    stats = opt.last_step_stats()
    assert stats["skipped"] and opt.skipped_steps == 1
    assert stats["nonfinite_params"] == ["blocks.0.mlp.fc.weight"]


def test_nonfinite_grad_can_raise_naming_the_parameter():
    p = torch.nn.Parameter(torch.randn(4, 8))
    opt = Muon([("w", p)], nonfinite="raise")
    p.grad = torch.full((4, 8), float("nan"))
    with pytest.raises(ValueError, match=r"non-finite gradient on rank\(s\) \[0\]; here: w"):
        opt.step()
    with pytest.raises(ValueError, match="unknown nonfinite policy"):
        Muon([p], nonfinite="maybe")


# ---------------------------------------------------------------- matrix views

VIEW_HYPER = dict(lr=0.1, momentum=0.0, nesterov=False, weight_decay=0.0, ns_dtype=torch.float32)


def _one_step(named, seed=0, **kw):
    """One momentum-free Muon step on (name, param) pairs with random grads; the optimizer and
    {name: (param before, grad)}."""
    gen = torch.Generator().manual_seed(seed)
    opt = Muon(named, **VIEW_HYPER, **kw)
    before = {}
    for n, p in named:
        p.grad = torch.randn(p.shape, generator=gen)
        before[n] = (p.detach().clone(), p.grad.clone())
    opt.step()
    return opt, before


def _ortho(m):
    return reference_newton_schulz(m, 5, "keller", 1e-7, torch.float32)


def test_conv_kernel_in_a_muon_group_is_one_flattened_matrix():
    kernel = _params([(16, 3, 3, 3)])[0]  # 16 filters over 3 x 3 x 3 inputs: one (16, 27) matrix
    opt, before = _one_step([("conv.weight", kernel)])
    start, grad = before["conv.weight"]
    want = start - 0.1 * _ortho(grad.reshape(16, 27)).reshape(grad.shape)  # (16, 27): ratio 1
    torch.testing.assert_close(kernel.detach(), want, rtol=1e-5, atol=1e-6)
    (batch,) = opt.plan()
    assert (batch.matrix_shape, batch.num_matrices) == ((16, 27), 1)


def test_conv_kernels_routed_with_conv_muon_flatten_in_the_plan():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Conv2d(8, 8, 3), torch.nn.Linear(4, 5),
                                torch.nn.Linear(5, 2))
    opt = Muon(muon_param_groups(model, conv="muon"))
    shapes = sorted((b.matrix_shape, b.num_matrices) for b in opt.plan())
    assert shapes == [((5, 4), 1), ((8, 27), 1), ((8, 72), 1)]


@pytest.mark.parametrize("adjust_lr", ["original", "match_rms_adamw", "spectral", None])
def test_transposed_view_orthogonalizes_as_stored_with_the_out_in_ratio(adjust_lr):
    # a (in, out) = (6, 24) weight under "transpose" must move exactly like its (24, 6) transpose
    stored, plain = _params([(6, 24)])[0], _params([(24, 6)])[0]
    with torch.no_grad():
        plain.copy_(stored.T)
    _one_step([("stored", stored)], matrix_views={"stored": "transpose"}, adjust_lr=adjust_lr)
    _, before = _one_step([("plain", plain)], adjust_lr=adjust_lr)
    # the same gradient, transposed: rebuild it from the stored run's seed
    gen = torch.Generator().manual_seed(0)
    grad = torch.randn((6, 24), generator=gen)
    start = before["plain"][0]
    ratio = {"original": 2.0, "match_rms_adamw": 0.2 * 24 ** 0.5, "spectral": 2.0, None: 1.0}[adjust_lr]
    want = start.T - 0.1 * ratio * _ortho(grad)
    torch.testing.assert_close(stored.detach(), want, rtol=1e-5, atol=1e-6)


def _tiny_gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=16, n_layer=1, n_head=2, vocab_size=32, n_positions=8))


@pytest.mark.parametrize("adjust_lr, c_fc, c_proj", [("original", 2.0, 1.0), ("spectral", 2.0, 0.5)])
def test_transformers_conv1d_gets_the_ratio_of_its_out_in_shape(adjust_lr, c_fc, c_proj):
    model = _tiny_gpt2()
    opt = Muon(muon_param_groups(model), **VIEW_HYPER, adjust_lr=adjust_lr)
    mlp = model.transformer.h[0].mlp  # c_fc: 16 -> 64, stored (16, 64); c_proj: 64 -> 16
    gen = torch.Generator().manual_seed(0)
    layers = {"c_fc": mlp.c_fc.weight, "c_proj": mlp.c_proj.weight}
    grads = {n: torch.randn(p.shape, generator=gen) for n, p in layers.items()}
    starts = {n: p.detach().clone() for n, p in layers.items()}
    for n, p in layers.items():
        p.grad = grads[n].clone()
    opt.step()
    for n, want in (("c_fc", c_fc), ("c_proj", c_proj)):
        moved = (starts[n] - layers[n].detach()) / 0.1
        torch.testing.assert_close(moved, want * _ortho(grads[n]), rtol=1e-4, atol=1e-5)


def test_views_match_the_readable_reference():
    shapes = [(8, 3, 3, 3), (6, 24), (3, 16, 32), (2, 2, 5, 4)]
    views = ["flatten", "transpose", "bank", "bank"]
    ours, ref = _params(shapes), _params(shapes)
    hyper = dict(lr=0.01, momentum=0.9, nesterov=True, weight_decay=0.1, ns_steps=5, ns_coefficients="keller",
                 eps=1e-7, adjust_lr="spectral", momentum_form="ema")
    names = [f"p{i}" for i in range(len(shapes))]
    opt = Muon(list(zip(names, ours)), ns_dtype=torch.float32, matrix_views={"p1": "transpose", "p3": "bank"},
               **hyper)
    assert {b.names: (b.matrix_shape, b.num_matrices) for b in opt.plan()} == {
        ("p0",): ((8, 27), 1), ("p1",): ((6, 24), 1), ("p2",): ((16, 32), 3), ("p3",): ((5, 4), 4)}
    bufs = [torch.zeros_like(p) for p in ref]
    for grads in _grads(shapes, 3):
        for p, g in zip(ours, grads):
            p.grad = g.clone()
        opt.step()
        reference_muon_step(ref, grads, bufs, ns_dtype=torch.float32, views=views, **hyper)
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("named, kwargs, match", [
    ([("w", (6, 24))], dict(matrix_views={"w": "rows"}), r"'w' of shape \(6, 24\) has unknown matrix view 'rows'"),
    ([("w", (6, 24))], dict(matrix_views={"w": "flatten"}), r"'w' of shape \(6, 24\) can't take .*'flatten'"),
    ([("k", (4, 2, 3, 3))], dict(matrix_views={"k": "transpose"}), r"'k' of shape \(4, 2, 3, 3\) can't take"),
    ([("w", (6, 24))], dict(matrix_views={"v": "matrix"}), r"matrix_views names 'v', which is not a parameter"),
    ([("w", (8, 24))], dict(matrix_views={"w": "transpose"}, fused_banks={"w": 2}),
     r"fused bank 'w' .*view 'transpose'"),
])
def test_bad_matrix_views_raise_at_construction(named, kwargs, match):
    params = [(n, _params([s])[0]) for n, s in named]
    with pytest.raises(ValueError, match=match):
        Muon(params, **kwargs)


def test_matrix_views_for_adamw_or_not_a_dict_are_refused():
    w, b = _params([(6, 24), (24,)])
    with pytest.raises(ValueError, match="matrix_views names 'b', which is in an AdamW group"):
        Muon([{"params": [("w", w)]}, {"params": [("b", b)], "algorithm": "adamw"}], matrix_views={"b": "matrix"})
    with pytest.raises(TypeError, match="matrix_views must be a dict"):
        Muon([("w", w)], matrix_views=["w"])
