"""The health signal of orthogonalized updates (muonlab.kernels.health): counted on the device in
the step, read in ``last_step_stats()`` and when a new plan is made, with one warning.

Newton-Schulz once returned matrices with a top singular value of 2.4 to 4,490 and nothing said
so until the weights were NaN; these tests make it diverge on purpose (coefficients (3, 0, 0)
multiply the normalised matrix by 3 per iteration: 243x after 5) and check that it is caught.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from muonlab import Muon, muon_param_groups
from muonlab.kernels.health import UpdateHealth, update_ratios
from muonlab.kernels.batch_io import Overwrite
from muonlab.kernels.config import NSConfig
from muonlab.kernels.reference import reference_newton_schulz
from muonlab.kernels.runner import NewtonSchulzRunner
from muonlab.kernels.workspace import batch_bytes_per_matrix
from muonlab.models import GPT, GPTConfig

DIVERGING = [(3.0, 0.0, 0.0)]
FP32 = {"ns_dtype": torch.float32}  # (3, 0, 0) scales exactly there (bf16 on this CPU gave NaN or 0.2x)


def _model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(d_model=32, n_layers=2, n_heads=2, context=16, vocab_size=64))


def _fill_grads(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)


def _muon_shapes(opt: Muon) -> list[tuple[int, int]]:
    return [tuple(p.shape) for g in opt.param_groups if g["algorithm"] == "muon" for p in g["params"]]


def _stats_and_warnings(opt: Muon):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stats = opt.last_step_stats()
    return stats, [w for w in caught if issubclass(w.category, RuntimeWarning)]


def test_healthy_defaults_flag_nothing():
    model = _model()
    opt = Muon(muon_param_groups(model), lr=0.02)
    for step in range(3):
        _fill_grads(model, step)
        opt.step()
        stats, caught = _stats_and_warnings(opt)
        assert stats["unhealthy_updates"] == 0
        assert 0.5 < stats["worst_update_ratio"] <= 1.25
        assert caught == []


@pytest.mark.parametrize("form", ["plain", "gram"])
def test_diverging_coefficients_flag_every_matrix_and_warn_once_when_read(form):
    model = _model()
    opt = Muon(muon_param_groups(model), lr=1e-4, ns_coefficients=DIVERGING, ns_form=form, **FP32)
    shapes = _muon_shapes(opt)
    _fill_grads(model, 0)
    opt.step()
    stats, caught = _stats_and_warnings(opt)
    assert stats["unhealthy_updates"] == len(shapes) > 0
    # the normalised input's norm is fixed, so the worst ratio is the reference's on any input
    gen = torch.Generator().manual_seed(3)
    expected = max(update_ratios(reference_newton_schulz(torch.randn(s, generator=gen), 5, DIVERGING, 1e-7,
                                                         torch.float32)).item() for s in set(shapes))
    assert stats["worst_update_ratio"] == pytest.approx(expected, rel=0.02)
    assert len(caught) == 1
    text = str(caught[0].message)
    assert f"{len(shapes)} of {len(shapes)} update matrices" in text and "the last step" in text
    assert f"{stats['worst_update_ratio']:.4g}" in text
    assert 'ns_form="plain"' in text and "ns_dtype=torch.float32" in text and "ns_coefficients" in text
    assert caught[0].filename == __file__  # points at the caller's read
    again, caught = _stats_and_warnings(opt)  # read: no second warning for the same step
    assert caught == [] and again["unhealthy_updates"] == len(shapes)


def test_a_nan_update_is_flagged():
    """A NaN gradient under nonfinite="ignore" reaches Newton-Schulz: its matrix alone is flagged,
    and the worst ratio says NaN."""
    model = _model()
    opt = Muon(muon_param_groups(model), lr=0.02, nonfinite="ignore")
    _fill_grads(model, 0)
    model.blocks[0].attn.qkv.weight.grad[0, 0] = float("nan")
    opt.step()
    stats, caught = _stats_and_warnings(opt)
    assert stats["unhealthy_updates"] == 1
    assert math.isnan(stats["worst_update_ratio"])
    assert len(caught) == 1 and "1 of" in str(caught[0].message) and "nan" in str(caught[0].message)


def test_a_skipped_step_counts_nothing_and_earlier_flags_still_warn():
    model = _model()
    opt = Muon(muon_param_groups(model), lr=1e-4, ns_coefficients=DIVERGING, **FP32)  # nonfinite="skip"
    _fill_grads(model, 0)
    opt.step()  # flagged, not read
    _fill_grads(model, 1)
    model.blocks[0].attn.qkv.weight.grad[0, 0] = float("inf")
    opt.step()  # skipped
    stats, caught = _stats_and_warnings(opt)
    assert stats["skipped"] and stats["unhealthy_updates"] == 0 and stats["worst_update_ratio"] is None
    assert len(caught) == 1
    assert "in a step before the last one" in str(caught[0].message) and "worst ratio 42.9" in str(caught[0].message)


def test_unread_flags_warn_when_the_next_plan_is_made():
    model = _model()
    opt = Muon(muon_param_groups(model), lr=1e-4, ns_coefficients=DIVERGING, **FP32)
    n = len(_muon_shapes(opt))
    for step in range(2):
        _fill_grads(model, step)
        opt.step()  # nobody reads the stats
    for group in opt.param_groups:
        if group["algorithm"] == "muon":
            group["ns_coefficients"] = "keller"  # a setting changed: the next step makes a new plan
    _fill_grads(model, 2)
    with pytest.warns(RuntimeWarning, match=r"update matrices on this rank in the last 2 steps \(read when making a "
                                            rf"new plan\), {n} of {n} in the last one"):
        opt.step()
    stats, caught = _stats_and_warnings(opt)  # the new plan's step is healthy and the old ones were read
    assert stats["unhealthy_updates"] == 0 and caught == []


def test_the_check_reads_nothing_on_the_host(monkeypatch):
    """On CPU there is no CUDA sync debug mode: every way to read a tensor's value on the host is
    made to raise during a step whose plan is already made. So that nothing else in the step reads
    a value: Muon matrices only (AdamW reads its step count, a CPU tensor, with .item()), the plain
    form (the gram form rounds each coefficient through a CPU tensor's .item()) and
    nonfinite="ignore" (the non-finite check reads its flags: the step's one host read by design).
    The matrices are all flagged, so the counters really move."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(32, 128), (128, 32), (32, 32), (96, 32)]]
    opt = Muon(params, lr=1e-4, ns_coefficients=DIVERGING, nonfinite="ignore", ns_form="plain", **FP32)

    def host_read(*args, **kwargs):
        raise AssertionError("a device value was read on the host inside the step")

    for step in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        with monkeypatch.context() as patch:
            if step == 1:  # the first step made the plan (a new plan reads the unread counts: by design)
                for name in ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__"):
                    patch.setattr(torch.Tensor, name, host_read)
            opt.step()
    with pytest.warns(RuntimeWarning, match="the last 2 steps, 4 of 4 in the last one"):
        stats = opt.last_step_stats()
    assert stats["unhealthy_updates"] == 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.set_sync_debug_mode)")
def test_a_cuda_step_with_the_check_does_not_synchronise():
    model = _model().cuda()
    opt = Muon(muon_param_groups(model), lr=1e-4, ns_coefficients=DIVERGING, nonfinite="ignore", **FP32)
    for step in range(3):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        if step == 2:  # the plan, workspaces and kernel choices are made by then
            torch.cuda.set_sync_debug_mode("error")
        try:
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    with pytest.warns(RuntimeWarning):
        assert opt.last_step_stats()["unhealthy_updates"] == len(_muon_shapes(opt))


def test_update_health_counts_what_is_above_the_limit_or_not_finite():
    health = UpdateHealth()
    orth = torch.linalg.qr(torch.randn(3, 12, 5, dtype=torch.float64))[0].float()  # (3, 12, 5), ratio 1
    pieces = [orth[:1], 1.49 * orth[1:2], 1.51 * orth[2:]]
    odd = torch.stack([torch.full((5, 12), float("inf")), torch.full((5, 12), float("nan")), torch.zeros(5, 12)])
    health.observe(orth)  # outside a step: nothing
    health.begin_step()
    health.observe(pieces)
    health.observe(odd.bfloat16())
    health.observe(torch.empty(0, 12, 5))
    health.end_step()
    last = health.last_step()
    assert (last.flagged, last.checked, last.steps) == (3, 6, 1) and math.isnan(last.worst)
    health.begin_step()
    health.observe(2.0 * orth.transpose(-2, -1))  # wide: sqrt(min(m, n)) is still sqrt(5)
    health.end_step()
    assert health.last_step()[:3] == (3, 3, pytest.approx(2.0))
    health.begin_step()
    health.observe(orth)  # a step that raises: never ended, the last step's counts stay
    assert health.last_step()[:3] == (3, 3, pytest.approx(2.0))
    unread = health.take_unread()  # the last step's counts, the worst of both steps
    assert (unread.flagged, unread.checked, unread.steps) == (3, 3, 2) and math.isnan(unread.worst)
    assert health.take_unread()[2:] == (None, 0)
    health.begin_step()
    health.observe(orth)
    health.drop_step()  # skipped
    assert health.last_step() == (0, 0, None, 0) and health.take_unread()[2:] == (None, 0)
    torch.testing.assert_close(update_ratios(pieces), torch.tensor([1.0, 1.49, 1.51]))


def test_the_runner_checks_every_chunk_and_copies_no_batch():
    """Every chunk passes the check (a budget of 3 matrices cuts 8 into 3 + 3 + 2), for a stack
    and for Overwrite pieces; the check allocates a few floats, never a copy of the batch (an fp32
    norm of bf16 matrices would convert the whole chunk first)."""
    cfg = NSConfig(steps=5, coefficients=DIVERGING, dtype=torch.float32, backend="torch")
    mats = torch.randn(8, 64, 128)
    runner = NewtonSchulzRunner(3 * batch_bytes_per_matrix(64, 128, 4))
    assert runner.chunk_size((64, 128), torch.float32, cfg=cfg) == 3
    in_place = runner.chunk_size((64, 128), torch.float32, reuses_input=True, cfg=cfg)
    seen, observe = [], runner.health.observe

    def spy(chunk):
        seen.append(sum(t.shape[0] for t in ([chunk] if isinstance(chunk, torch.Tensor) else chunk)))
        observe(chunk)

    runner.health.observe = spy
    runner.health.begin_step()
    stacked = runner(mats, cfg)
    pieces = Overwrite([mats[:5].clone(), mats[5:].clone()])
    runner(pieces, cfg)
    runner.health.end_step()
    assert seen == [3, 3, 2] + [8 // -(-8 // in_place) + (i < 8 % -(-8 // in_place)) for i in range(-(-8 // in_place))]
    last = runner.health.last_step()
    assert (last.flagged, last.checked) == (16, 16)
    assert last.worst == pytest.approx(max(update_ratios(stacked).max(), update_ratios(pieces).max()).item(), rel=0.01)
    runner.health.observe = observe

    out = torch.empty(8, 64, 128, dtype=torch.bfloat16)
    runner.health.begin_step()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        runner.health.observe(out)
    allocated = sum(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0)
    assert allocated < 1024, f"the check allocated {allocated} bytes for a {out.nbytes}-byte chunk"
