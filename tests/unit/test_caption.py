"""Figures say what produced them (muonlab.viz.caption): a loaded record by its name, kind,
optimizer, steps, seed and commit; a live run by its record's folder and the code plotting it."""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import muonlab  # noqa: E402
from muonlab import runs  # noqa: E402
from muonlab.train import History  # noqa: E402
from muonlab.viz import plot_loss_curves, plot_max_logits, plot_val_loss_vs_time  # noqa: E402
from muonlab.viz.caption import CAPTION_GID, caption_runs, code_version  # noqa: E402


@pytest.fixture(autouse=True)
def _a_runs_folder(tmp_path, monkeypatch):
    monkeypatch.setenv(runs.RUNS_DIR_ENV, str(tmp_path / "runs"))


def _captions(fig) -> list[str]:
    return [t.get_text() for t in fig.texts if t.get_gid() == CAPTION_GID]


def test_a_loaded_record_and_a_live_run_are_named_in_the_caption():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    x = torch.randn(32, 8)
    y = (x[:, 0] > 0).long()
    opt = muonlab.Muon(muonlab.muon_param_groups(model), lr=0.02)
    hist = muonlab.train(model, opt, steps=2, loss_fn="cross_entropy", batches=(x, y), batch_size=8, progress=False)
    name = os.path.basename(hist.record)
    saved = runs.load(name)
    ax = plot_loss_curves({"saved": saved, "live": hist, "losses": [1.0, 0.5]})
    try:
        (text,) = _captions(ax.figure)
        commit = (saved.provenance.get("git") or {}).get("commit")
        expected = f"saved: record {name} (train, Muon, 2 steps, seed 0"
        assert text.startswith(expected), text
        assert commit is None or f"commit {commit[:8]}" in text, text
        assert f"live: record {name}" in text and text.endswith(f"plotted by {code_version()}"), text
        plot_loss_curves({"saved": saved}, ax=ax)  # a redraw into the same figure keeps one caption
        assert _captions(ax.figure) == [caption_runs({"saved": saved})]
        assert "plotted by" not in _captions(ax.figure)[0]  # nothing live: the record says it all
    finally:
        plt.close(ax.figure)


def test_every_plot_of_runs_carries_one():
    h = History(steps=[1, 2], train_loss=[2.0, 1.0], val_steps=[2], val_loss=[1.5], step_time_s=[0.1, 0.1])
    ax = plot_val_loss_vs_time({"muon": h})
    try:
        assert _captions(ax.figure) == [f"muon: not saved; plotted by {code_version()}"]
    finally:
        plt.close(ax.figure)
    h.max_logit = [torch.tensor([[1.0, 2.0]]), torch.tensor([[1.5, 2.5]])]  # [step] (layers, heads)
    ax = plot_max_logits({"muon": h})
    try:
        assert _captions(ax.figure) == [f"muon: not saved; plotted by {code_version()}"]
    finally:
        plt.close(ax.figure)
