import copy
import dataclasses
import importlib

import pytest
import torch
import torch.optim._muon as torch_muon

from muonlab import Muon, muon_param_groups
from muonlab.models import GPT, GPTConfig
from muonlab.kernels.reference import reference_newton_schulz
from muonlab.kernels.config import NSConfig, form_for
from muonlab.kernels.newton_schulz import resolve_form
from muonlab.kernels.workspace import batch_bytes_per_matrix
from muonlab.optim import functional as F
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


def test_ns_form_auto_takes_gram_where_it_saves_a_fifth_of_the_flops():
    from muonlab.kernels.newton_schulz import AUTO_GRAM_SAVING

    wide, square = torch.nn.Parameter(torch.randn(16, 64)), torch.nn.Parameter(torch.randn(32, 32))
    wide.grad, square.grad = torch.randn(16, 64), torch.randn(32, 32)
    opt = Muon([wide, square], ns_dtype=torch.float32)  # fp32: the gram form iterates in fp32 too
    assert opt.ns_form == "auto"
    cfg = opt._ns_config(opt.param_groups[0])
    assert (cfg.form, cfg.gram_min_saving) == ("gram", AUTO_GRAM_SAVING)
    # the form that runs: gram on 16 x 64 (it saves 33%), plain on the square matrix
    assert {tuple(b.param_shapes[0]): form_for(b.ns_config, b.param_shapes[0]) for b in opt.plan()} == \
        {(16, 64): "gram", (32, 32): "plain"}


@pytest.mark.parametrize("native_fp16", [False, True])
def test_ns_form_auto_in_bf16_takes_gram_only_where_fp16_is_native(monkeypatch, native_fp16):
    # the gram form never iterates in bf16 (it diverged on near-low-rank momentum): fp16 where the
    # device multiplies it natively, else fp32, which would make it slower than the plain form in
    # bf16: there "auto" keeps the plain form
    ns = importlib.import_module("muonlab.kernels.newton_schulz")  # the package exports a function of that name
    monkeypatch.setattr(ns, "native_fp16_matmul", lambda device: native_fp16)
    wide = torch.nn.Parameter(torch.randn(16, 64))
    wide.grad = torch.randn(16, 64)
    opt = Muon([wide], ns_dtype=torch.bfloat16)
    cfg = opt._ns_config(opt.param_groups[0])
    assert form_for(cfg, (16, 64)) == ("gram" if native_fp16 else "plain")
    assert ns.gram_work_dtype(cfg, torch.bfloat16, "cpu") == (torch.float16 if native_fp16 else torch.float32)


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


# fp32, a 16x48 matrix: its input (= output), an iterate and the m x m products of the form that
# runs by default (ns_form="auto": gram on 16x48, see batch_bytes_per_matrix)
BANK_PER_MATRIX = batch_bytes_per_matrix(16, 48, 4, reuses_input=True,
                                         form=form_for(NSConfig(**resolve_form("auto")), (16, 48)))


@pytest.mark.parametrize("offload", [{}, {"state_offload": "cpu"}], ids=["resident", "offloaded"])
def test_a_bank_over_the_budget_runs_in_parts_with_the_same_bits(offload):
    # 10 experts under a budget of 4 matrices: parts of 3, 3 and 4 (the 2-D matrix of the same
    # shape runs whole); every part's momentum, Newton-Schulz and update equal the whole bank's
    shapes = [(10, 16, 48), (16, 48)]
    runs = {}
    for budget in (None, 4 * BANK_PER_MATRIX):
        params = _params(shapes)
        opt = Muon(params, ns_dtype=torch.float32, weight_decay=0.1, workspace_bytes=budget, **offload)
        for grads in _grads(shapes, 3):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
        runs[budget] = (params, opt)
    (whole, a), (parted, b) = runs[None], runs[4 * BANK_PER_MATRIX]
    assert [x.part for x in a.plan()] == [None]
    assert sorted((x.part, x.num_matrices) for x in b.plan() if x.part) == [((0, 3), 3), ((1, 3), 3), ((2, 3), 4)]
    assert [x.param_shapes for x in b.plan() if not x.part] == [((16, 48),)]
    for p, q in zip(whole, parted):
        assert torch.equal(p, q)
        assert torch.equal(a.state[p]["momentum_buffer"], b.state[q]["momentum_buffer"])
    if offload:  # an offloaded bank's momentum is fetched a part at a time too
        assert b._offload.peak_window_bytes() == 4 * 16 * 48 * 4


def test_a_bank_in_parts_never_holds_a_bank_sized_tensor():
    # the point of parts: a step's momentum inputs are taken a part at a time, so nothing the
    # size of the bank is allocated (a whole-bank Nesterov input was 10 matrices here)
    from torch.profiler import ProfilerActivity, profile

    bank = _params([(10, 16, 48)])[0]
    opt = Muon([bank], ns_dtype=torch.float32, workspace_bytes=4 * BANK_PER_MATRIX)
    bank.grad = torch.randn_like(bank)
    opt.step()  # state and workspace made
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        opt.step()
    largest = max(e.cpu_memory_usage for e in prof.events())
    assert 0 < largest <= 4 * 16 * 48 * 4, (largest, bank.numel() * 4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_bank_in_parts_stays_within_the_budget_on_cuda():
    # the GPU side of the profiler test above: a 16 MiB bf16 bank under a 4 MiB budget; a step
    # after the first (state and workspace made) may add its part inputs and products, never a
    # whole bank's Nesterov input (16 MiB without parts)
    bank = torch.nn.Parameter(torch.randn(64, 256, 512, device="cuda", dtype=torch.bfloat16))
    budget = 4 * 2**20
    opt = Muon([bank], workspace_bytes=budget)
    bank.grad = torch.randn_like(bank)
    opt.step()
    assert all(b.part for b in opt.plan())
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    opt.step()
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before <= budget


def test_a_bank_whose_matrices_are_not_one_run_is_named_when_cut():
    # a 4-D bank whose two leading dims can't be flattened into a view can't be cut into parts
    bank = torch.nn.Parameter(torch.randn(5, 2, 16, 48).transpose(0, 1))  # (2, 5, 16, 48)
    opt = Muon([("w", bank)], ns_dtype=torch.float32, workspace_bytes=4 * BANK_PER_MATRIX,
               matrix_views={"w": "bank"})
    bank.grad = torch.randn(2, 5, 16, 48)
    before = bank.detach().clone()
    with pytest.raises(ValueError, match="'w'.*contiguous"):
        opt.step()
    assert torch.equal(bank, before) and not opt.state


def test_a_transposed_bank_runs_in_parts_with_the_same_bits():
    # (E, A, B) with strided matrices: cutting dim 0 is a view all the same
    results = []
    for budget in (None, 4 * BANK_PER_MATRIX):
        bank = torch.nn.Parameter(torch.randn(10, 48, 16, generator=torch.Generator().manual_seed(0)).transpose(1, 2))
        opt = Muon([bank], ns_dtype=torch.float32, workspace_bytes=budget)
        for (g,) in _grads([(10, 16, 48)], 2):
            bank.grad = g
            opt.step()
        results.append(bank.detach().clone())
    assert torch.equal(*results)


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


@pytest.mark.parametrize("momentum_dtype", [None, torch.float32])
def test_state_dict_has_no_names_and_state_keeps_its_dtype_for_bf16_params(momentum_dtype):
    """Momentum in the parameter's dtype by default (as torch.optim.Muon), fp32 on request; AdamW
    moments fp32 either way; a reload keeps every dtype (torch's loader would cast to bf16)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(d_model=32, n_layers=2, context=16))
    opt = Muon(muon_param_groups(model), lr=0.02, weight_decay=0.01, adamw_lr=1e-3, momentum_dtype=momentum_dtype)
    model.to(torch.bfloat16)
    _train(model, opt, 1, seed=0)
    sd = opt.state_dict()
    assert all("param_names" not in g for g in sd["param_groups"])
    flat = repr(sd["param_groups"])
    assert "blocks" not in flat and "tok_emb" not in flat
    assert opt.param_name(model.blocks[0].attn.qkv.weight) == "blocks.0.attn.qkv.weight"

    def expected(key):
        return (momentum_dtype or torch.bfloat16) if key == "momentum_buffer" else torch.float32

    seen = set()
    for state in opt.state.values():
        for k, v in state.items():
            if k != "step":
                assert v.dtype == expected(k), k
                seen.add(k)
    assert seen == {"momentum_buffer", "exp_avg", "exp_avg_sq"}
    opt.load_state_dict(sd)
    assert all(v.dtype == expected(k) for s in opt.state.values() for k, v in s.items() if k != "step")


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


def test_adamw_keeps_fp64_parameters_moments_in_fp64():
    """fp32 moments rounded an fp64 parameter's updates to fp32 (1e-7 of an update off), and a
    squared gradient of 1e40 overflowed them to an update of zero."""
    p = torch.nn.Parameter(torch.zeros(6, dtype=torch.float64))
    q = torch.nn.Parameter(p.detach().clone())
    opt = Muon([{"params": [p], "algorithm": "adamw", "lr": 1e-3, "weight_decay": 0.0}])
    ref = torch.optim.AdamW([q], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    for g in ([1e20, -1e20] * 3, [1.0, 0.3, -2.0, 1e-3, 5.0, -0.1]):
        p.grad, q.grad = torch.tensor(g, dtype=torch.float64), torch.tensor(g, dtype=torch.float64)
        opt.step()
        ref.step()
    assert opt.state[p]["exp_avg"].dtype == torch.float64
    torch.testing.assert_close(p, q, rtol=1e-14, atol=1e-16)


def test_fp16_parameters_keep_torch_muons_bits():
    """An fp16 add rounds its alpha to fp16 on a CPU (-0.02 became -0.019997): the update is added
    in fp32, as torch.optim.Muon's bf16 update into an fp16 parameter is."""
    init = _params([(24, 24)])[0].detach().half()
    p, q = torch.nn.Parameter(init.clone()), torch.nn.Parameter(init.clone())
    a = Muon([p], lr=0.02, weight_decay=0.0, ns_dtype=torch.bfloat16, ns_form="plain", ns_backend="torch")
    b = torch.optim.Muon([q], lr=0.02, weight_decay=0.0, adjust_lr_fn="original")
    for (g,) in _grads([(24, 24)], 4):
        p.grad, q.grad = g.half(), g.half()
        a.step()
        b.step()
    assert torch.equal(p, q)


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


# ---------------------------------------------------------------- issue 12: options, state, copies


def _pg():
    import torch.distributed as dist

    return dist.ProcessGroup(dist.HashStore(), 0, 1)  # a real group object, no init_process_group


@pytest.mark.parametrize("make, kwargs, exc, match", [
    (_one, dict(ns_dtype=torch.int32), ValueError, "ns_dtype.*torch.int32"),
    (_one, dict(ns_dtype=torch.bool), ValueError, "ns_dtype.*torch.bool"),
    (_one, dict(ns_form="fast"), ValueError, "ns_form"),
    (_one, dict(ns_backend=None), ValueError, "ns_backend"),
    (lambda: _one((0, 8), "w"), {}, ValueError, r"'w' of shape \(0, 8\) is empty"),
    (lambda: _one((2, 0, 8), "bank"), {}, ValueError, r"'bank' of shape \(2, 0, 8\) is empty"),
    (_one, dict(lr="0.02"), TypeError, "lr must be a number.*'0.02'"),
    (_one, dict(lr=float("inf")), ValueError, "lr must be finite"),
    (_one, dict(lr=True), TypeError, "lr must be a number"),
    (_one, dict(momentum="0.9"), TypeError, "momentum must be a number"),
    (_one, dict(weight_decay=None), TypeError, "weight_decay must be a number"),
    (_one, dict(eps="1e-7"), TypeError, "eps must be a number"),
    (_one, dict(nesterov="yes"), TypeError, "nesterov must be a bool"),
    (_one, dict(ns_coefficients=(3.4, "b", 2.0)), TypeError, "ns_coefficients"),
    (_one, dict(adamw_betas=(0.9,)), ValueError, r"betas must be a pair"),
    (_one, dict(adamw_betas=0.9), TypeError, r"betas must be a pair"),
    (_one, dict(adamw_betas=("0.9", 0.95)), TypeError, r"betas must hold numbers"),
    (_one, dict(adamw_lr="3e-4"), TypeError, "lr must be a number"),
    (_one, dict(adamw_eps=None), TypeError, "eps must be a number"),
    (lambda: [{"params": _one(), "lr": "0.1"}], {}, TypeError, "lr must be a number, got '0.1' .*group 0"),
    (lambda: [{"params": _one((8,)), "algorithm": "adamw", "betas": [0.9]}], {}, ValueError, "group 0"),
    (lambda: [torch.zeros(4, 8, dtype=torch.int64)], {}, TypeError, r"of shape \(4, 8\) has dtype torch.int64"),
    (lambda: [("mask", torch.zeros(4, dtype=torch.bool))], {}, TypeError, "'mask' of shape \\(4\\) has dtype"),
    (_one, dict(comm_dtype="bf16"), TypeError, "comm_dtype must be a torch.dtype"),
    (_one, dict(comm_dtype=torch.int8), ValueError, "comm_dtype must be"),
    (_one, dict(comm_dtype=torch.float16), ValueError, r"comm_dtype must be bfloat16 \(2 bytes, fp32.s range\)"),
    (_one, dict(strategy=None), ValueError, "unknown strategy"),
    (_one, dict(remainder_path=["agrs"]), ValueError, "unknown remainder_path"),
    (_one, dict(nonfinite=None), ValueError, "unknown nonfinite"),
    (_one, dict(hardware_profile=3), TypeError, "hardware_profile must be"),
    (_one, dict(hardware_profile=""), ValueError, "unknown hardware profile ''"),
    (_one, dict(process_group="world"), TypeError, "process_group must be a torch.distributed ProcessGroup"),
    (_one, dict(fused_banks=[("w", 2)]), TypeError, "fused_banks must be a dict"),
])
def test_bad_options_name_themselves(make, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        Muon(make(), **kwargs)


def test_options_accept_their_ordinary_forms():
    Muon(_one(), lr=torch.tensor(0.01), momentum=0, weight_decay=0, eps=1, adamw_betas=[0.9, 0.99],
         comm_dtype=torch.float32, hardware_profile="cpu_gloo", process_group=_pg())


def test_duplicate_inside_one_group_says_so():
    (name, p), = _one(name="w")
    with pytest.raises(ValueError, match=r"'w' of shape \(4, 8\) is listed twice in group 0"):
        Muon([(name, p), (name, p)])
    opt = Muon(_one())
    q = torch.nn.Parameter(torch.randn(4, 8))
    with pytest.raises(ValueError, match=r"is listed twice in group 1"):
        opt.add_param_group({"params": [q, q]})
    assert len(opt.param_groups) == 1


def test_a_refused_group_leaves_no_trace():
    opt = Muon(_one())
    q = torch.nn.Parameter(torch.randn(4, 8))
    with pytest.raises(TypeError, match="lr must be a number"):
        opt.add_param_group({"params": [("q", q)], "lr": "0.1"})
    assert len(opt.param_groups) == 1 and opt.param_name(q) is None


@pytest.mark.parametrize("value, exc", [(True, TypeError), (0, ValueError), ("4", TypeError), (-1, ValueError),
                                        (2.0, TypeError), (None, TypeError)])
def test_fused_banks_values_are_ints_from_one(value, exc):
    w = torch.nn.Parameter(torch.randn(8, 8))
    with pytest.raises(exc, match=r"fused_banks\['w'\]"):
        Muon([("w", w)], fused_banks={"w": value})
    Muon([("w", w)], fused_banks={"w": 1})


def _named_pair(width, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.nn.Parameter(torch.randn(4, width, generator=gen))
    b = torch.nn.Parameter(torch.randn(4, generator=gen))
    opt = Muon([{"params": [("w", w)]}, {"params": [("b", b)], "algorithm": "adamw"}])
    return w, b, opt


def _step(opt, *params):
    for p in params:
        p.grad = torch.randn(p.shape)
    opt.step()


def test_load_state_dict_from_another_width_names_the_parameter_and_changes_nothing():
    w8, b8, narrow = _named_pair(8)
    _step(narrow, w8, b8)
    w16, b16, wide = _named_pair(16, seed=1)
    _step(wide, w16, b16)
    before = copy.deepcopy(wide.state_dict())
    with pytest.raises(ValueError, match=r"'w' of shape \(4, 16\).*momentum_buffer of shape \(4, 8\)"):
        wide.load_state_dict(narrow.state_dict())
    after = wide.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for pid, state in before["state"].items():
        for key, value in state.items():
            assert torch.equal(after["state"][pid][key], value), (pid, key)


def test_parameter_resized_after_its_state_was_made_is_named_before_anything_moves():
    w, b, opt = _named_pair(8)
    _step(opt, w, b)
    w.data = torch.randn(6, 8)  # what resize_token_embeddings does to an embedding's weight
    b_before, step_before = b.detach().clone(), opt.state[b]["step"].clone()
    w.grad, b.grad = torch.randn(6, 8), torch.randn(4)
    with pytest.raises(ValueError, match=r"'w' of shape \(6, 8\) has state momentum_buffer of shape \(4, 8\)"):
        opt.step()
    assert torch.equal(b.detach(), b_before) and torch.equal(opt.state[b]["step"], step_before)


def test_python_number_adamw_step_loads_like_torch():
    (w, b, opt), (w2, b2, opt2) = _named_pair(8), _named_pair(8)
    _step(opt, w, b)
    sd = copy.deepcopy(opt.state_dict())  # state_dict() shares opt's state dicts
    sd["state"][1]["step"] = int(sd["state"][1]["step"].item())  # as older or hand-made checkpoints hold it
    opt2.load_state_dict(sd)
    w2.data.copy_(w.detach()), b2.data.copy_(b.detach())
    for p, q in ((w, w2), (b, b2)):
        p.grad = torch.randn(p.shape)
        q.grad = p.grad.clone()
    opt.step()
    opt2.step()
    assert torch.equal(b.detach(), b2.detach()) and torch.equal(w.detach(), w2.detach())
    assert torch.equal(opt2.state[b2]["step"], torch.tensor(2.0))
    sd["state"][1]["step"] = "1"
    with pytest.raises(TypeError, match="'b' of shape \\(4\\).*step"):
        opt2.load_state_dict(sd)


def _pickle_copy(opt):
    import pickle

    return pickle.loads(pickle.dumps(opt))


@pytest.mark.parametrize("copier", [copy.deepcopy, _pickle_copy])
def test_copies_step_exactly_like_the_original(copier):
    model, opt = _gpt_and_opt()
    _train(model, opt, 2, seed=0)
    twin = copier(opt)
    ours = [p for g in opt.param_groups for p in g["params"]]
    theirs = [p for g in twin.param_groups for p in g["params"]]
    assert [opt.param_name(p) for p in ours] == [twin.param_name(q) for q in theirs]
    assert twin.fused_banks == opt.fused_banks and twin.ns_dtype == opt.ns_dtype
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        opt.step()
        twin.step()
    for p, q in zip(ours, theirs):
        assert torch.equal(p.detach(), q.detach()), opt.param_name(p)
    assert twin.last_step_stats()["skipped"] is False


def _as_pickled_with_options_apart(opt) -> dict:
    """``opt``'s pickled state as muonlab wrote it before MuonOptions: each option an attribute."""
    import dataclasses

    state = opt.__getstate__()
    options = state.pop("options")
    state.update({f.name: getattr(options, f.name) for f in dataclasses.fields(options)})
    return state


def test_a_muon_pickled_with_its_options_apart_loads_them_into_one_record():
    p = torch.nn.Parameter(torch.randn(4, 6))
    p.grad = torch.randn(4, 6)
    opt = Muon([p], strategy="redundant", nonfinite="ignore", comm_dtype=torch.float32)
    opt.step()
    state = _as_pickled_with_options_apart(opt)
    del state["nonfinite_decision"]  # pickled before the decision on the device
    old = Muon.__new__(Muon)
    old.__setstate__(state)
    assert old.options == dataclasses.replace(opt.options, nonfinite_decision="host")
    assert "strategy" not in vars(old)  # no stale copy beside the record
    old.step()


def test_options_are_one_checked_record_and_a_refused_change_changes_nothing():
    opt = Muon(_one(), strategy="redundant")
    before = opt.options
    assert opt.strategy == "redundant" and before.strategy == "redundant"
    with pytest.raises(ValueError, match="unknown strategy 'nope'"):
        opt.strategy = "nope"
    assert opt.options is before
    opt.ns_form = "plain"  # a new record, which the next step's prepared key sees
    assert opt.options == dataclasses.replace(before, ns_form="plain") and before.ns_form == "auto"
    with pytest.raises(dataclasses.FrozenInstanceError):
        opt.options.strategy = "muonlab"


def test_a_muon_pickled_before_the_memory_options_keeps_stepping_with_fp32_momentum():
    """An optimizer pickled by a muonlab without momentum_dtype, workspace_bytes and ns_graphs
    (its momentum was fp32 whatever the parameter's dtype) loads, keeps fp32 momentum and steps."""
    p = torch.nn.Parameter(torch.randn(4, 6).bfloat16())
    p.grad = torch.randn(4, 6).bfloat16()
    opt = Muon([p], momentum_dtype=torch.float32)
    opt.step()
    state = _as_pickled_with_options_apart(opt)
    for key in ("momentum_dtype", "workspace_bytes", "ns_graphs", "_runner"):
        del state[key]
    for store in state["_offload"].stores():
        del store.__dict__["momentum_dtype"]
    old = Muon.__new__(Muon)
    old.__setstate__(state)
    q = torch.nn.Parameter(torch.randn(4, 6).bfloat16())  # a parameter whose state is made after loading
    q.grad = torch.randn(4, 6).bfloat16()
    old.add_param_group({"params": [q]})
    old.step()
    assert old.state[q]["momentum_buffer"].dtype == torch.float32
    assert old.state[old.param_groups[0]["params"][0]]["momentum_buffer"].dtype == torch.float32


def test_process_group_is_shared_by_deepcopy_and_refused_by_pickle():
    import pickle

    pg = _pg()
    opt = Muon(_one(), process_group=pg)
    assert copy.deepcopy(opt).process_group is pg  # a communicator is a handle, not state
    with pytest.raises(TypeError, match="process_group"):
        pickle.dumps(opt)


@pytest.mark.parametrize("scheduler", ["OneCycleLR", "CyclicLR"])
def test_schedulers_cycle_muon_momentum_and_adamw_beta1(monkeypatch, scheduler):
    # torch.optim.Muon and torch.optim.AdamW under the same scheduler are the references
    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", _fp32_torch_ns)
    (w, b), (w_ref, b_ref) = _params([(24, 64), (64,)]), _params([(24, 64), (64,)])
    opt = Muon([{"params": [w]}, {"params": [b], "algorithm": "adamw"}], lr=0.02, ns_dtype=torch.float32,
               adamw_lr=1e-2)
    refs = [torch.optim.Muon([w_ref], lr=0.02, weight_decay=0.0, adjust_lr_fn="original"),
            torch.optim.AdamW([b_ref], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)]
    make = dict(OneCycleLR=lambda o, lrs: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=lrs, total_steps=8),
                CyclicLR=lambda o, lrs: torch.optim.lr_scheduler.CyclicLR(
                    o, [lr / 10 for lr in lrs], lrs, step_size_up=3))[scheduler]
    scheds = [make(opt, [0.02, 1e-2])] + [make(r, [lr]) for r, lr in zip(refs, (0.02, 1e-2))]
    momenta = set()
    w0 = w.detach().clone()
    for gw, gb in _grads([(24, 64), (64,)], 6):
        w.grad, w_ref.grad, b.grad, b_ref.grad = gw, gw.clone(), gb, gb.clone()
        for o in [opt] + refs:
            o.step()
        for s in scheds:
            s.step()
        momenta.add(opt.param_groups[0]["momentum"])
        assert opt.param_groups[1]["momentum"] == refs[1].param_groups[0]["betas"][0]
    assert len(momenta) >= 4  # it did cycle
    assert _rel_displacement([w], [w_ref], [w0]) <= 1e-5
    torch.testing.assert_close(b, b_ref, rtol=1e-6, atol=1e-7)
    assert opt.defaults["momentum"] == 0.95 and "betas" not in opt.defaults


def test_torch_coefficient_triple_steps_like_the_preset():
    a, b = _params(SHAPES), _params(SHAPES)
    opts = [Muon(a, ns_coefficients="keller"), Muon(b, ns_coefficients=(3.4445, -4.7750, 2.0315))]
    for grads in _grads(SHAPES, 2):
        for ps, o in zip((a, b), opts):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
            o.step()
    assert all(torch.equal(p, q) for p, q in zip(a, b))


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", ["ema", "sum"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_momentum_inputs_lie_back_to_back_with_the_bits_of_the_plain_formulas(form, nesterov, dtype):
    """muon_momentum_ writes the Newton-Schulz inputs into one buffer, in order (a batch then reads
    them as one tensor), with the same bits as torch's out-of-place formulas; buffers of mixed
    dtypes get separate inputs."""
    torch.manual_seed(0)
    shapes = [(6, 4), (6, 4), (2, 6, 4)]
    grads = [torch.randn(s).to(dtype) for s in shapes]
    bufs = [torch.randn(s).to(dtype) for s in shapes]
    start = [b.clone() for b in bufs]
    ref_bufs = [b.clone() for b in bufs]
    outs = F.muon_momentum_(grads, bufs, momentum=0.9, nesterov=nesterov, form=form)
    for g, b, o in zip(grads, ref_bufs, outs):
        b.lerp_(g, 0.1) if form == "ema" else b.mul_(0.9).add_(g)
        want = (torch.lerp(g, b, 0.9) if form == "ema" else torch.add(g, b, alpha=0.9)) if nesterov else b
        assert torch.equal(o, want)
    assert all(torch.equal(b, r) for b, r in zip(bufs, ref_bufs))
    ends = [o.data_ptr() + o.nbytes for o in outs]
    assert [o.data_ptr() for o in outs[1:]] == ends[:-1]  # back to back
    # the GPU's few-launch variant, run here on the CPU: the same bits in fp32 (in bf16 the CPU's
    # _foreach_mul_ rounds its scalar to bf16 first, so the sum form differs there)
    again, again_bufs = [torch.empty_like(o) for o in outs], [b.clone() for b in start]
    F._momentum_foreach(again, grads, again_bufs, momentum=0.9, nesterov=nesterov, form=form)
    if dtype == torch.float32 or form == "ema":
        assert all(torch.equal(a, o) for a, o in zip(again, outs))
        assert all(torch.equal(a, b) for a, b in zip(again_bufs, bufs))
    mixed = F.muon_momentum_(grads[:2], [bufs[0], bufs[1].double()], momentum=0.9,
                             nesterov=nesterov, form=form)
    assert [o.dtype for o in mixed] == [dtype, torch.float64]


def _peak_bytes(fn, path: str) -> int:
    """The most CPU tensor bytes ``fn`` held at once, from torch.profiler's memory events."""
    import json

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = sorted((e for e in json.load(f)["traceEvents"] if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    now = peak = 0
    for e in events:
        now += e["args"]["Bytes"]
        peak = max(peak, now)
    return peak


def test_fp32_updates_of_bf16_parameters_are_cast_one_at_a_time(tmp_path):
    """The update held a bf16 copy of every output of a batch at once (8 matrices' worth)."""
    params = [torch.randn(64, 256).bfloat16() for _ in range(8)]
    updates = [torch.randn(64, 256) for _ in range(8)]
    peak = _peak_bytes(lambda: F.muon_apply_(params, updates, lr=0.02, weight_decay=0.0, ratios=[1.0] * 8),
                       str(tmp_path / "trace.json"))
    assert peak <= 64 * 256 * 2, peak  # one cast update at a time


def test_bf16_grads_of_fp32_momentum_are_cast_one_at_a_time(tmp_path):
    """The momentum pass held an fp32 copy of every grad of a batch beside its outputs (twice
    the outputs' bytes at its peak, with bf16 grads and fp32 momentum)."""
    grads = [torch.randn(64, 256).bfloat16() for _ in range(8)]
    bufs = [torch.zeros(64, 256) for _ in range(8)]
    peak = _peak_bytes(lambda: F.muon_momentum_(grads, bufs, momentum=0.95, nesterov=True, form="ema"),
                       str(tmp_path / "trace.json"))
    outputs = 8 * 64 * 256 * 4
    assert outputs <= peak <= outputs + 2 * 64 * 256 * 4, peak  # the outputs and a grad or two in flight
