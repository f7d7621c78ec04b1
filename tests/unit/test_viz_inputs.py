"""Inputs the views refuse with a clear error, or draw without one: starting values outside a
panel's controls, span rows in the Chrome-trace export, worlds smaller than a plan, empty metrics."""

import json
import math
from dataclasses import asdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from muonlab.simulate import simulate  # noqa: E402
from muonlab.trace import Span, write_chrome_trace  # noqa: E402
from muonlab.trace.spans import to_chrome_trace  # noqa: E402
from muonlab.train import History  # noqa: E402
from muonlab.viz.curves import plot_loss_curves  # noqa: E402
from muonlab.viz.planner import plot_plan_per_rank  # noqa: E402
from muonlab.viz.timeline import plot_plan  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


# ---------------------------------------------------------------- spectral panel

def _adamw_records():
    """Spectral records of an AdamW run: no Newton-Schulz, so no ortho_error values."""
    from muonlab.trace.spectral import SpectralRecorder

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.Linear(16, 4, bias=False))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rec = SpectralRecorder(opt, model, every=1)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
    return rec.records


def test_spectral_panel_draws_a_metric_no_run_has():
    pytest.importorskip("ipywidgets")
    from muonlab.viz.spectral import ALL, spectral_panel

    runs = {"adamw": _adamw_records()}
    panel = spectral_panel(runs)
    fig = panel.update(name=ALL, metric="ortho_error")
    assert "no values" in " ".join(t.get_text() for ax in fig.axes for t in ax.texts)
    # the same from the dropdown, as a user picks it
    panel = spectral_panel(runs, metric="ortho_error")
    panel.name.value = ALL
    assert panel.output.outputs  # drawn
    # the dropdown's own choice is a valid starting value
    assert spectral_panel(runs, name=ALL).name.value == ALL


# ---------------------------------------------------------------- training panel

@pytest.mark.parametrize("kwargs, name", [(dict(lr=0.2), "lr"), (dict(momentum=0.995), "momentum"),
                                          (dict(ns_steps=12), "ns_steps"), (dict(lr=math.nan), "lr")])
def test_training_panel_refuses_starting_values_its_sliders_cannot_hold(kwargs, name):
    pytest.importorskip("ipywidgets")
    from muonlab.viz.widgets import training_panel

    with pytest.raises(ValueError, match=rf"^{name}=.*range"):
        training_panel(lambda **v: None, **kwargs)


# ---------------------------------------------------------------- planner panel

@pytest.mark.parametrize("kwargs, name", [(dict(layers=100), "layers"), (dict(experts=0), "experts"),
                                          (dict(profile="h200"), "profile"), (dict(strategy="foo"), "strategy")])
def test_planner_panel_refuses_starting_values_its_controls_cannot_hold(kwargs, name):
    pytest.importorskip("ipywidgets")
    from muonlab.viz.planner import planner_panel

    with pytest.raises(ValueError, match=rf"^{name}="):
        planner_panel(auto=False, **kwargs)


# ---------------------------------------------------------------- chrome trace

SPANS = [Span("comm_out", 0.0, 1.0, rank=0, path="agrs", batch=0, bytes_sent=10),
         Span("newton_schulz", 1.0, 2.0, rank=1, path="agrs", batch=0)]


def test_chrome_trace_takes_the_span_rows_plot_timeline_takes(tmp_path):
    rows = [asdict(s) for s in SPANS]  # what train_worker(...)["spans"] holds
    assert to_chrome_trace(rows) == to_chrome_trace(SPANS)
    # rows need only what plot_timeline needs
    minimal = [dict(name="update", start=0.0, end=1.0, rank=0)]
    assert to_chrome_trace(minimal)["traceEvents"][0]["args"]["batch"] == -1
    write_chrome_trace(rows, tmp_path / "trace.json")
    assert json.loads((tmp_path / "trace.json").read_text())["traceEvents"]


def test_chrome_trace_refuses_non_finite_times(tmp_path):
    out = tmp_path / "trace.json"
    with pytest.raises(ValueError, match="span 0 .*finite"):
        write_chrome_trace([Span("update", 0.0, math.nan, rank=0)], out)
    assert not out.exists()  # nothing half written


def test_span_rows_refuses_times_that_are_not_numbers_naming_the_span(tmp_path):
    from muonlab.trace.spans import span_rows

    good = dict(rank=0, name="momentum", start=1.0, end=2.0)
    for bad in (None, "1.5", True, [1.0]):
        for field in ("start", "end"):
            row = dict(good, rank=1, name="update", **{field: bad})
            with pytest.raises(ValueError, match=r"span 1 \('update' on rank 1\) .*must be real numbers"):
                span_rows([good, row])
            with pytest.raises(ValueError, match="span 1 "):
                write_chrome_trace([good, row], tmp_path / "trace.json")
    assert not (tmp_path / "trace.json").exists()
    span_rows([good, dict(good, start=1, end=torch.tensor(2.0).item())])  # ints and Python floats are times


# ---------------------------------------------------------------- plans

def test_plan_per_rank_refuses_a_world_smaller_than_the_plan():
    plan = simulate([(f"l{i}.w", (64, 48)) for i in range(5)], 4)
    plot_plan_per_rank(plan, 4)
    plot_plan_per_rank(plan, 8)  # more ranks than the plan's: the others are idle
    with pytest.raises(ValueError, match=r"world=2 .*4 ranks"):
        plot_plan_per_rank(plan, 2)


def test_plot_plan_draws_rows_with_empty_per_rank_lists():
    rows = [dict(batch=0, path="local", bytes_sent=[], flops=[], max_bytes_sent=0, max_flops=0)]
    ax_bytes, _ = plot_plan(rows)
    assert ax_bytes.get_title().endswith("bytes per batch")


# ---------------------------------------------------------------- loss curves

def test_loss_curves_name_the_run_with_mismatched_lengths():
    good = History(steps=[0, 1], train_loss=[1.0, 0.9], val_steps=[1], val_loss=[0.95])
    bad = History(steps=[0, 1, 2], train_loss=[1.0, 0.9], val_steps=[1], val_loss=[0.95])
    plot_loss_curves({"good": good})
    with pytest.raises(ValueError, match=r"'bad'.*3 steps.*2 train_loss"):
        plot_loss_curves({"good": good, "bad": bad})
    bad_val = History(steps=[0], train_loss=[1.0], val_steps=[0, 1], val_loss=[0.95])
    with pytest.raises(ValueError, match=r"'v'.*2 val_steps.*1 val_loss"):
        plot_loss_curves({"v": bad_val})
