"""A Newton-Schulz backend is one registered record: where it can run, the dtypes it takes and how
the executor hands it a batch are what every backend check reads (``possible_backends`` and
"auto", ``NSConfig``, the runner's budget, the executor, the FLOP model), never its name."""

from dataclasses import replace

import pytest
import torch

from muonlab.kernels import backend_choice
from muonlab.kernels.backends import BACKENDS, backend_choices
from muonlab.kernels.config import NSConfig, ns_flops
from muonlab.kernels.forms import FORMS
from muonlab.kernels.forms.plain import symmetric_flops_per_iter
from muonlab.kernels.newton_schulz import newton_schulz, pick_backend, possible_backends
from muonlab.kernels.runner import NewtonSchulzRunner, matrices_within
from muonlab.kernels.workspace import batch_bytes_per_matrix

CPU = torch.device("cpu")


def test_a_registered_backend_that_can_not_run_is_never_picked(monkeypatch):
    # a twin of torch that "auto" would take on any device and dtype, were it not for where it runs
    never = replace(BACKENDS["torch"], name="never", needs="a device that does not exist",
                    why_not=lambda device: "it runs nowhere")
    monkeypatch.setitem(BACKENDS, "never", never)
    assert "never" in backend_choices()

    def no_timing(*args):
        raise AssertionError("timed a backend that can't run")

    monkeypatch.setattr(backend_choice, "faster_backend", no_timing)
    assert possible_backends("auto", CPU, torch.float32) == ("torch",)
    assert pick_backend("auto", CPU, (2, 8, 24), torch.float32, NSConfig()) == "torch"
    G = torch.randn(2, 8, 24, generator=torch.Generator().manual_seed(0))
    runner = NewtonSchulzRunner(2**20)
    runner(G, NSConfig(dtype=torch.float32, backend="auto"))
    assert runner.ran[(8, 24)]["backend"] == "torch"
    # named outright (a registered name is a valid setting), it is refused with its record's reason
    cfg = NSConfig(dtype=torch.float32, backend="never")
    refused = "backend='never' needs a device that does not exist; got device cpu: it runs nowhere"
    with pytest.raises(ValueError, match=refused):
        newton_schulz(G, cfg)
    with pytest.raises(ValueError, match=refused):
        runner(G, cfg)


def test_a_registered_backend_that_runs_is_offered_budgeted_and_run_as_its_record_says(monkeypatch):
    # a twin of torch that takes fp32 only, wants its batches wide and counts symmetric products
    twin = replace(BACKENDS["torch"], name="wide_twin", dtypes=(torch.float32,), wide=True, symmetric_products=True)
    monkeypatch.setitem(BACKENDS, "wide_twin", twin)
    assert possible_backends("auto", CPU, torch.float32) == ("torch", "wide_twin")
    assert possible_backends("auto", CPU, torch.float64) == ("torch",)  # not a dtype it takes
    refused = r"backend='wide_twin' \(Muon's ns_backend\): its kernels take \[torch.float32\]"
    with pytest.raises(ValueError, match=refused):
        NSConfig(backend="wide_twin", dtype=torch.float64)
    assert ns_flops((3, 8, 24), backend="wide_twin") == 3 * 5 * symmetric_flops_per_iter(8, 24)
    # the budget counts the bytes of the hungriest backend "auto" may pick: the wide one's
    m, n = 8, 24
    budget = 30 * batch_bytes_per_matrix(m, n, 4)
    wide_count = budget // batch_bytes_per_matrix(m, n, 4, backend="wide_twin")
    assert wide_count < 30
    assert matrices_within(budget, (m, n), torch.float32, NSConfig(dtype=torch.float32), device=CPU) == wide_count
    # "auto" times the two and runs the pick, handed the tall batch wide
    monkeypatch.setattr(backend_choice, "faster_backend", lambda *args: "wide_twin")
    plain, seen = FORMS["plain"], []

    def iterate(X, spare, squares, *args, kernels):
        seen.append((tuple(X.shape), kernels))
        return plain.iterate(X, spare, squares, *args, kernels=kernels)

    monkeypatch.setitem(FORMS, "plain", replace(plain, iterate=iterate))
    G = torch.randn(3, n, m, generator=torch.Generator().manual_seed(0))
    runner = NewtonSchulzRunner(budget)
    got = runner(G, NSConfig(dtype=torch.float32, backend="auto"))
    assert runner.ran[(n, m)]["backend"] == "wide_twin"
    assert seen == [((3, m, n), "torch")]
    torch.testing.assert_close(got, newton_schulz(G, NSConfig(dtype=torch.float32, backend="torch")),
                               rtol=1e-5, atol=1e-5)
