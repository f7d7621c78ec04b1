"""Progress bars in a saved notebook: a text fallback that names the bar, and train()'s summary line."""

from __future__ import annotations

import pytest


def test_notebook_bar_text_fallback_is_not_its_first_drawing(capsys):
    pytest.importorskip("ipywidgets", reason="notebook bars and panels are ipywidgets (the lab extra)")
    from muonlab.bars import notebook_bar

    bar = notebook_bar("muon", 200)  # outside a kernel display() prints the text it shows
    out = capsys.readouterr().out
    assert "muon: progress bar over 200 steps" in out and "0%" not in out, out
    bar.update(200)
    bar.close()


def test_train_in_a_notebook_leaves_a_summary_line(monkeypatch, capsys):
    pytest.importorskip("ipywidgets", reason="notebook bars and panels are ipywidgets (the lab extra)")
    import importlib

    train_module = importlib.import_module("muonlab.train")  # the module: muonlab.train is also the function
    from muonlab import make_optimizer, train
    from muonlab.models import GPT, GPTConfig

    monkeypatch.setattr(train_module, "in_notebook_kernel", lambda: True)
    model = GPT(GPTConfig(d_model=16, n_layers=1, n_heads=2, context=16))
    hist = train(model, make_optimizer("adamw", model), steps=3, batch_size=2, eval_every=0, eval_batches=1,
                 desc="adamw")
    out = capsys.readouterr().out
    assert "adamw: progress bar over 3 steps" in out
    assert f"adamw: 3 steps, loss {hist.train_loss[0]:.3f} -> {hist.train_loss[-1]:.3f}, " in out, out
