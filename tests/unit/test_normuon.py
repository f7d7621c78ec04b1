"""NorMuon (update_rule="normuon") in one process: against the slow readable reference, its
state kept, resumed and offloaded exactly, its refusals, and its numerics on the inputs training
produces (low-rank and zero momentum, bf16)."""

import io
import math

import pytest
import torch

from muonlab import Muon
from muonlab.kernels.reference import reference_newton_schulz
from muonlab.optim.reference import reference_muon_step, reference_normuon
from muonlab.optim.rules import RULES

HYPER = dict(lr=0.05, momentum=0.9, weight_decay=0.1, normuon_beta2=0.9)
# a tall and a wide matrix, a bank, a fused bank of 3 blocks, a conv kernel read as one matrix and
# a weight stored (in, out) (transformers' Conv1D: its neurons are stored columns)
SHAPES = {"tall": (16, 8), "wide": (6, 20), "bank": (3, 8, 12), "fused": (12, 5), "conv": (6, 2, 3, 3),
          "stored": (8, 12)}
FUSED = {"fused": 3}
VIEWS = {"conv": "flatten", "stored": "transpose"}


def _params(seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [(n, torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype))) for n, s in SHAPES.items()]


def _grads(step, dtype=torch.float32):
    gen = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(s, generator=gen).to(dtype) for n, s in SHAPES.items()}


def _run(steps=3, **kw):
    params = _params(dtype=kw.pop("dtype", torch.float32))
    opt = Muon(params, ns_dtype=torch.float32, fused_banks=FUSED, matrix_views={"stored": "transpose"},
               **{**HYPER, "update_rule": "normuon", **kw})
    for step in range(steps):
        for n, p in params:
            p.grad = _grads(step, p.dtype)[n]
        opt.step()
    return params, opt


@pytest.mark.parametrize("scale", ["code", "paper"])
def test_normuon_equals_the_slow_reference_on_every_view(scale):
    params, opt = _run(normuon_scale=scale)
    ref = {n: p.detach().clone() for n, p in _params()}
    bufs = {n: torch.zeros(s) for n, s in SHAPES.items()}
    var = {n: RULES["normuon"].state_shape(s, VIEWS.get(n, "")) for n, s in SHAPES.items()}
    var = {n: torch.zeros(s) for n, s in var.items()}
    names = list(SHAPES)
    for step in range(3):
        g = _grads(step)
        reference_muon_step([ref[n] for n in names], [g[n] for n in names], [bufs[n] for n in names],
                            lr=HYPER["lr"], momentum=HYPER["momentum"], nesterov=True,
                            weight_decay=HYPER["weight_decay"], ns_steps=5, ns_coefficients="keller", eps=1e-7,
                            adjust_lr="original", momentum_form="ema", update_rule="normuon",
                            normuon_beta2=HYPER["normuon_beta2"], normuon_scale=scale,
                            row_variances=[var[n] for n in names],
                            num_fused=[FUSED.get(n, 1) for n in names], views=[VIEWS.get(n, "") for n in names])
    plain = {n: p.detach() for n, p in _run(update_rule="muon")[0]}
    for n, p in params:
        err = float((p.detach() - ref[n]).abs().max() / ref[n].abs().max())
        assert err < 1e-6, (n, err)
        assert float((plain[n] - ref[n]).abs().max()) > 1e-4, n  # the rule changed the update
        assert torch.allclose(opt.state[p]["row_variance"], var[n], rtol=1e-5, atol=1e-12), n
        assert opt.state[p]["row_variance"].dtype == torch.float32


@pytest.mark.parametrize("scale", ["code", "paper"])
def test_reference_normuon_follows_the_formula(scale):
    """Per-row mean of squares into v, divide by sqrt(v), then rescale to the orthogonalized
    matrix's Frobenius norm ("code") or to an orthogonal 5 x 7 matrix's, sqrt(5) ("paper")."""
    gen = torch.Generator().manual_seed(3)
    o, v = torch.randn(5, 7, generator=gen), torch.rand(5, 1, generator=gen)
    want_v = 0.8 * v + 0.2 * (o ** 2).sum(dim=1, keepdim=True) / 7
    hat = o / (want_v.sqrt() + 1e-10)
    kept = o.norm() if scale == "code" else math.sqrt(5)
    want = hat * kept / hat.norm()
    got = reference_normuon(o, v, 0.8, scale=scale)
    assert torch.allclose(v, want_v) and torch.allclose(got, want, rtol=1e-6)
    assert torch.allclose(got.norm(), torch.as_tensor(kept))
    with pytest.raises(ValueError, match="scale"):
        reference_normuon(o, v, 0.8, scale="Paper")


def _newton_schulz(m: torch.Tensor) -> torch.Tensor:
    return reference_newton_schulz(m, 5, "keller", 1e-7, torch.float32)


def _authors_code_step(w, g, m, v, *, lr, beta1, beta2, weight_decay):
    """One step of the authors' code (normuon_update of github.com/zichongli5/NorMuon), written
    out with a fp32 Newton-Schulz: Nesterov momentum, the normalised update rescaled to
    ||O||_F, Keller's sqrt(max(1, m/n))."""
    m.lerp_(g, 1 - beta1)
    o = _newton_schulz(g.lerp(m, beta1))
    v.lerp_((o * o).mean(dim=-1, keepdim=True), 1 - beta2)
    hat = o / (v.sqrt() + 1e-10)
    update = hat * (o.norm() / (hat.norm() + 1e-10)) * max(1, w.shape[0] / w.shape[1]) ** 0.5
    w.mul_(1 - lr * weight_decay).add_(update, alpha=-lr)


def _algorithm_1_step(w, g, m, v, *, lr, beta1, beta2, weight_decay):
    """One step of Algorithm 1 of arXiv 2510.05491, written out: M_t = beta1 M + (1 - beta1) G,
    O_t = NS5(M_t), v_t, O_hat = O_t / (sqrt(V_t) + eps), eta_hat = 0.2 eta sqrt(mn) / ||O_hat||_F,
    W <- W - eta lambda W - eta_hat O_hat."""
    m.mul_(beta1).add_(g, alpha=1 - beta1)
    o = _newton_schulz(m)
    v.mul_(beta2).add_((o * o).mean(dim=-1, keepdim=True), alpha=1 - beta2)
    hat = o / (v.sqrt() + 1e-10)
    eta_hat = 0.2 * lr * math.sqrt(w.shape[0] * w.shape[1]) / hat.norm()
    w.sub_(lr * weight_decay * w).sub_(eta_hat * hat)


@pytest.mark.parametrize("scale", ["code", "paper"])
def test_each_scale_is_its_source_written_out(scale):
    """normuon_scale="code" with Muon's defaults steps as the authors' code; "paper" with
    adjust_lr="match_rms_adamw" and nesterov=False steps as Algorithm 1. The two differ by
    sqrt(min(m, n)) / ||O||_F (about 1.15 here: Newton-Schulz leaves singular values below 1)."""
    hyper = dict(lr=0.05, beta1=0.9, beta2=0.9, weight_decay=0.1)
    shapes = {"tall": (24, 10), "wide": (10, 24), "square": (16, 16)}
    gen = torch.Generator().manual_seed(11)
    start = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    grads = [{n: torch.randn(s, generator=gen) for n, s in shapes.items()} for _ in range(3)]
    params = [(n, torch.nn.Parameter(start[n].clone())) for n in shapes]
    source = dict(code=dict(), paper=dict(adjust_lr="match_rms_adamw", nesterov=False))[scale]
    opt = Muon(params, lr=hyper["lr"], momentum=hyper["beta1"], weight_decay=hyper["weight_decay"],
               update_rule="normuon", normuon_beta2=hyper["beta2"], normuon_scale=scale, ns_dtype=torch.float32,
               **source)
    step = _authors_code_step if scale == "code" else _algorithm_1_step
    ref = {n: start[n].clone() for n in shapes}
    bufs = {n: torch.zeros(s) for n, s in shapes.items()}
    var = {n: torch.zeros(s[0], 1) for n, s in shapes.items()}
    for g in grads:
        for n, p in params:
            p.grad = g[n].clone()
            step(ref[n], g[n].clone(), bufs[n], var[n], **hyper)
        opt.step()
    for n, p in params:
        err = float((p.detach() - ref[n]).abs().max() / ref[n].abs().max())
        assert err < 1e-6, (scale, n, err)
    if scale == "paper":  # against the code's first step, from the same start: the ratio of the two
        for n, s in shapes.items():
            w_code, w_paper = start[n].clone(), start[n].clone()
            g = grads[0][n]
            _algorithm_1_step(w_paper, g.clone(), torch.zeros(s), torch.zeros(s[0], 1), **{**hyper, "weight_decay": 0})
            o = _newton_schulz((1 - hyper["beta1"]) * g)
            w_code -= hyper["lr"] * 0.2 * math.sqrt(max(s)) * reference_normuon(o, torch.zeros(s[0], 1), hyper["beta2"])
            ratio = float((w_paper - start[n]).norm() / (w_code - start[n]).norm())
            assert ratio == pytest.approx(math.sqrt(min(s)) / float(o.norm()), rel=1e-5) and 1.05 < ratio < 1.3, n


@pytest.mark.parametrize("dtype, scale", [(torch.float32, "code"), (torch.bfloat16, "code"),
                                          (torch.float32, "paper")])
def test_resume_from_a_state_dict_is_bit_for_bit(dtype, scale):
    """Two steps, save, a third; a fresh optimizer loading the save takes the same third step. The
    row second moments stay fp32 for bf16 parameters (torch's loader would cast them); the groups'
    NorMuon settings come from the save."""
    params, opt = _run(steps=2, dtype=dtype, normuon_scale=scale)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    saved = {n: p.detach().clone() for n, p in params}
    for n, p in params:
        p.grad = _grads(2, dtype)[n]
    opt.step()
    params2 = [(n, torch.nn.Parameter(saved[n].clone())) for n, _ in params]
    opt2 = Muon(params2, ns_dtype=torch.float32, fused_banks=FUSED, matrix_views={"stored": "transpose"},
                **HYPER)  # the rule comes from the save
    buf.seek(0)
    opt2.load_state_dict(torch.load(buf, weights_only=False))
    assert opt2.param_groups[0]["update_rule"] == "normuon" and opt2.param_groups[0]["normuon_scale"] == scale
    for n, p in params2:
        p.grad = _grads(2, dtype)[n]
        assert opt2.state[p]["row_variance"].dtype == torch.float32
    opt2.step()
    for (n, p), (_, q) in zip(params, params2):
        assert torch.equal(p, q), n
        assert torch.equal(opt.state[p]["row_variance"], opt2.state[q]["row_variance"]), n


@pytest.mark.parametrize("place", ["cpu", "disk"])
def test_offloaded_state_steps_bit_identically(tmp_path, place):
    extra = dict(state_offload=place, offload_dir=str(tmp_path / "state") if place == "disk" else None)
    resident, _ = _run()
    offloaded, opt = _run(**extra)
    for (n, p), (_, q) in zip(resident, offloaded):
        assert torch.equal(p, q), n
    assert opt.state_residency()  # the momentum did live away from the device


def test_a_rule_chosen_later_or_per_group_makes_its_state_then():
    params, opt = _run(steps=1, update_rule="muon")
    assert all("row_variance" not in opt.state[p] for _, p in params)
    opt.param_groups[0]["update_rule"] = "normuon"
    for n, p in params:
        p.grad = _grads(1)[n]
    opt.step()
    assert all(opt.state[p]["row_variance"].abs().sum() > 0 for _, p in params)
    a, b = _params(seed=1)[:2]
    mixed = Muon([{"params": [a[1]], "update_rule": "normuon"}, {"params": [b[1]]}], ns_dtype=torch.float32)
    a[1].grad, b[1].grad = torch.ones_like(a[1]), torch.ones_like(b[1])
    mixed.step()
    assert "row_variance" in mixed.state[a[1]] and "row_variance" not in mixed.state[b[1]]


@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16])
def test_low_rank_and_zero_momentum_stay_finite_and_keep_the_update_norm(ns_dtype):
    """A rank-1 gradient (whose orthogonalized rows are mostly tiny), one with zero rows, and an
    all-zero gradient: finite updates; the normalised update keeps the orthogonalized matrix's
    Frobenius norm, and a zero matrix takes no step."""
    gen = torch.Generator().manual_seed(5)
    low = torch.outer(torch.randn(32, generator=gen), torch.randn(16, generator=gen))
    rows = torch.randn(32, 16, generator=gen)
    rows[::2] = 0
    for grad in (low, rows, torch.zeros(32, 16)):
        w = torch.nn.Parameter(torch.zeros(32, 16))
        opt = Muon([w], lr=1.0, momentum=0.0, nesterov=False, ns_dtype=ns_dtype, update_rule="normuon",
                   adjust_lr=None)
        w.grad = grad.clone()
        opt.step()
        step = -w.detach()
        assert torch.isfinite(step).all()
        plain = torch.nn.Parameter(torch.zeros(32, 16))
        ref = Muon([plain], lr=1.0, momentum=0.0, nesterov=False, ns_dtype=ns_dtype, adjust_lr=None)
        plain.grad = grad.clone()
        ref.step()
        want = float(plain.detach().norm())
        assert abs(float(step.norm()) - want) <= 1e-3 * max(1.0, want)


def test_bad_settings_and_unfit_layouts_are_refused_before_anything_changes():
    w = torch.nn.Parameter(torch.randn(8, 4))
    with pytest.raises(ValueError, match="update_rule"):
        Muon([w], update_rule="normuon2")
    with pytest.raises(ValueError, match="normuon_beta2"):
        Muon([w], update_rule="normuon", normuon_beta2=1.0)
    with pytest.raises(TypeError, match="normuon_beta2"):
        Muon([{"params": [w], "normuon_beta2": "0.9"}])
    with pytest.raises(ValueError, match=r"normuon_scale must be one of \('code', 'paper'\), got 'Paper'"):
        Muon([w], update_rule="normuon", normuon_scale="Paper")
    with pytest.raises(ValueError, match="normuon_scale.*got None in parameter group 0"):
        Muon([{"params": [w], "normuon_scale": None}])
    bias = torch.nn.Parameter(torch.zeros(4))
    for setting in ("normuon_beta2", "normuon_scale"):  # Muon's, not AdamW's
        with pytest.raises(ValueError, match=f"{setting}.*(?i:adamw)"):
            Muon([{"params": [bias], "algorithm": "adamw", setting: Muon([w]).defaults[setting]}])
    opt = Muon([w], update_rule="normuon")
    w.grad = torch.ones_like(w)
    before = w.detach().clone()
    opt.param_groups[0]["normuon_scale"] = "both"  # a group changed between steps: refused at the step
    with pytest.raises(ValueError, match="normuon_scale"):
        opt.step()
    assert torch.equal(w.detach(), before) and not opt.state[w]
    # a matrix sharded across its columns: each row's sums would span ranks
    from muonlab.comm.specs import MatrixSpec
    from muonlab.optim.rule_step import refuse_unfit_for

    by_columns = MatrixSpec(0, "w", (8, 4), "row_shard", None, shard_dim=1)
    with pytest.raises(ValueError, match=r"update_rule='normuon' can't update parameter 'w' of shape "
                                         r"\(8, 4\): it is sharded on dim 1"):
        refuse_unfit_for(RULES["normuon"], by_columns)
    for layout in ("row_shard", "whole"):  # a weight stored (in, out): by columns, sharded or not
        refuse_unfit_for(RULES["normuon"], MatrixSpec(0, "stored", (8, 4), layout, None, view="transpose"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_row_scaled_update_equals_scaling_then_adding(dtype):
    """muon_apply_'s row scales (one addcmul_ per matrix) against the update scaled in full and
    added, on a contiguous parameter, a strided view of one, and an empty shard."""
    from muonlab.optim import functional as F

    gen = torch.Generator().manual_seed(7)
    o = torch.randn(6, 4, generator=gen).to(torch.bfloat16)
    scale = torch.rand(6, generator=gen) + 0.5
    start = torch.randn(6, 4, generator=gen).to(dtype)
    want = start.float() * (1 - 0.1 * 0.01) - 0.1 * 2.0 * (o.float() * scale[:, None])
    p = start.clone()
    F.muon_apply_([p], [o], lr=0.1, weight_decay=0.01, ratios=[2.0], row_scales=[scale])
    strided = start.t().contiguous().t()  # the same values, column-major
    assert not strided.is_contiguous()
    F.muon_apply_([strided], [o], lr=0.1, weight_decay=0.01, ratios=[2.0], row_scales=[scale])
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert torch.allclose(p.float(), want, atol=tol) and torch.allclose(strided.float(), want, atol=tol)
    empty = torch.empty(0, 4, dtype=dtype)
    F.muon_apply_([empty], [torch.empty(0, 4)], lr=0.1, weight_decay=0.0, ratios=[1.0], row_scales=[torch.empty(0)])


def test_simulate_prices_the_norms_all_reduce_where_rows_span_ranks():
    """simulate(update_rule="normuon"): a batch of row-sharded matrices carries two sums per matrix
    (``rule_sums``, what the run sends: checked against the counted bytes in
    tests/distributed/test_normuon_distributed.py) and the cost model one more collective for it;
    replicated matrices (whole on their owner) carry none; a layout the run refuses is refused."""
    from muonlab.comm.cost import get_profile, rule_seconds, step_seconds
    from muonlab.simulate import simulate

    shapes = [("qkv", (2304, 768)), ("proj", (768, 768)), ("fc", (3072, 768)), ("out", (768, 3072))] * 2
    shapes = [(f"{name}{k}", shape) for k, (name, shape) in enumerate(shapes)]
    profile = get_profile("h100_node")
    muon, normuon = simulate(shapes, 64), simulate(shapes, 64, update_rule="normuon")
    assert [b.path for b in normuon] == [b.path for b in muon] and not any(b.rule_sums for b in muon)
    assert [b.rule_sums for b in normuon] == [2 * b.num_matrices for b in normuon]
    extra = step_seconds(normuon, profile) - step_seconds(muon, profile)
    assert extra >= len(normuon) * profile.latency_s > 0
    assert all(rule_seconds(b, profile) > profile.latency_s for b in normuon)
    assert not any(b.rule_sums for b in simulate(shapes, 64, layout="ddp", update_rule="normuon"))
    stored = simulate(shapes, 64, update_rule="normuon", matrix_views={"out3": "transpose"})
    batch = next(b for b in stored if "out3" in b.names)  # its 3072 column sums travel, not two norms
    assert batch.rule_sums == 2 * (batch.num_matrices - 1) + 3072
    with pytest.raises(ValueError, match="unknown update_rule 'adam'"):
        simulate(shapes, 64, update_rule="adam")
