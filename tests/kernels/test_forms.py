"""A Newton-Schulz form is one registered unit: what it declares (its iteration, workspace, FLOPs,
dtypes) is what the dispatcher, the workspace budget, the FLOP model and the timing cache read."""

from dataclasses import replace

import pytest
import torch

from muonlab import newton_schulz
from muonlab.kernels import backend_choice
from muonlab.kernels.forms import FORMS
from muonlab.kernels.config import NSConfig, form_for, ns_flops
from muonlab.kernels.workspace import batch_bytes_per_matrix


def test_a_form_registered_in_one_place_runs_everywhere(monkeypatch):
    # a twin of the plain form, wider workspace and FLOP count of its own: registered only in FORMS
    plain = FORMS["plain"]
    twin = replace(plain, name="plain_twin", squares=5, square_matrices=False,
                   iterate=lambda X, spare, squares, *args, **kw: plain.iterate(X, spare, squares[:2], *args, **kw),
                   flops=lambda m, n, cfg, symmetric=False: 7 * plain.flops(m, n, cfg, symmetric),
                   key=lambda cfg, dtype: "twin")
    monkeypatch.setitem(FORMS, "plain_twin", twin)
    cfg = NSConfig(form="plain_twin", dtype=torch.float32, backend="torch")
    G = torch.randn(3, 12, 40, generator=torch.Generator().manual_seed(0))
    assert torch.equal(newton_schulz(G, cfg), newton_schulz(G, replace(cfg, form="plain")))  # its iteration ran
    assert form_for(cfg, (12, 40)) == "plain_twin" and form_for(cfg, (12, 12)) == "plain"  # square: the plain form
    assert ns_flops((3, 12, 40), cfg) == 7 * ns_flops((3, 12, 40), replace(cfg, form="plain"))
    assert batch_bytes_per_matrix(12, 40, 4, form="plain_twin") - batch_bytes_per_matrix(12, 40, 4) == 3 * 4 * 12 * 12
    assert backend_choice._key((3, 12, 40), torch.float32, cfg).split("|")[3] == "twin"


@pytest.mark.parametrize("name", list(FORMS))
def test_every_form_declares_what_it_iterates_in(name):
    form = FORMS[name]
    cfg = NSConfig(form=name)
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        for native in (True, False):
            assert form.work_dtype(cfg, dtype, native) in form.dtypes
    assert (torch.bfloat16 in form.dtypes) == (name == "plain")  # the gram form never iterates in bf16


def test_a_form_asked_to_iterate_outside_its_dtypes_refuses():
    # the dispatcher's own check, below NSConfig's: a form's work dtype it does not declare
    from muonlab.kernels import execute

    G = torch.randn(1, 8, 24)
    out = torch.full_like(G, 3.0)
    with pytest.raises(ValueError, match="'gram' Newton-Schulz form may not iterate in torch.bfloat16"):
        execute.run([G], [out], NSConfig(form="gram"), form="gram", backend="torch", dtype=torch.bfloat16)
    assert bool((out == 3).all())
