import pytest
import torch

from muonlab import PRESETS, NSConfig, newton_schulz, ns_flops
from muonlab.kernels.coefficients import resolve_coefficients
from muonlab.kernels.reference import reference_newton_schulz


def _sv(x):
    return torch.linalg.svdvals(x.float())


@pytest.mark.parametrize("shape", [(32, 96), (96, 32), (48, 48)])
def test_matches_readable_reference_fp32(shape):
    G = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    fast = newton_schulz(G, dtype=torch.float32)
    slow = reference_newton_schulz(G, 5, "keller", 1e-7)
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)


def test_batched_equals_per_matrix_and_norm_is_per_matrix():
    gen = torch.Generator().manual_seed(1)
    G = torch.randn(3, 2, 16, 40, generator=gen)
    G[1, 0] *= 1000.0  # a huge matrix must not shrink its neighbours (no norm across the batch)
    out = newton_schulz(G, dtype=torch.float32)
    assert out.shape == G.shape
    for i in range(3):
        for j in range(2):
            torch.testing.assert_close(out[i, j], newton_schulz(G[i, j], dtype=torch.float32), rtol=1e-5, atol=1e-6)


# Each preset's final singular value band for a random 64 x 256 matrix (measured in fp32; bands
# are a little wider than measured so BLAS differences pass but a wrong coefficient fails).
BANDS = {"keller": (0.6, 1.2), "xtuner": (0.9, 1.1), "polar_express": (0.8, 1.2)}


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_presets_leave_singular_values_in_band(preset, dtype):
    G = torch.randn(64, 256, generator=torch.Generator().manual_seed(2))
    sv = _sv(newton_schulz(G, coefficients=preset, dtype=dtype))
    lo, hi = BANDS[preset]
    assert lo <= sv.min().item() and sv.max().item() <= hi, (preset, sv.min(), sv.max())
    # and the input's spread (condition number ~ 10) is gone
    assert sv.max() / sv.min() < 2.0


def test_custom_coefficients_and_steps():
    coeffs = [(2.0, -1.5, 0.5)]  # a convergent cubic-style polynomial, repeated
    G = torch.randn(16, 32, generator=torch.Generator().manual_seed(3))
    sv = _sv(newton_schulz(G, steps=25, coefficients=coeffs, dtype=torch.float32))
    assert (sv - 1).abs().max() < 1e-3
    assert len(resolve_coefficients("xtuner", 7)) == 7
    assert resolve_coefficients("xtuner", 7)[-1] == PRESETS["xtuner"][-1]


@pytest.mark.parametrize("shape", [(32, 128), (128, 32), (4, 24, 96), (40, 40)])
def test_gram_form_matches_plain(shape):
    G = torch.randn(shape, generator=torch.Generator().manual_seed(4))
    plain = newton_schulz(G, dtype=torch.float32)
    gram = newton_schulz(G, dtype=torch.float32, form="gram")
    torch.testing.assert_close(gram, plain, rtol=1e-4, atol=1e-5)
    # in bf16 the restart keeps it orthogonal
    sv = _sv(newton_schulz(G, dtype=torch.bfloat16, form="gram"))
    assert 0.5 < sv.min() and sv.max() < 1.25


def test_zero_matrix_maps_to_zero_and_empty_is_fine():
    assert newton_schulz(torch.zeros(8, 16)).abs().max() == 0
    assert newton_schulz(torch.zeros(0, 8, 16)).shape == (0, 8, 16)


def test_flop_counts():
    m, n = 64, 256
    assert ns_flops((m, n), steps=5) == 5 * (4 * m * m * n + 2 * m**3)
    assert ns_flops((n, m), steps=5) == ns_flops((m, n), steps=5)  # tall inputs are transposed
    assert ns_flops((3, m, n), steps=5) == 3 * ns_flops((m, n), steps=5)
    # the Gram form saves FLOPs on rectangular matrices, not on square ones
    assert ns_flops((256, 1024), form="gram") < 0.75 * ns_flops((256, 1024))
    # ... and square matrices take the plain form, where gram would cost more (20% at 256)
    assert ns_flops((256, 256), form="gram") == ns_flops((256, 256))
    square = torch.randn(2, 10, 10, generator=torch.Generator().manual_seed(3))
    assert torch.equal(newton_schulz(square, form="gram", dtype=torch.float32),
                       newton_schulz(square, dtype=torch.float32))
    sym = ns_flops((m, n), steps=5, backend="triton") / ns_flops((m, n), steps=5)
    assert sym <= (3 * m * m * n + m**3) / (4 * m * m * n + 2 * m**3) + 1e-12


@pytest.mark.parametrize("shape, saving, gram", [
    ((2048, 8192), 0.33, True), ((768, 2048), 0.22, True),  # the gram form saves that share
    ((1408, 2048), -0.01, False), ((1024, 2048), 0.12, False),  # saves under 20%: plain
])
def test_gram_min_saving_takes_gram_only_where_it_saves_that_much(shape, saving, gram):
    plain = ns_flops(shape)
    assert 1 - ns_flops(shape, form="gram") / plain == pytest.approx(saving, abs=0.005)
    chosen = ns_flops(shape, form="gram", gram_min_saving=0.2)
    assert chosen == (ns_flops(shape, form="gram") if gram else plain)


def test_gram_min_saving_runs_the_form_it_counts():
    gen = torch.Generator().manual_seed(4)
    near_square, wide = torch.randn(2, 48, 64, generator=gen), torch.randn(2, 16, 64, generator=gen)
    for G, gram in ((near_square, False), (wide, True)):
        picky = newton_schulz(G, form="gram", gram_min_saving=0.2, dtype=torch.float32)
        same_as = newton_schulz(G, form="gram" if gram else "plain", dtype=torch.float32)
        assert torch.equal(picky, same_as)
    assert not torch.equal(newton_schulz(wide, form="gram", dtype=torch.float32),
                           newton_schulz(wide, dtype=torch.float32))  # the forms differ in bits


def test_resolve_form():
    from muonlab.kernels.newton_schulz import AUTO_GRAM_SAVING, resolve_form

    assert resolve_form("auto") == dict(form="gram", gram_min_saving=AUTO_GRAM_SAVING)
    assert resolve_form("gram") == dict(form="gram") and resolve_form("plain") == dict(form="plain")
    with pytest.raises(ValueError, match=r"unknown Newton-Schulz form 'fast' \(Muon's ns_form\); choose one of "
                                         r"\('auto', 'plain', 'gram'\)"):
        resolve_form("fast")
    for bad in (1.0, -0.1, "x"):
        with pytest.raises(ValueError, match="gram_min_saving must be None or a share in"):
            NSConfig(form="gram", gram_min_saving=bad)


@pytest.mark.parametrize("kwargs, match", [
    (dict(coefficients="nope"), "unknown Newton-Schulz preset 'nope'"),
    (dict(coefficients=[(1.0, 2.0)]), "list of \\(a, b, c\\)"),
    (dict(steps=0), "ns_steps must be a positive integer"),
    (dict(backend="cuda"), "unknown Newton-Schulz backend"),
    (dict(form="fast"), "unknown Newton-Schulz form"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        newton_schulz(torch.randn(4, 8), **kwargs)
    with pytest.raises(ValueError, match="at least 2 dims"):
        newton_schulz(torch.randn(8))


def test_triton_backend_without_cuda_is_a_clear_error(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("has CUDA")
    import muonlab.kernels.triton_newton_schulz as tns

    monkeypatch.setattr(tns, "INTERPRET", False)  # tests/conftest.py turns it on for the kernel tests
    with pytest.raises(ValueError, match="backend='triton' needs"):
        newton_schulz(torch.randn(4, 8), backend="triton")
    # auto falls back to torch
    newton_schulz(torch.randn(4, 8), backend="auto")


def test_ns_config_is_the_batch_key_and_keywords_override_it():
    from muonlab import NSConfig

    listed = NSConfig(coefficients=[[3.4445, -4.7750, 2.0315]], dtype=torch.float32)
    assert listed == NSConfig(coefficients=((3.4445, -4.7750, 2.0315),), dtype=torch.float32)
    assert len({listed, NSConfig(coefficients=((3.4445, -4.7750, 2.0315),), dtype=torch.float32)}) == 1
    G = torch.randn(3, 16, 32, generator=torch.Generator().manual_seed(0))
    cfg = NSConfig(dtype=torch.float32, steps=3)
    assert torch.equal(newton_schulz(G, cfg), newton_schulz(G, steps=3, dtype=torch.float32))
    assert torch.equal(newton_schulz(G, cfg, steps=5), newton_schulz(G, dtype=torch.float32))
    assert ns_flops((16, 32), cfg) == ns_flops((16, 32), steps=3)
    with pytest.raises(TypeError, match="unknown Newton-Schulz setting"):
        newton_schulz(G, cfg, stepz=5)
    with pytest.raises(TypeError, match="must be an NSConfig"):
        ns_flops((16, 32), 5)
    with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
        NSConfig(dtype="bf16")



@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.complex64, torch.float8_e4m3fn])
def test_only_floating_compute_dtypes(dtype):
    # an integer dtype used to turn every Muon update (and so every parameter) into NaN, silently
    with pytest.raises(ValueError, match=f"ns_dtype.*got {dtype}"):
        NSConfig(dtype=dtype)
    with pytest.raises(ValueError, match="ns_dtype"):
        newton_schulz(torch.randn(4, 8), dtype=dtype)
    for ok in (torch.float16, torch.bfloat16, torch.float32, torch.float64, None):
        NSConfig(dtype=ok)


def test_one_triple_like_torch_muon_is_repeated_every_step():
    keller = PRESETS["keller"][0]
    assert resolve_coefficients(keller, 4) == [keller] * 4
    assert resolve_coefficients([1, 2.5, -3], 2) == [(1.0, 2.5, -3.0)] * 2
    assert NSConfig(coefficients=keller) == NSConfig(coefficients=(keller,))  # one batch key
    G = torch.randn(16, 40, generator=torch.Generator().manual_seed(5))
    assert torch.equal(newton_schulz(G, coefficients=keller), newton_schulz(G, coefficients="keller"))
    assert torch.equal(reference_newton_schulz(G, 5, keller, 1e-7), reference_newton_schulz(G, 5, "keller", 1e-7))


@pytest.mark.parametrize("coefficients, exc", [
    (5, TypeError),
    (None, TypeError),
    ([(1.0, "x", 2.0)], TypeError),
    ((1.0, 2.0, None), TypeError),
    ([(1.0, 2.0, 3.0), 4.0], TypeError),
    ((True, 2.0, 3.0), TypeError),
    ([(1.0, float("nan"), 3.0)], ValueError),
    ([], ValueError),
    ((1.0, 2.0), ValueError),
])
def test_bad_coefficients_name_the_option(coefficients, exc):
    with pytest.raises(exc, match="ns_coefficients"):
        resolve_coefficients(coefficients, 5)
    with pytest.raises(exc, match="ns_coefficients"):
        NSConfig(coefficients=coefficients)


@pytest.mark.parametrize("eps, exc", [(0.0, ValueError), (-1e-7, ValueError), (float("nan"), ValueError),
                                      ("1e-7", TypeError), (None, TypeError)])
def test_bad_eps_is_refused(eps, exc):
    with pytest.raises(exc, match="eps"):
        NSConfig(eps=eps)


@pytest.mark.parametrize("shape", [(4, 32, 256), (4, 256, 32)])
@pytest.mark.parametrize("into_g", [False, True])
def test_gram_form_allocates_nothing_once_its_workspace_is_warm(shape, into_g):
    # the iterates live in the workspace (and in ``out`` where it can be one), and so do R, Z, Q
    # and the product in flight: a warm call allocates no matrix at all, only the per-matrix norms
    from torch.profiler import ProfilerActivity, profile

    from muonlab.kernels.batch_io import Overwrite
    from muonlab.kernels.workspace import Workspace

    ws = Workspace()
    G = torch.randn(shape, generator=torch.Generator().manual_seed(5))

    def run():  # its output buffer made before the profiler looks
        if into_g:
            mats = G.clone()
            return lambda: newton_schulz(Overwrite([mats]), form="gram", dtype=torch.float32, workspace=ws)[0]
        out = torch.empty(shape)
        return lambda: newton_schulz(G, form="gram", dtype=torch.float32, workspace=ws, out=out)

    expected = run()()  # warms the workspace
    call = run()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        got = call()
    assert torch.equal(got, expected)
    m = min(shape[1:])
    largest = max(e.cpu_memory_usage for e in prof.events())
    assert largest < m * m * 4, (largest, m * m * 4)


def _gradient_like(k, m, n, device, seed=0):
    """A decaying spectrum: a rank-64 signal over noise, as momentum looks (not a flat Gaussian)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    signal = torch.randn(k, m, 64, generator=gen, device=device) @ torch.randn(k, 64, n, generator=gen, device=device)
    return signal * 0.05 + torch.randn(k, m, n, generator=gen, device=device) * 0.01


@pytest.mark.parametrize("device, k, m, n", [
    # one matrix each on the CPU, a GPT-2-small MLP weight at half width: where bf16 matmul is
    # emulated (no avx512_bf16) the plain form's bf16 reference at 768 x 2048 took 50 s, here 3-4 s
    ("cpu", 1, 384, 1024), ("cpu", 1, 1024, 384),
    pytest.param("cuda", 2, 2048, 8192, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
    pytest.param("cuda", 2, 6144, 2048, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
])
def test_gram_in_bf16_is_as_close_to_fp32_as_plain_in_bf16(device, k, m, n):
    # the gram form is ns_form="auto"'s choice on rectangular matrices: its bf16 error against the
    # fp32 plain result must not exceed the plain bf16 form's by more than a quarter (measured at
    # 2048 x 8192 when this was written: 0.085 against 0.108; on a CPU, without native fp16, the
    # gram form iterates in fp32 (GRAM_DTYPES): 0.0017 against 0.10 at 384 x 1024)
    G = _gradient_like(k, m, n, device)
    exact = newton_schulz(G, dtype=torch.float32)
    err = {form: float((newton_schulz(G, dtype=torch.bfloat16, form=form).float() - exact).norm() / exact.norm())
           for form in ("plain", "gram")}
    assert err["gram"] <= 1.25 * err["plain"], err


@pytest.mark.parametrize("m, n", [(64, 256), (256, 64), (128, 512)])
def test_gram_in_bf16_with_polar_express_stays_near_the_polar_factor(m, n):
    # Polar Express's large first coefficients amplify the gram form's bf16 rounding: its result is
    # about 2.5x as far from the fp32 plain one as the plain form's (see AUTO_GRAM_SAVING), but
    # what Muon needs is an orthogonal factor, and there it stays within 30% of the plain form's
    # distance to the exact U V^T (measured here 0.10-0.15 against 0.09-0.14, 1.06-1.09x; with
    # Keller's coefficients both are about 0.21)
    G = _gradient_like(4, m, n, "cpu")
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    polar = U @ Vh
    dist = {form: float((newton_schulz(G, dtype=torch.bfloat16, form=form, coefficients="polar_express").double()
                         - polar).norm() / polar.norm())
            for form in ("plain", "gram")}
    assert dist["gram"] <= 1.3 * dist["plain"], dist


@pytest.mark.parametrize("form", ["plain", "gram"])
def test_fp16_matrix_whose_norm_passes_fp16_range_is_not_zeroed(form):
    """Every entry a finite fp16 (600 times a normal draw), the norm 77k: past fp16's 65504. Cast back to fp16
    the norm was inf, and the result all zeros."""
    G = (600 * torch.randn(64, 256, generator=torch.Generator().manual_seed(0))).half()
    assert torch.isfinite(G).all() and G.float().norm() > 65504
    want = newton_schulz(G.float(), dtype=torch.float32, form=form)
    for got in (newton_schulz(G, dtype=torch.float16, form=form), reference_newton_schulz(G, dtype=torch.float16)):
        assert (got.float() - want).norm() / want.norm() < 1e-2


def test_a_scaled_norm_keeps_fp64():
    """polar_express scales the norm by 1.02: in fp64 the scaled norm stays fp64 (it was rounded
    to fp32, and the first coefficients magnified that to ~1e-6)."""
    from muonlab.kernels.reference import plain_iterations

    G = torch.randn(16, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want = plain_iterations(G / (G.norm() * 1.02), resolve_coefficients("polar_express", 5))  # all fp64
    for got in (newton_schulz(G, dtype=torch.float64, coefficients="polar_express"),
                reference_newton_schulz(G, coefficients="polar_express", dtype=torch.float64)):
        assert (got - want).abs().max() < 1e-12


@pytest.mark.parametrize("restarts, match", [((2, None), "got None"), (2, "sequence"),
                                             ("2", "sequence"), ((1.5,), "got 1.5"), ((True,), "got True")])
def test_bad_gram_restarts_name_the_option(restarts, match):
    with pytest.raises(TypeError, match=f"gram_restarts.*{match}"):
        NSConfig(form="gram", gram_restarts=restarts)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
def test_a_non_float_input_computed_in_its_own_dtype_is_named(dtype):
    with pytest.raises(TypeError, match=f"G has dtype {dtype}; with dtype=None"):
        newton_schulz(torch.ones(4, 8, dtype=dtype), dtype=None)


def test_a_parameter_that_requires_grad_is_read_as_data():
    w = torch.nn.Linear(32, 8).weight  # requires grad, outside no_grad
    got = newton_schulz(w, dtype=torch.float32)
    assert not got.requires_grad
    ref = reference_newton_schulz(w.detach(), dtype=torch.float32)
    assert (got - ref).abs().max() < 1e-5


def _bytes_allocated(fn) -> int:
    """CPU bytes that tensors allocated during ``fn()`` (an upper bound on its peak)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(max(0, e.self_cpu_memory_usage) for e in prof.events())


def test_fp16_normalisation_copies_nothing_and_stays_within_fp16_rounding():
    """fp16 keeps its norm out of fp16's range without an fp32 copy of the batch: the fp32 norm
    and the fp32 division each made one (2.2x the runner's workspace budget); now only the
    per-matrix scalars are allocated. The result stays within fp16 rounding of the division in
    fp32, from tiny entries to norms past 65504, in place too."""
    from muonlab.kernels.execute import normalise_into as _normalise_into

    gen = torch.Generator().manual_seed(0)
    scales = torch.tensor([1e-4, 1.0, 600.0, 3e4]).view(4, 1, 1)  # 3e4: entries up to fp16's largest
    G = (scales * torch.randn(4, 64, 256, generator=gen)).clamp(-65504, 65504).half()
    out = torch.empty_like(G)
    assert _bytes_allocated(lambda: _normalise_into(out, G, 1e-7, 1.0)) < G.nbytes // 64
    in_place = G.clone()
    assert torch.equal(_normalise_into(in_place, in_place, 1e-7, 1.0), out)
    for scale in (1.0, 1.02):  # "polar_express" scales the norm by 1.02
        exact = G.float() / (G.float().norm(dim=(-2, -1), keepdim=True) * scale)
        got = _normalise_into(torch.empty_like(G), G, 1e-7, scale).float()
        assert ((got - exact).abs() <= 2e-3 * exact.abs() + 1e-7).all()  # about two fp16 roundings
    zero = torch.zeros(2, 8, 8, dtype=torch.float16)
    for eps in (1e-7, 1e-9):  # eps below fp16's smallest value: still no 0 / 0
        assert torch.equal(_normalise_into(torch.empty_like(zero), zero, eps, 1.0), zero)


def test_fp32_and_bf16_normalisation_keep_their_bits():
    """Only fp16 takes the two-pass division: fp32 and bf16 divide once by the norm in their own
    dtype, torch.optim.Muon's ``X / X.norm()``."""
    from muonlab.kernels.execute import normalise_into as _normalise_into

    G = 5 * torch.randn(3, 24, 40, generator=torch.Generator().manual_seed(1))
    for dtype in (torch.float32, torch.bfloat16):
        X = G.to(dtype)
        for scale in (1.0, 1.02):
            norms = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True)
            norms = norms.float() * scale if scale != 1.0 else norms
            want = X / norms.clamp(min=1e-7).to(dtype)
            assert torch.equal(_normalise_into(torch.empty_like(X), X, 1e-7, scale), want)
