"""train() arguments and the timeline plots' inputs: refused with the argument or span at fault,
before the model moves or a figure half-draws."""

import math

import matplotlib
import pytest
import torch

from muonlab import Muon, muon_param_groups
from muonlab.models import GPT, GPTConfig
from muonlab.train import train
from muonlab.viz.timeline import plot_plan, plot_rank_distribution, plot_timeline

matplotlib.use("Agg")


@pytest.mark.parametrize("kwargs, match", [
    (dict(context=-1), r"context must be an integer >= 1, got -1"),
    (dict(context=64), r"context 64 is longer than the model's \(8\)"),
    (dict(eval_batches=0), r"eval_batches must be an integer >= 1, got 0"),
    (dict(eval_every=-1), r"eval_every must be an integer >= 0"),
    (dict(batch_size=0), r"batch_size must be an integer >= 1, got 0"),
    (dict(steps=1.5), r"steps must be an integer >= 1, got 1.5"),
    (dict(steps="2"), r"steps must be an integer >= 1, got '2'"),
])
def test_train_names_a_bad_argument_before_the_model_moves(kwargs, match):
    model = GPT(GPTConfig(d_model=16, n_layers=1, n_heads=2, context=8))
    opt = Muon(muon_param_groups(model))
    before = [p.detach().clone() for p in model.parameters()]
    model.eval()
    with pytest.raises(ValueError, match=match):
        train(model, opt, **{"steps": 1, **kwargs})
    assert not model.training and all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


@pytest.mark.parametrize("span, match", [
    (dict(rank=0, name="momentum", start=math.nan, end=1.0), r"span 1 \('momentum' on rank 0\) runs from nan"),
    (dict(rank=0, name="update", start=2.0, end=1.0), r"span 1 \('update' on rank 0\) runs from 2.0 to 1.0"),
    (dict(name="update", start=0.0, end=1.0), r"span 1 .* lacks \['rank'\]"),
])
def test_plot_timeline_names_a_bad_span(span, match):
    good = dict(rank=0, name="newton_schulz", start=0.0, end=0.5)
    with pytest.raises(ValueError, match=match):
        plot_timeline([good, span])


def test_plan_and_distribution_plots_refuse_lists_of_other_lengths():
    import matplotlib.pyplot as plt

    _, ax = plt.subplots()
    with pytest.raises(ValueError, match=r"one value per rank for every path, got lengths \{'local': 3, 'owner': 2\}"):
        plot_rank_distribution(ax, {"local": [1.0, 2.0, 3.0], "owner": [1.0, 2.0]}, ((1, "B"),))
    row = dict(batch=0, path="all_to_all", bytes_sent=[1, 2], flops=[1, 2, 3])
    with pytest.raises(ValueError, match=r"plan row 0 \(batch 0\) has 2 bytes_sent values and 3 flops values"):
        plot_plan([row])
    plt.close("all")
