"""The max-logit plot and the variant panel (muonlab.viz.qk_clip): what they draw from a History,
and bad input refused before a widget exists."""

import math

import matplotlib
import pytest
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from muonlab.train import History  # noqa: E402
from muonlab.viz import max_logit_per_layer, plot_max_logits, variant_panel  # noqa: E402


def _history(peaks):
    """A History whose layer l at step s has heads (peak, peak / 2) with peak = peaks[s][l]."""
    h = History(steps=list(range(1, len(peaks) + 1)), train_loss=[3.0 - 0.1 * s for s in range(len(peaks))])
    h.max_logit = [torch.tensor([[p, p / 2] for p in step]) for step in peaks]
    h.qk_clipped = [0] * len(peaks)
    return h


def test_max_logit_per_layer_and_the_plot_read_the_history():
    h = _history([[2.0, 3.0], [5.0, 40.0], [8.0, 30.0]])
    assert max_logit_per_layer(h) == [[2.0, 5.0, 8.0], [3.0, 40.0, 30.0]]
    ax = plot_max_logits({"Muon": h, "MuonClip": _history([[1.0, 1.0]] * 3)}, tau={"MuonClip": 30.0})
    lines = {line.get_label(): line for line in ax.lines}
    assert list(lines["Muon, layer 1"].get_ydata()) == [3.0, 40.0, 30.0]
    assert list(lines["tau 30 (MuonClip)"].get_ydata()) == [30.0, 30.0]
    assert ax.get_yscale() == "log"
    # a run labelled with its tau (the panel's labels) is not given a second one; one tau for all
    ax = plot_max_logits({"MuonClip (tau 5.01)": h}, tau={"MuonClip (tau 5.01)": 5.01187})
    assert "tau of MuonClip (tau 5.01)" in [line.get_label() for line in ax.lines]
    ax = plot_max_logits({"Muon": h}, tau=5.01187)
    assert "tau 5.01" in [line.get_label() for line in ax.lines]
    plt.close("all")


def test_a_run_without_max_logits_and_bad_panel_settings_are_refused():
    with pytest.raises(ValueError, match="recorded no max logits: train it with qk_clip=tau"):
        max_logit_per_layer(History())
    with pytest.raises(ValueError, match="runs must be a non-empty mapping"):
        plot_max_logits({})
    run = lambda variant, tau: _history([[1.0, 2.0]])  # noqa: E731
    with pytest.raises(ValueError, match=r"variant='Lion' is not one of the panel's choices \['Muon', 'MuonClip'\]"):
        variant_panel(run, ["Muon", "MuonClip"], variant="Lion")
    with pytest.raises(ValueError, match=r"tau=5000.0 is outside tau_range"):
        variant_panel(run, ["Muon", "MuonClip"], tau=5000.0)
    panel = variant_panel(run, ["Muon", "MuonClip"], variant="MuonClip", tau=50.0, keep=1)
    with pytest.raises(ValueError, match="tau=0.5 is outside tau_range"):
        panel.update(tau=0.5)
    assert panel.runs == {}  # nothing ran
    panel.update()
    panel.update(variant="Muon")
    assert list(panel.runs) == ["Muon"] and panel.taus == {}  # keep=1: the MuonClip run and its tau left
    assert panel.status.value.startswith("done: Muon") and math.isfinite(panel.runs["Muon"].train_loss[-1])
    plt.close("all")
