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


def _history(val_loss):
    from muonlab.train import History

    h = History(tokens_per_step=1)
    h.steps, h.train_loss, h.step_time_s, h.val_steps, h.val_loss = [1, 2], [3.0, 2.5], [0.1, 0.1], [2], val_loss
    return h


def test_an_interrupted_or_empty_run_says_so_and_a_run_the_plot_refuses_is_not_kept():
    """The status stayed on "training" after a Ctrl-C or an empty result; a run the plot refused
    was kept (every later click failed on it), said "done" and left a pyplot figure open."""
    pytest.importorskip("ipywidgets", reason="notebook bars and panels are ipywidgets (the lab extra)")
    import matplotlib.pyplot as plt

    from muonlab.viz.widgets import training_panel

    def interrupted(**values):
        raise KeyboardInterrupt

    panel = training_panel(interrupted)
    with pytest.raises(KeyboardInterrupt):
        panel.update()
    assert panel.status.value.startswith("interrupted: lr=0.02"), panel.status.value
    panel = training_panel(lambda **values: {})
    with pytest.raises(ValueError, match="no runs"):
        panel.update()
    assert panel.status.value.startswith("failed: lr=0.02"), panel.status.value

    results = iter([_history([]), _history([2.4])])  # the first: a val step without a val loss
    panel = training_panel(lambda **values: next(results))
    figures = len(plt.get_fignums())
    with pytest.raises(ValueError):
        panel.update()
    assert panel.status.value.startswith("failed") and not panel.runs
    assert len(plt.get_fignums()) == figures
    panel.lr.value = 0.05
    panel.update()
    assert panel.status.value.startswith("done: lr=0.05") and len(panel.runs) == 1
    plt.close("all")


def test_val_loss_vs_time_puts_an_evaluation_before_the_first_step_at_time_zero():
    import matplotlib.pyplot as plt

    from muonlab.viz.widgets import plot_val_loss_vs_time

    h = _history([2.4, 2.2])
    h.val_steps = [0, 2]
    ax = plot_val_loss_vs_time({"run": h})
    assert list(ax.lines[0].get_xdata()) == pytest.approx([0.0, 0.2])
    h.val_steps = [0, 3]  # no training time for step 3: named, and no figure left open
    figures = len(plt.get_fignums())
    with pytest.raises(ValueError, match="run 'run'"):
        plot_val_loss_vs_time({"run": h})
    assert len(plt.get_fignums()) == figures
    plt.close("all")


def test_a_training_run_that_raises_closes_its_bar():
    import torch
    from tqdm import tqdm

    from muonlab.models import GPT, GPTConfig
    from muonlab.train import make_optimizer, train

    torch.manual_seed(0)
    model = GPT(GPTConfig(d_model=16, n_layers=1, n_heads=2, context=16))
    opt = make_optimizer("muon", model)
    step, calls = opt.step, []

    def failing_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return step(*args, **kwargs)

    opt.step = failing_step
    before = set(tqdm._instances)
    with pytest.raises(KeyboardInterrupt) as err:
        train(model, opt, steps=5, batch_size=2, eval_batches=1, desc="muon")
    kept = err.value.__traceback__  # held, as a notebook holds the last traceback (it keeps the bar alive)
    assert set(tqdm._instances) <= before, [b.desc for b in tqdm._instances]
    del kept
