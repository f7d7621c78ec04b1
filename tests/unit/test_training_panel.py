"""TrainingPanel (muonlab.viz.widgets) run without a frontend, as the button would run it."""

from __future__ import annotations

import re

import pytest


def test_a_panel_run_shows_the_training_progress_bar(capsys):
    pytest.importorskip("ipywidgets", reason="notebook bars and panels are ipywidgets (the lab extra)")
    from muonlab.models import GPTConfig
    from muonlab.viz.widgets import muon_trainer, training_panel

    cfg = GPTConfig(d_model=16, n_layers=1, n_heads=2, context=16)
    panel = training_panel(muon_trainer(cfg, steps=3, batch_size=2, eval_batches=1))
    panel.update()
    # outside a kernel tqdm.auto is the text bar; in a notebook it is drawn in the panel's output
    err = capsys.readouterr().err
    assert re.search(r"muon: .*\d/3 ", err), err  # the bar of train(..., desc="muon") over 3 steps
    assert panel.status.value.startswith("done: lr=0.02")


def test_a_failing_run_says_so_in_the_panel():
    pytest.importorskip("ipywidgets", reason="notebook bars and panels are ipywidgets (the lab extra)")
    from muonlab.viz.widgets import training_panel

    def run(**values):
        raise RuntimeError("out of memory, say")

    panel = training_panel(run)
    with pytest.raises(RuntimeError, match="out of memory"):
        panel.update()
    assert panel.status.value.startswith("failed: lr=0.02") and "out of memory, say" in panel.status.value
