"""muonlab.run_checks: the facts the notebooks' check cells print hold on a working run and turn
False on a broken one (a Newton-Schulz schedule that blows up, as bf16 gram iterates did)."""

import pytest
import torch

from muonlab import compare_optimizers
from muonlab.models import GPTConfig
from muonlab.run_checks import check_run, format_checks, update_rms_ratios

CFG = GPTConfig(d_model=32, n_layers=1, n_heads=2, context=16)
LR = 0.02


def _muon_run(coefficients, steps=12, **kwargs):
    kwargs = dict(lr=LR, adamw_lr=3e-3, ns_coefficients=coefficients, **kwargs)
    return compare_optimizers(CFG, names=("muon",), steps=steps, batch_size=8, eval_every=steps, eval_batches=1,
                              spectral_every=3, progress=False, optimizer_kwargs={"muon": kwargs})["muon"]


@pytest.mark.parametrize("coefficients", ["keller", "xtuner", "polar_express"])
def test_a_working_run_passes_every_check(coefficients):
    history = _muon_run(coefficients)
    checks = check_run(history, muon_lr=LR)
    assert all(checks.values()), format_checks(checks)
    assert len(checks) == 4
    assert all(0.5 <= q <= 2 for q in update_rms_ratios(history, LR))


# The dtype is forced: under ns_dtype="auto" the run would differ between CPUs with and without bf16.
@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_run_whose_newton_schulz_overflows_fails_them(ns_dtype):
    # 1e30 X per step, no cubic terms: the update overflows every dtype; the run turns NaN
    checks = check_run(_muon_run([(1e30, 0.0, 0.0)], steps=6, ns_dtype=ns_dtype), muon_lr=LR)
    assert not any(checks.values()), format_checks(checks)


def test_a_run_whose_newton_schulz_grows_but_stays_finite_fails_the_rms_check():
    # 3 X per step: each update is 243x an orthogonal factor. In fp32 the normalised GPT still
    # trains (its loss falls, every value finite): only the update's size shows the broken schedule.
    checks = check_run(_muon_run([(3.0, 0.0, 0.0)], steps=6, ns_dtype=torch.float32), muon_lr=LR)
    assert checks["finite"] and checks["orthogonality error finite"], format_checks(checks)
    assert not checks["update RMS within 2x of lr x ratio"]


def test_an_update_too_large_but_finite_fails_the_rms_check():
    # an lr the check was not told about: updates 4x what lr x ratio gives, every value finite
    history = _muon_run("keller")
    checks = check_run(history, muon_lr=LR / 4)
    assert checks["loss falls"] and checks["finite"] and checks["orthogonality error finite"]
    assert not checks["update RMS within 2x of lr x ratio"]


def test_a_run_without_steps_is_refused():
    from muonlab import History

    with pytest.raises(ValueError, match="at least one training step"):
        check_run(History())
