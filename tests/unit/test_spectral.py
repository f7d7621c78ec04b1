"""Spectral records (muonlab.trace.spectral) against exact references (SVD, the explicit formula)."""

import copy
import math

import pytest
import torch

from muonlab import Muon, compare_optimizers, muon_param_groups
from muonlab.kernels.newton_schulz import newton_schulz
from muonlab.models import GPT, GPTConfig
from muonlab.optim.functional import adjust_lr_ratio
from muonlab.trace import (SpectralRecorder, exact_ortho_error, exact_top_singular_value, gather_spectral,
                           ortho_error_from_gram, records_by_name, sampled_ortho_error,
                           top_singular_values)
from muonlab.trace.spectral import SpectralRecord, gram
from muonlab.train import History

CFG = GPTConfig(d_model=32, n_layers=1, n_heads=2, context=16)


def _gpt(seed=0):
    torch.manual_seed(seed)
    return GPT(CFG)


def _train(model, opt, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, 256, (4, CFG.context), generator=gen)
        model(x, x).backward()
        opt.step()
        opt.zero_grad()


def _rel(a, b):
    return abs(a - b) / abs(b)


def _with_gap(m, n, seed, top=3.0):
    """A random (m, n) matrix whose singular values are 1, ..., decaying, with sigma_max = top."""
    gen = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(m, m, generator=gen))
    v, _ = torch.linalg.qr(torch.randn(n, n, generator=gen))
    k = min(m, n)
    s = torch.linspace(1.0, 0.1, k)
    s[0] = top
    return (u[:, :k] * s) @ v[:, :k].T


# ---------------------------------------------------------------- the math against exact references


def test_top_singular_values_match_svd_on_a_stack():
    mats = torch.stack([_with_gap(12, 20, seed, top=2.0 + seed) for seed in range(3)])
    v = torch.randn(3, 20, generator=torch.Generator().manual_seed(0))
    v = v / v.norm(dim=1, keepdim=True)
    (sigma,), _ = top_singular_values([mats], [v], [12])
    exact = exact_top_singular_value(mats)
    assert torch.allclose(sigma.double(), exact, rtol=1e-5), (sigma, exact)
    (few,), _ = top_singular_values([mats], [v], [2])
    assert (few.double() <= exact * (1 + 1e-6)).all() and (few.double() < exact * 0.999).any()  # a lower bound
    # a zero matrix (a skipped step's update) gives 0 and keeps its vector
    (zero,), (kept,) = top_singular_values([torch.zeros(1, 4, 6)], [v[:1, :6]], [3])
    assert float(zero[0]) == 0 and torch.equal(kept, v[:1, :6])


def test_lanczos_goes_on_past_an_invariant_subspace():
    """A start vector in an invariant subspace (an exact, non-top singular vector; or in W's null
    space, as a warm vector of the last update is when this one touches other columns) used to
    end the Krylov space there: the value was that subspace's, not sigma_max."""
    (sigma,), (v,) = top_singular_values([torch.diag(torch.tensor([1.0, 3.0, 2.0]))[None]],
                                         [torch.tensor([[1.0, 0.0, 0.0]])], [6])
    assert float(sigma[0]) == pytest.approx(3.0, rel=1e-6) and float(v[0, 1].abs()) == pytest.approx(1.0, rel=1e-6)
    mats = torch.stack([_with_gap(5, 8, seed=1), _with_gap(5, 8, seed=2)])
    mats[0, :, 0] = 0  # e0 is in the null space of the first, not of the second
    start = torch.zeros(2, 8)
    start[:, 0] = 1
    exact = exact_top_singular_value(mats)
    (sigma,), _ = top_singular_values([mats], [start], [8])
    assert torch.allclose(sigma.double(), exact, rtol=1e-5), (sigma, exact)
    # fewer products: still a lower bound, and the same in every call (row shards run it on every
    # rank and sum the products, so a restart vector must not depend on the rank or the call)
    few = [top_singular_values([mats], [start], [3])[0][0] for _ in range(2)]
    assert torch.equal(few[0], few[1]) and (few[0].double() <= exact * (1 + 1e-6)).all() and (few[0] > 0).all()


def test_flat_spectrum_of_newton_schulz_output_within_one_percent():
    """Muon's updates: singular values bunched between about 0.7 and 1.2, where plain power
    iteration is slow; 6 products of the Lanczos refinement (the default update_iters) suffice."""
    gen = torch.Generator().manual_seed(0)
    for shape in [(128, 32), (64, 64), (96, 384)]:
        o = newton_schulz(torch.randn(shape, generator=gen), steps=5, coefficients="keller", dtype=torch.float32)
        v = torch.randn(1, shape[1], generator=gen)
        (sigma,), _ = top_singular_values([o[None]], [v / v.norm()], [6])
        exact = float(exact_top_singular_value(o))
        assert float(sigma[0]) <= exact * (1 + 1e-6) and _rel(float(sigma[0]), exact) < 1.2e-2, shape


def _products_to(mat, v, exact, rtol):
    """How many products a start vector needs to come within ``rtol``."""
    for k in range(1, 60):
        (sigma,), _ = top_singular_values([mat[None]], [v[None]], [k])
        if _rel(float(sigma[0]), float(exact)) < rtol:
            return k
    return 60


def test_warm_start_converges_in_fewer_iterations_than_cold():
    # a weight that moves a little between two recorded steps, as in training
    before = _with_gap(48, 80, seed=3, top=1.1)
    after = before + 1e-3 * torch.randn(48, 80, generator=torch.Generator().manual_seed(4))
    cold = torch.randn(80, generator=torch.Generator().manual_seed(5))
    cold = cold / cold.norm()
    _, (warm,) = top_singular_values([before[None]], [cold[None]], [30])
    exact = exact_top_singular_value(after)
    n_cold = _products_to(after, cold, exact, 1e-6)
    n_warm = _products_to(after, warm[0], exact, 1e-6)
    assert n_warm < n_cold and n_warm <= 3, (n_warm, n_cold)


@pytest.mark.parametrize("shape", [(6, 6), (5, 9), (11, 4), (3, 7, 10)])
def test_ortho_error_from_gram_equals_the_explicit_formula(shape):
    o = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))) / 3
    got = ortho_error_from_gram(gram(o), min(shape[-2:]))
    assert torch.allclose(got, exact_ortho_error(o), rtol=1e-6, atol=1e-9)
    q, _ = torch.linalg.qr(torch.randn(9, 5, dtype=torch.float64))
    assert float(ortho_error_from_gram(gram(q), 5)) < 1e-6  # orthonormal columns: 0
    # the larger Gram (as row shards sum it) gives the same error as the smaller one
    o = torch.randn(4, 9, dtype=torch.float64)
    assert torch.allclose(ortho_error_from_gram(o.mT @ o, 4), exact_ortho_error(o))


def test_sampled_ortho_error_is_exact_on_all_rows_and_unbiased_in_its_square():
    o = newton_schulz(torch.randn(40, 24, generator=torch.Generator().manual_seed(2)), steps=3, dtype=torch.float32)
    exact = float(exact_ortho_error(o))
    assert math.isclose(float(sampled_ortho_error(o, None)), exact, rel_tol=1e-6)
    assert math.isclose(float(sampled_ortho_error(o, torch.arange(24))), exact, rel_tol=1e-6)
    # the squares of equal-size samples that partition the rows average to the exact square
    parts = torch.randperm(24, generator=torch.Generator().manual_seed(3)).view(4, 6)
    mean_sq = sum(float(sampled_ortho_error(o, rows.sort().values)) ** 2 for rows in parts) / 4
    assert math.isclose(mean_sq, exact ** 2, rel_tol=1e-6)


def test_recorder_samples_rows_of_larger_matrices():
    recorders = []
    for rows in (8, 64):  # 32 rows (the smaller dim) <= 64: exact
        model = _gpt()
        opt = Muon(muon_param_groups(model), ns_dtype=torch.float32)
        recorders.append(SpectralRecorder(opt, model, every=1, names=["blocks.0.mlp.fc.weight"], ortho_rows=rows))
        _train(model, opt, 2)
    rec, full = recorders
    with pytest.raises(ValueError, match="this Muon already has a SpectralRecorder attached"):
        SpectralRecorder(opt, model, every=1)
    full.detach()
    SpectralRecorder(opt, model, every=1)  # detached: another may attach
    for sampled, exact in zip(rec.records, full.records):
        assert sampled.ortho_error != exact.ortho_error and _rel(sampled.ortho_error, exact.ortho_error) < 0.5
    with pytest.raises(ValueError, match="ortho_rows must be an integer >= 1"):
        SpectralRecorder(opt, model, every=1, ortho_rows=0)


# ---------------------------------------------------------------- the recorder on optimizers


def test_muon_records_match_exact_references_after_enough_steps():
    model = _gpt()
    opt = Muon(muon_param_groups(model, adamw_lr=3e-3), lr=0.02, ns_dtype=torch.float32)
    rec = SpectralRecorder(opt, model, every=2)
    name = "blocks.0.mlp.fc.weight"
    p = dict(model.named_parameters())[name]
    _train(model, opt, 7)
    assert sorted({r.step for r in rec.records}) == [2, 4, 6]
    names = {r.name for r in rec.records}
    assert names == {n for n, q in model.named_parameters() if q.ndim == 2}
    # one more recorded step, with the exact references computed on the side
    before = p.detach().clone()
    momentum = opt.state[p]["momentum_buffer"].clone()
    gen = torch.Generator().manual_seed(9)
    x = torch.randint(0, 256, (4, CFG.context), generator=gen)
    model(x, x).backward()
    grad = p.grad.clone()
    opt.step()
    last = [r for r in rec.records if r.step == 8 and r.name == name]
    assert len(last) == 1
    r = last[0]
    update = p.detach() - before
    # Muon's update is -lr * ratio * NS(nesterov momentum): its Newton-Schulz output, independently
    momentum.lerp_(grad, 1 - 0.95)
    o = newton_schulz(grad.lerp(momentum, 0.95), steps=5, coefficients="keller", dtype=torch.float32)
    assert torch.allclose(update, -0.02 * adjust_lr_ratio(tuple(p.shape), "original") * o, atol=1e-6)
    assert math.isclose(r.ortho_error, float(exact_ortho_error(o)), rel_tol=1e-5)
    assert math.isclose(r.update_rms, float(update.square().mean().sqrt()), rel_tol=1e-5)
    # warm-started over 4 recorded steps, the weight's estimate is close; the update's (a fresh
    # direction each step, nearly flat spectrum) is a lower bound within a few percent
    assert _rel(r.weight_sigma, float(exact_top_singular_value(p.detach()))) < 2e-2
    exact_u = float(exact_top_singular_value(update))
    assert r.update_sigma <= exact_u * (1 + 1e-5) and _rel(r.update_sigma, exact_u) < 2e-2
    # AdamW-routed matrices of the same Muon: no Newton-Schulz, so no orthogonality error
    head = [q for q in rec.records if q.name == "lm_head.weight"]
    assert head and all(math.isnan(q.ortho_error) for q in head)


def test_weight_estimate_converges_over_recorded_steps():
    """Cold on a flat random spectrum the estimate is loose; warm starts keep improving it."""
    model = _gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rec = SpectralRecorder(opt, model, every=1, names=["blocks.0.mlp.fc.weight"], cold_iters=2, warm_iters=2)
    p = dict(model.named_parameters())["blocks.0.mlp.fc.weight"]
    errors = []
    for _ in range(30):
        _train(model, opt, 1, seed=len(errors))
        errors.append(_rel(rec.records[-1].weight_sigma, float(exact_top_singular_value(p.detach()))))
    assert errors[-1] < 1e-2 and errors[-1] < errors[0] / 3, errors


def test_adamw_and_torch_muon_records():
    for make in (lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3),
                 lambda m: torch.optim.Muon([p for p in m.parameters() if p.ndim == 2], lr=0.02)):
        model = _gpt()
        opt = make(model)
        rec = SpectralRecorder(opt, model, every=3)
        p = dict(model.named_parameters())["blocks.0.attn.qkv.weight"]
        _train(model, opt, 5)
        before = p.detach().clone()
        _train(model, opt, 1, seed=7)
        r = [r for r in rec.records if r.step == 6 and r.name == "blocks.0.attn.qkv.weight"][0]
        update = p.detach() - before
        assert math.isclose(r.update_rms, float(update.square().mean().sqrt()), rel_tol=1e-5)
        assert 0 < r.update_sigma <= float(exact_top_singular_value(update)) * (1 + 1e-5)
        assert math.isnan(r.ortho_error)  # only muonlab's Muon reports its Newton-Schulz output
        assert sorted({r.step for r in rec.records}) == [3, 6]
        rec.detach()
        _train(model, opt, 3)
        assert max(r.step for r in rec.records) == 6  # detached: nothing more


def test_a_step_that_raises_is_not_counted_and_leaves_nothing_behind():
    """Muon(nonfinite="raise") refusing a recording step: the records stay labelled by the steps
    taken, and neither the weight copies nor the Newton-Schulz observer outlive it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.Linear(16, 16, bias=False))
    opt = Muon(muon_param_groups(model), ns_dtype=torch.float32, nonfinite="raise")
    rec = SpectralRecorder(opt, model, every=2, names=["1.weight"])
    taken = 0
    for k in range(7):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        if k in (1, 6):  # would be recording steps 2 and 6
            model[1].weight.grad[0, 0] = math.inf
        try:
            opt.step()
            taken += 1
        except ValueError:
            pass
    assert taken == 5 and [r.step for r in rec.records] == [2, 4]
    assert rec._before is not None  # kept by the refused step 6 until the next step or detach()
    rec.detach()  # right after the refused step
    assert rec._before is None and opt._optimizer_spectral_observer is None


def test_records_by_name_and_gather_without_distributed():
    model = _gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rec = SpectralRecorder(opt, model, every=1, names=["blocks.0.mlp.out.weight", "lm_head.weight"])
    _train(model, opt, 3)
    assert [(r.step, r.name) for r in gather_spectral(rec.records)] == [
        (s, n) for s in (1, 2, 3) for n in ("blocks.0.mlp.out.weight", "lm_head.weight")]
    steps, values = records_by_name(rec.records, "update_rms")["lm_head.weight"]
    assert steps == [1, 2, 3] and all(v > 0 for v in values)
    with pytest.raises(ValueError, match="unknown spectral metric 'norm'"):
        records_by_name(rec.records, "norm")


def test_copies_of_muon_do_not_carry_the_recorder():
    model = _gpt()
    opt = Muon(muon_param_groups(model), ns_dtype=torch.float32)
    rec = SpectralRecorder(opt, model, every=1)
    opt._optimizer_spectral_observer = rec.observe_newton_schulz  # as during a recorded step
    twin = copy.deepcopy(opt)
    assert twin._optimizer_spectral_observer is None
    assert getattr(twin, "_optimizer_spectral_recorder", None) is None and opt._optimizer_spectral_recorder is rec


def test_train_and_compare_optimizers_carry_spectral_records():
    hist = compare_optimizers(CFG, steps=4, batch_size=4, progress=False, spectral_every=2)
    for name, h in hist.items():
        assert sorted({r.step for r in h.spectral}) == [2, 4], name
        muon_rows = [r for r in h.spectral if r.name == "blocks.0.mlp.fc.weight"]
        assert (not math.isnan(muon_rows[0].ortho_error)) == (name == "muon")
    with pytest.raises(ValueError, match="spectral_every must be an integer >= 0"):
        compare_optimizers(CFG, steps=1, names=("adamw",), progress=False, spectral_every=-1)


# ---------------------------------------------------------------- bad input


def test_bad_input_is_refused_with_the_name_at_fault():
    model = _gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for every in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match=r"every must be an integer >= 1"):
            SpectralRecorder(opt, model, every=every)
    with pytest.raises(ValueError, match=r"unknown parameter name\(s\) \['blocks.9.attn.qkv.weight'\]"):
        SpectralRecorder(opt, model, every=1, names=["blocks.0.attn.qkv.weight", "blocks.9.attn.qkv.weight"])
    with pytest.raises(ValueError, match=r"parameter 'norm.weight' has shape \(32,\)"):
        SpectralRecorder(opt, model, every=1, names=["norm.weight"])
    with pytest.raises(ValueError, match="warm_iters must be an integer >= 2"):
        SpectralRecorder(opt, model, every=1, warm_iters=1)
    partial = torch.optim.AdamW([model.lm_head.weight], lr=1e-3)
    with pytest.raises(ValueError, match="parameter 'tok_emb.weight' is not in the optimizer"):
        SpectralRecorder(partial, model, every=1, names=["tok_emb.weight"])
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks  # refused: no hook left


# ---------------------------------------------------------------- plots and the panel (muonlab.viz.spectral)


def test_plots_and_panel_draw_what_was_recorded():
    pytest.importorskip("ipywidgets", reason="notebook bars and panels are ipywidgets (the lab extra)")
    import matplotlib

    matplotlib.use("Agg")
    from muonlab.viz.spectral import ALL, plot_spectral, plot_spectral_layers, spectral_panel

    runs = compare_optimizers(CFG, steps=4, batch_size=4, progress=False, spectral_every=2)
    ax = plot_spectral(runs, "blocks.0.mlp.fc.weight", "ortho_error")
    assert len(ax.lines) == 1 and "none for adamw" in ax.get_title()  # AdamW has no Newton-Schulz output
    steps, values = ax.lines[0].get_data()
    assert list(steps) == [2, 4] and all(v > 0 for v in values)
    ax = plot_spectral_layers(runs["adamw"], "update_flatness")
    # 7 matrices: 2 embeddings, 4 in the block, the head; sigma is a lower bound, so flatness may pass 1 a little
    assert len(ax.lines) == 7 and all(0 < v <= 1.05 for line in ax.lines for v in line.get_ydata())
    panel = spectral_panel(runs, name="blocks.0.attn.qkv.weight")
    fig = panel.update(metric="update_rms")
    assert panel.metric.value == "update_rms" and len(fig.axes[0].lines) == 2
    fig = panel.update(name=ALL)
    assert len(fig.axes) == 2
    with pytest.raises(ValueError, match="no spectral records of matrix 'blocks.7.mlp.fc.weight'"):
        panel.update(name="blocks.7.mlp.fc.weight")
    with pytest.raises(ValueError, match="unknown spectral metric 'rms'"):
        plot_spectral(runs, "blocks.0.attn.qkv.weight", "rms")


def _synthetic_records(names, steps=(1, 2)):
    return [SpectralRecord(step=s, name=n, weight_sigma=1.0 + s + i, update_sigma=0.1, update_rms=0.01, shape=(4, 4))
            for s in steps for i, n in enumerate(names)]


def test_all_matrices_panel_colours_each_kind_alike_in_every_run():
    """Runs that record different matrices (a MoE GPT's router first): one legend, so a kind has
    one colour in every axis (each run used to number the kinds it drew itself)."""
    pytest.importorskip("ipywidgets", reason="notebook bars and panels are ipywidgets (the lab extra)")
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.colors import to_hex

    from muonlab.viz.spectral import ALL, spectral_panel

    runs = {"dense": _synthetic_records(["blocks.0.attn.qkv.weight", "blocks.0.mlp.fc.weight"]),
            "moe": _synthetic_records(["blocks.0.router.weight", "blocks.0.attn.qkv.weight", "blocks.0.mlp.fc.weight"])}
    fig = spectral_panel(runs, name=ALL).figure(ALL, "weight_sigma")
    legend = fig.legends[0]
    colours = {t.get_text(): to_hex(h.get_color()) for t, h in zip(legend.get_texts(), legend.legend_handles)}
    assert len(set(colours.values())) == len(colours) == 3
    drawn = [(line.get_label(), to_hex(line.get_color())) for ax in fig.axes for line in ax.lines]
    assert len(drawn) == 5 and all(colours[kind] == colour for kind, colour in drawn), (drawn, colours)


def test_a_figure_of_some_matrices_colours_each_kind_as_the_panel_of_all_does():
    """Notebook 06 draws the hidden matrices (``names=``), its panel every recorded one: a kind
    keeps its colour in both (the colours were numbered over the drawn kinds only, so the panel,
    with the embeddings first, coloured each hidden kind differently)."""
    pytest.importorskip("ipywidgets", reason="notebook bars and panels are ipywidgets (the lab extra)")
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.colors import to_hex

    from muonlab.viz.spectral import ALL, plot_spectral_layers, plot_spectral_runs, spectral_panel

    recorded = ["tok_emb.weight", "blocks.0.attn.qkv.weight", "blocks.0.mlp.fc.weight", "blocks.1.attn.qkv.weight",
                "blocks.1.mlp.fc.weight", "head.weight"]
    hidden = [n for n in recorded if n.startswith("blocks.")]
    runs = {"muon": _synthetic_records(recorded), "adamw": _synthetic_records(recorded)}

    def colours(fig):
        return {line.get_label(): to_hex(line.get_color()) for ax in fig.axes for line in ax.lines
                if not line.get_label().startswith("_") and line.get_label() not in ("blocks.0", "blocks.1")}

    some = colours(plot_spectral_runs(runs, "weight_sigma", names=hidden))
    everything = colours(spectral_panel(runs, name=ALL).figure(ALL, "weight_sigma"))
    assert set(some) == {"blocks.attn.qkv.weight", "blocks.mlp.fc.weight"}, some
    assert all(everything[kind] == colour for kind, colour in some.items()), (some, everything)
    one_run = matplotlib.pyplot.figure().gca()
    plot_spectral_layers(runs["muon"], "weight_sigma", ax=one_run, names=hidden)
    assert colours(one_run.figure) == some


def test_plots_and_panel_want_a_mapping_of_runs():
    """One run (a History or its records) where {label: run} is wanted: a TypeError saying so (it
    was an AttributeError about .values() from deep inside)."""
    import matplotlib

    matplotlib.use("Agg")
    from muonlab.viz.spectral import matrix_names, plot_spectral, spectral_panel

    records = _synthetic_records(["w"])
    for run in (History(spectral=records), records):
        for call in (matrix_names, lambda r: plot_spectral(r, "w", "weight_sigma"), spectral_panel):
            with pytest.raises(TypeError, match=r"expected a mapping \{label: History or list of SpectralRecord\}"):
                call(run)


def test_empty_matrices_are_left_out_or_refused_and_names_are_a_list():
    """An empty (0, n) matrix (a zero-width layer) has no spectrum: left out by default, refused by
    name (it divided by its numel of 0 inside the step, after the weights had moved)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8, bias=False), torch.nn.Linear(8, 0, bias=False))
    opt = Muon(muon_param_groups(model), ns_dtype=torch.float32)
    rec = SpectralRecorder(opt, model, every=1)
    assert rec.names == ["0.weight"]
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    assert [r.name for r in rec.records] == ["0.weight"]
    rec.detach()
    with pytest.raises(ValueError, match=r"non-empty 2-D matrices; parameter '1.weight' has shape \(0, 8\)"):
        SpectralRecorder(opt, model, every=1, names=["1.weight"])
    with pytest.raises(TypeError, match=r"names must be a list of parameter names, e.g. \['0.weight'\], not a str"):
        SpectralRecorder(opt, model, every=1, names="0.weight")
    with pytest.raises(ValueError, match=r"names lists a parameter twice: \['0.weight'\]"):
        SpectralRecorder(opt, model, every=1, names=["0.weight", "0.weight"])


def test_an_fp64_update_is_differenced_in_fp64():
    """lr 1e-7 on fp64 weights near 1: differenced in fp32, the update's top singular value was
    off by 0.6-0.9%."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False)).double()
    opt = Muon(muon_param_groups(model), lr=1e-7, ns_dtype=torch.float64)
    # a Muon update's spectrum is nearly flat: 8 Lanczos products (its smaller dim) find its top
    # singular value exactly, the default 6 only to about 4e-4
    rec = SpectralRecorder(opt, model, every=1, update_iters=8)
    assert opt.param_groups[0]["algorithm"] == "muon"
    w = model[0].weight
    w.grad = torch.randn_like(w)
    before = w.detach().clone()
    opt.step()
    exact = torch.linalg.matrix_norm(w.detach() - before, ord=2).item()
    assert rec.records[0].update_sigma == pytest.approx(exact, rel=1e-6)
