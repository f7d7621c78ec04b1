"""Coefficient schedules as registered units: where their numbers come from, their step counts,
bounded output wherever each is allowed to run, and a clear refusal (before anything is written)
wherever it is not."""

import importlib

import pytest
import torch

from muonlab import newton_schulz
from muonlab.kernels.forms import FORMS
from muonlab.kernels.batch_io import Overwrite
from muonlab.kernels.coefficients import PRESETS
from muonlab.kernels.config import NSConfig, form_for
from muonlab.kernels.newton_schulz import resolve_form, work_dtype
from muonlab.kernels.precision import NS_DTYPES
from muonlab.kernels.runner import NewtonSchulzRunner
from muonlab.kernels.schedules import SCHEDULES
from test_bounded import training_like_inputs

TOP_BOUND = 1.5


def hard_inputs(m: int, n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """The training-like inputs of test_bounded.py (low-rank, an EMA of low-rank gradients,
    ill-conditioned, tiny, huge, zero), where schedules without a safety margin break, and one
    more: condition 1e3 under a single top direction."""
    inputs = training_like_inputs(m, n, seed)
    g = torch.Generator().manual_seed(seed + 1)
    k = min(m, n)
    U, _ = torch.linalg.qr(torch.randn(m, k, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(n, k, generator=g, dtype=torch.float64))
    top = torch.cat([torch.ones(1, dtype=torch.float64), torch.full((k - 1,), 1e-3, dtype=torch.float64)])
    inputs["cond1e3-rank1-top"] = U @ torch.diag(top) @ V.T
    return inputs


# wide and tall (the gram form runs there), square (always the plain form), and tiny matrices
SHAPES = [(6, 64), (24, 8), (12, 12), (2, 3), (1, 7)]
GRAM_DTYPES = (None, torch.float16, torch.float32)  # None: the device's default (on a CPU: fp32 for halves)


def step_counts(schedule) -> list[int]:
    """The fewest steps it may run, its table's length and two past it (its last entry
    repeated). The three schedules muonlab shipped before the registry (``PRESETS``) keep no
    restrictions, to stay bit for bit what they were, and are checked at the five steps they are
    published for (as test_bounded.py does): at other counts they are not bounded everywhere
    (xtuner, 7 steps, gram form in fp16: 1.81 on a matrix of condition 1e6; polar_express under 5
    steps: up to 1.99 even in exact arithmetic)."""
    if schedule.name in PRESETS:
        return [5]
    return sorted({schedule.min_steps, len(schedule.table), len(schedule.table) + 2})


def _settings(form: str):
    return [dict(form=form, gram_dtype=gd) for gd in (GRAM_DTYPES if form == "gram" else (None,))]


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_schedule_is_bounded_where_allowed_and_refused_elsewhere(name, form):
    schedule, ran, refused = SCHEDULES[name], 0, 0
    for steps in step_counts(schedule):
        for settings in _settings(form):
            for dtype in NS_DTYPES:
                for shape in SHAPES:
                    inputs = hard_inputs(*shape)
                    G = torch.stack(list(inputs.values())).to(torch.float32)
                    case = dict(coefficients=name, steps=steps, dtype=dtype, backend="torch", **settings)
                    # refused where the asked form could iterate in a refused dtype on some device
                    # (a GPU multiplies fp16 natively, this CPU may not), or the form that runs
                    # here (plain on square matrices) does
                    asked = NSConfig(**settings)
                    runs = form_for(asked, shape)
                    anywhere = {FORMS[form].work_dtype(asked, dtype, native) for native in (True, False)}
                    here = work_dtype(asked, runs, dtype, "cpu")
                    allowed = (schedule.refusal(runs, here, steps) is None
                               and all(schedule.refusal(form, d) is None for d in anywhere))
                    if not allowed:
                        with pytest.raises(ValueError, match=f"schedule '{name}'"):
                            newton_schulz(G, **case)
                        refused += 1
                        continue
                    O = newton_schulz(G, **case)
                    assert torch.isfinite(O).all(), (case, shape)
                    top = torch.linalg.matrix_norm(O.double(), ord=2)
                    worst = int(top.argmax())
                    assert top.max() <= TOP_BOUND, \
                        f"{list(inputs)[worst]} {shape}: top singular value {top[worst]:.4g} with {case}"
                    ran += 1
    assert ran  # every schedule runs somewhere in every form
    if schedule.allowed is None:
        assert refused == 0


def test_the_bound_would_catch_an_unsafe_schedule():
    # the check above, on the numbers that made 'cans' refuse 16-bit iterates: its first quintic
    # sends sigma = 1 to 1.99, and bf16 rounding above that diverges on these inputs (passed as
    # explicit coefficients, which no schedule restricts)
    for shape in SHAPES[:3]:
        inputs = hard_inputs(*shape)
        G = torch.stack([inputs["rank1"], inputs["cond1e3-rank1-top"]]).float()
        O = newton_schulz(G, coefficients=SCHEDULES["cans"].table, dtype=torch.bfloat16, backend="torch").double()
        assert not torch.isfinite(O).all() or torch.linalg.matrix_norm(O, ord=2).max() > TOP_BOUND, shape


def test_every_schedule_names_its_source_and_is_usable_by_name():
    for name, schedule in SCHEDULES.items():
        assert schedule.name == name
        assert "arXiv:" in schedule.source or "https://" in schedule.source, name
        cfg = NSConfig(coefficients=name, steps=max(5, schedule.min_steps), dtype=torch.float32)
        assert cfg.resolved_coefficients() == schedule.coefficients(cfg.steps)


def test_polar_express_at_other_step_counts_follows_its_authors():
    """The authors' reference implementation runs ``steps`` iterations as the first ``steps`` of
    their published sequence (safety factor 1.01 on all but the last), the last repeated."""
    schedule = SCHEDULES["polar_express_paper"]
    published_first = (8.28721201814563, -23.595886519098837, 17.300387312530933)
    assert schedule.table[0] == (published_first[0] / 1.01, published_first[1] / 1.01**3, published_first[2] / 1.01**5)
    assert schedule.table[-1] == (1.875, -1.25, 0.375) and len(schedule.table) == 8
    assert schedule.norm_scale == 1.01
    for steps in (5, 6, 7, 8):
        assert schedule.coefficients(steps) == list(schedule.table[:steps])
    assert schedule.coefficients(11)[8:] == [(1.875, -1.25, 0.375)] * 3
    # a second publication of the same numbers, rounded to 4 decimals with the safety factor in
    # (NVIDIA-NeMo/Emerging-Optimizers, muon_utils.py, "polar_express")
    nemo = [(8.2051, -22.9019, 16.4607), (4.0664, -2.8612, 0.5184), (3.9096, -2.8234, 0.5250),
            (3.2856, -2.4153, 0.4853), (2.2779, -1.6198, 0.3985), (1.8726, -1.2307, 0.3585),
            (1.8564, -1.2132, 0.3568), (1.8750, -1.2500, 0.3750)]
    for ours, theirs in zip(schedule.table, nemo):
        assert all(abs(a - b) <= 1e-4 for a, b in zip(ours, theirs)), (ours, theirs)


@pytest.mark.parametrize("name, steps, lo, hi", [("polar_express_paper", 8, 1 - 1e-12, 1 + 1e-12),
                                                   ("polar_express_paper", 5, 0.84, 1.124),
                                                   ("cans", 5, 0.884, 1.12)])
def test_published_polynomials_do_what_their_papers_say_on_singular_values(name, steps, lo, hi):
    # both are built for singular values in [1e-3, 1] after normalisation: the composed scalar
    # polynomial, in fp64, maps that interval into a band around 1 (8 Polar Express steps: onto 1)
    schedule = SCHEDULES[name]
    x = torch.logspace(-3, 0, 20001, dtype=torch.float64) / schedule.norm_scale
    for a, b, c in schedule.coefficients(steps):
        x = a * x + b * x**3 + c * x**5
    assert lo <= x.min() and x.max() <= hi, (float(x.min()), float(x.max()))


def test_too_few_steps_are_refused_by_name():
    with pytest.raises(ValueError, match=r"schedule 'cans' .* needs at least 5 steps \(Muon's ns_steps\), got 4"):
        NSConfig(coefficients="cans", steps=4)
    with pytest.raises(ValueError, match="schedule 'polar_express_paper'.*at least 5 steps"):
        newton_schulz(torch.randn(4, 8), coefficients="polar_express_paper", steps=3, dtype=torch.float32)


def test_a_refused_dtype_changes_nothing():
    """Refused before any write: the config's dtype (at NSConfig), or the input's dtype with
    dtype=None (once newton_schulz sees it), for Overwrite pieces, an out buffer and the runner."""
    g = torch.Generator().manual_seed(3)
    pieces = Overwrite([torch.randn(2, 8, 24, generator=g).bfloat16(), torch.randn(1, 8, 24, generator=g).bfloat16()])
    before = [p.clone() for p in pieces]
    with pytest.raises(ValueError, match=r"schedule 'cans' .* may not iterate in bfloat16 in the 'plain' form"):
        newton_schulz(pieces, coefficients="cans", dtype=None)
    with pytest.raises(ValueError, match=r"schedule 'cans' .* may not iterate in bfloat16"):
        NSConfig(coefficients="cans", dtype=torch.bfloat16)
    out = torch.full((3, 8, 24), 7.0)
    with pytest.raises(ValueError, match="schedule 'cans'"):
        newton_schulz(pieces, coefficients="cans", dtype=None, out=out)
    with pytest.raises(ValueError, match="schedule 'cans'"):
        NewtonSchulzRunner(2**20)(pieces, NSConfig(coefficients="cans", dtype=None))
    with pytest.raises(ValueError, match="schedule 'cans'"):  # "auto" is bf16 on a GPU: refused everywhere
        NSConfig(coefficients="cans")
    assert all(torch.equal(p, b) for p, b in zip(pieces, before)) and bool((out == 7).all())
    # fp32 runs, bounded
    O = newton_schulz(pieces[0].float(), coefficients="cans", dtype=torch.float32)
    assert torch.linalg.matrix_norm(O.double(), ord=2).max() <= 1.2


def test_a_form_refused_in_some_dtype_is_not_what_auto_picks(monkeypatch):
    """ns_form="auto" decides from the config alone, the same on every device: a schedule refused
    in the gram form in a dtype that form could iterate in (fp16 on a GPU) keeps the plain form;
    asked for outright with such iterates, the gram form is refused by name: at NSConfig where
    its dtype is fixed (gram_dtype), else once newton_schulz knows the device."""
    auto = resolve_form("auto")
    assert form_for(NSConfig(coefficients="polar_express_paper", **auto), (16, 64)) == "plain"
    assert form_for(NSConfig(coefficients="polar_express_paper", dtype=torch.float32, **auto), (16, 64)) == "gram"
    assert form_for(NSConfig(coefficients="polar_express", **auto), (16, 64)) == "gram"  # no restriction
    refused = r"schedule 'polar_express_paper' .* may not iterate in float16 in the 'gram' form"
    with pytest.raises(ValueError, match=refused):
        NSConfig(coefficients="polar_express_paper", form="gram", gram_dtype=torch.float16)
    for dtype in (torch.float16, torch.bfloat16, "auto"):  # iterates in fp16 on a GPU: refused on every device
        with pytest.raises(ValueError, match=refused):
            NSConfig(coefficients="polar_express_paper", form="gram", dtype=dtype)
    assert NSConfig(coefficients="polar_express_paper", form="gram", dtype=torch.float16, gram_dtype=torch.float32)
    # dtype=None: the input's, known once newton_schulz sees it; there the device's rule decides
    G = torch.randn(8, 40, dtype=torch.float16)
    ns = importlib.import_module("muonlab.kernels.newton_schulz")  # the package exports a function of that name
    monkeypatch.setattr(ns, "native_fp16_matmul", lambda device: False)  # a CPU's rule: gram iterates in fp32
    assert newton_schulz(G, coefficients="polar_express_paper", form="gram", dtype=None).dtype == torch.float16
    monkeypatch.setattr(ns, "native_fp16_matmul", lambda device: True)  # a GPU's rule: in fp16
    with pytest.raises(ValueError, match=refused):
        newton_schulz(G, coefficients="polar_express_paper", form="gram", dtype=None)


def test_muon_with_a_schedule_refused_in_its_dtype_fails_before_its_first_step_changes_anything():
    from muonlab import Muon

    p = torch.nn.Parameter(torch.randn(16, 32))
    p.grad = torch.randn(16, 32)
    before = p.detach().clone()
    opt = Muon([p], ns_coefficients="cans")  # ns_dtype="auto": bf16 on a GPU, where cans is not bounded
    with pytest.raises(ValueError, match=r"schedule 'cans' .* may not iterate in bfloat16"):
        opt.step()
    assert torch.equal(p.detach(), before) and not opt.state.get(p)
    Muon([p], ns_coefficients="cans", ns_dtype=torch.float32).step()  # fp32: runs
    assert not torch.equal(p.detach(), before)
