"""A model of your own through train, compare_optimizers and the plots (issue 32, the researcher's
task 1), the batch sources and losses train takes, and the figures' shared parts: integer step
ticks, y-axes a diverged run does not flatten, the Newton-Schulz choice in legends and titles,
layers told apart by their full names."""

import math

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from muonlab import Muon, compare_optimizers, muon_param_groups, train  # noqa: E402
from muonlab.train import History  # noqa: E402
from muonlab.viz import ns_choice_short, plot_loss_curves, plot_spectral, plot_spectral_layers, robust_ylim  # noqa: E402
from muonlab.viz.spectral import SpectralPanel, _kind  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _data(rows: int = 256, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 16, generator=gen)
    return x, (x[:, :4] * torch.tensor([1.0, -2.0, 0.5, 1.5])).argmax(1)  # a class the model can learn


def _mlp():
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def test_task1_your_own_sequential_in_ten_lines():
    """The researcher's task 1 as a cell: an nn.Sequential through muon_param_groups, Muon, its
    spectral records (train's SpectralRecorder), train and the plots; 10 lines."""
    x, y = _data()
    # ---- the cell
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = Muon(muon_param_groups(model), lr=0.02)
    hist = train(model, opt, steps=40, loss_fn="cross_entropy", batches=(x, y), batch_size=32,
                 spectral_every=10, progress=False)
    fig, (ax_loss, ax_sigma) = plt.subplots(1, 2, figsize=(12, 3.5))
    plot_loss_curves({"muon": hist}, ax=ax_loss)
    plot_spectral_layers(hist, "weight_sigma", ax=ax_sigma)
    # ---- what it gave
    assert sum(hist.train_loss[-10:]) < sum(hist.train_loss[:10]), hist.train_loss
    assert hist.tokens_per_step == 32 and hist.val_loss == [] and len(hist.steps) == 40
    assert {r.name for r in hist.spectral} == {"0.weight", "2.weight", "4.weight"}
    # the layers of the Sequential are told apart: one colour and one legend entry each
    legend = [t.get_text() for t in ax_sigma.get_legend().get_texts()]
    assert legend == ["0.weight", "2.weight", "4.weight"], legend
    assert len({line.get_color() for line in ax_sigma.lines}) == 3
    # what Newton-Schulz ran, in the legend and the title
    ns = ns_choice_short(hist.ns_choices)
    assert ns and ns.count(",") == 2, ns
    assert [t.get_text() for t in ax_loss.get_legend().get_texts()] == [f"muon ({ns}) train"]
    assert f"Newton-Schulz: {ns}" in ax_sigma.get_title()


def test_ns_choice_short_names_dtype_form_backend_and_what_differs():
    rows = [dict(dtype="bfloat16", form="plain", backend="torch"), dict(dtype="bfloat16", form="gram", backend="torch")]
    assert ns_choice_short(rows[:1]) == "bf16, plain, torch"
    assert ns_choice_short(rows) == "bf16, plain/gram, torch"
    assert ns_choice_short([dict(dtype="float32", form="plain", backend="auto (timed at the first step)")]) \
        == "fp32, plain, auto"
    assert ns_choice_short([]) == "" and ns_choice_short(None) == ""


# ---------------------------------------------------------------------------------- batch sources


def test_every_batch_source_trains_and_a_dataset_follows_the_seed():
    x, y = _data()
    seen = []

    def by_step(step):
        seen.append(step)
        return x[(step * 8) % 256:(step * 8) % 256 + 8], y[(step * 8) % 256:(step * 8) % 256 + 8]

    sources = {
        "dataset": dict(batches=(x, y), batch_size=8),
        "callable": dict(batches=by_step),
        "loader": dict(batches=DataLoader(TensorDataset(x[:24], y[:24]), batch_size=8)),  # 3 batches: 2 epochs
        "list": dict(batches=[(x[:8], y[:8]), (x[8:16], y[8:16])]),
    }
    losses = {}
    for name, kwargs in sources.items():
        torch.manual_seed(0)
        model = _mlp()
        hist = train(model, Muon(muon_param_groups(model)), steps=5, loss_fn="cross_entropy", progress=False,
                     **kwargs)
        losses[name] = hist.train_loss
        assert len(hist.train_loss) == 5 and all(math.isfinite(v) for v in hist.train_loss), name
        assert hist.tokens_per_step == 8, name
    assert seen == [1, 2, 3, 4, 5]  # a callable gets the step, from 1
    torch.manual_seed(0)
    model = _mlp()
    again = train(model, Muon(muon_param_groups(model)), steps=5, loss_fn="cross_entropy", batches=(x, y),
                  batch_size=8, progress=False)
    assert again.train_loss == losses["dataset"]


def test_validation_from_a_source_of_your_own_the_same_batches_each_time():
    x, y = _data()
    torch.manual_seed(0)
    model = _mlp()
    hist = train(model, torch.optim.SGD(model.parameters(), lr=0.0), steps=4, loss_fn=nn.functional.cross_entropy,
                 batches=(x, y), batch_size=16, val_batches=DataLoader(TensorDataset(x, y), batch_size=32),
                 eval_every=2, eval_batches=2, progress=False)
    assert hist.val_steps == [2, 4]
    assert hist.val_loss[0] == hist.val_loss[1]  # lr 0: the same model on the same validation batches
    assert hist.ns_choices == []  # not muonlab's Muon


def test_a_model_that_computes_its_own_loss_needs_no_loss_fn():
    class WithLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 4)

        def forward(self, x, y):
            return nn.functional.cross_entropy(self.fc(x), y)

    class Output:  # as a Hugging Face model returns
        def __init__(self, loss):
            self.loss = loss

    class HFStyle(WithLoss):
        def forward(self, inputs, labels):
            return Output(super().forward(inputs, labels))

    x, y = _data()
    for model, batches in ((WithLoss(), [(x[:8], y[:8])]), (HFStyle(), [dict(inputs=x[:8], labels=y[:8])])):
        hist = train(model, Muon(muon_param_groups(model)), steps=2, batches=batches, progress=False)
        assert len(hist.train_loss) == 2


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(batches=lambda s: (torch.zeros(4, 16), torch.zeros(4, dtype=torch.long)), loss_fn="crossentropy"),
     ValueError, r"unknown loss 'crossentropy': name a torch.nn.functional function, e.g. 'cross_entropy'"),
    (dict(batches=lambda s: (torch.zeros(4, 16), torch.zeros(4, dtype=torch.long)), loss_fn=3),
     TypeError, r"loss_fn must be a function"),
    (dict(batches=lambda s: torch.zeros(4, 16)), TypeError,
     r"the loss must be one number, got a tensor of shape \(4, 4\): pass loss_fn="),
    (dict(batches=lambda s: (torch.zeros(4, 16),), loss_fn="mse_loss"), TypeError,
     r"a batch for loss_fn must be a pair \(inputs, target\), got a tuple of 1"),
    (dict(batches=_data(), loss_fn="cross_entropy"), ValueError, r"batches is a dataset of 256 rows: pass batch_size="),
    (dict(batches=(torch.zeros(4, 16), torch.zeros(5)), batch_size=2), ValueError,
     r"a tuple of tensors is a dataset and needs one leading size"),
    (dict(batches=lambda s: _data(8), batch_size=8), ValueError,
     r"batch_size is read for the corpus and for a dataset of tensors; batches is a callable"),
    (dict(batches=lambda s: _data(8), context=8), ValueError, r"context is the corpus's window length"),
    (dict(batches=lambda s: _data(8), loss_fn="cross_entropy", eval_every=2), ValueError,
     r"eval_every=2 needs val_batches="),
    (dict(batches=[_data(8)], val_batches=iter([_data(8)]), loss_fn="cross_entropy"), ValueError,
     r"val_batches is evaluated again every eval_every steps"),
    (dict(batches=42), TypeError, r"batches must be a tuple of tensors \(a dataset\), a callable step -> batch or an "
                                  r"iterable of batches"),
    (dict(val_batches=[_data(8)]), ValueError, r"val_batches is read with batches of your own"),
])
def test_train_names_what_to_pass_for_a_model_of_your_own(kwargs, error, match):
    model = _mlp()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(error, match=match):
        train(model, Muon(muon_param_groups(model)), **{"steps": 1, "progress": False, **kwargs})
    # the values as they were (a check made on the first batch finds the model on the run's device, as
    # a run would leave it: on a GPU machine, cuda:0)
    assert all(torch.equal(a, p.cpu()) for a, p in zip(before, model.parameters()))


def test_an_iterator_that_runs_out_is_named_at_its_step():
    model = _mlp()
    with pytest.raises(ValueError, match=r"batches ran out at step 2: an iterator is used once; pass a DataLoader"):
        train(model, Muon(muon_param_groups(model)), steps=2, batches=iter([_data(8)]), loss_fn="cross_entropy",
              progress=False)


def test_a_model_of_your_own_without_batches_is_told_to_pass_them():
    with pytest.raises(ValueError, match=r"context must be given: .* pass batches= of your own, with loss_fn="):
        model = _mlp()
        train(model, Muon(muon_param_groups(model)), steps=1, progress=False)


def test_compare_optimizers_takes_a_module_or_a_function_and_leaves_the_module_alone():
    x, y = _data()
    torch.manual_seed(0)
    model = _mlp()
    start = {n: p.detach().clone() for n, p in model.state_dict().items()}
    common = dict(steps=3, loss_fn="cross_entropy", batches=(x, y), batch_size=16, progress=False)
    runs = compare_optimizers(model, **common)
    assert set(runs) == {"muon", "adamw"}
    assert runs["muon"].train_loss[0] == runs["adamw"].train_loss[0]  # one initial model, one first batch
    assert runs["muon"].train_loss[1] != runs["adamw"].train_loss[1]
    assert all(torch.equal(start[n], p) for n, p in model.state_dict().items())
    assert runs["muon"].ns_choices and not runs["adamw"].ns_choices
    built = compare_optimizers(_mlp, seed=0, **common)
    assert built["muon"].train_loss == runs["muon"].train_loss  # _mlp() after manual_seed(0) is that model
    with pytest.raises(ValueError, match="batches is an iterator, which the first optimizer would use up"):
        compare_optimizers(model, steps=1, batches=iter([(x, y)]), loss_fn="cross_entropy")
    with pytest.raises(TypeError, match="model must be a GPTConfig, an nn.Module or a function"):
        compare_optimizers(3, steps=1)


@pytest.mark.parametrize("kwargs, match", [
    (dict(mode="ep"), r"mode must be one of \('fsdp', 'hsdp', 'ddp'\), got 'ep'"),
    (dict(mode="hsdp"), r"replicate \(replica groups of build_mesh\) is read in mode 'hsdp' only, and needed there"),
    (dict(replicate=2), r"got replicate=2 with mode 'fsdp'"),
    (dict(steps=0), r"steps must be a whole number >= 1, got 0"),
    (dict(batches=None), r"batches is needed"),
    (dict(loss="nope"), r"unknown loss 'nope'"),
    (dict(batch_size=None), r"batches is a dataset of 256 rows: pass batch_size="),
])
def test_the_worker_refuses_its_arguments_before_any_process_group(kwargs, match):
    from muonlab.experiments.any_model import train_model

    options = dict(model=_mlp(), loss="cross_entropy", batches=_data(), mode="fsdp", steps=1, batch_size=32)
    with pytest.raises(ValueError, match=match):
        train_model(**{**options, **kwargs})


def test_a_global_batch_splits_evenly_over_the_ranks_or_is_refused():
    from muonlab.experiments.any_model import global_slice

    x, y = _data(8)
    assert torch.equal(global_slice((x, y), 1, 2)[0], x[4:]) and torch.equal(global_slice({"y": y}, 0, 4)["y"], y[:2])
    with pytest.raises(ValueError, match=r"a global batch of 8 rows does not split evenly over 3 ranks"):
        global_slice((x, y), 0, 3)


# ---------------------------------------------------------------------------------- figures


def test_loss_curves_take_histories_plain_losses_and_dicts_of_them():
    h = History(steps=[1, 2, 3], train_loss=[3.0, 2.0, 1.5], val_steps=[3], val_loss=[1.7],
                ns_choices=[dict(dtype="bfloat16", form="plain", backend="torch")])
    for runs, labels in (
        (h, ["(bf16, plain, torch) train", "(bf16, plain, torch) val"]),
        ([3.0, 2.5, 2.0], ["train"]),
        ({"a": [3.0, 2.5], "b": (2.0, 1.0, 0.5)}, ["a train", "b train"]),
        ({"muon": h, "plain": [1.0, 0.5]}, ["muon (bf16, plain, torch) train", "muon (bf16, plain, torch) val",
                                            "plain train"]),
    ):
        ax = plot_loss_curves(runs)
        assert [t.get_text() for t in ax.get_legend().get_texts()] == labels
        assert all(float(t).is_integer() for t in ax.get_xticks())  # whole steps, even over 2 or 3
    with pytest.raises(TypeError, match=r"run 'x': expected a History or a sequence of losses, got str"):
        plot_loss_curves({"x": "abc"})
    with pytest.raises(TypeError, match=r"expected a History, a sequence of losses or a mapping"):
        plot_loss_curves(3)
    with pytest.raises(ValueError, match=r"legend must be 'outside', 'inside' or 'none'"):
        plot_loss_curves([1.0], legend="top")


def test_the_legend_sits_clear_of_the_curves():
    ax = plot_loss_curves({"a": [3.0, 2.0, 1.0], "b": [3.0, 2.5, 2.0]})
    fig = ax.figure
    fig.canvas.draw()
    legend, axes = ax.get_legend().get_window_extent(), ax.get_window_extent()
    assert legend.x0 >= axes.x1  # right of the axis, not over the curves
    assert fig.get_window_extent().contains(legend.x1 - 1, legend.y0 + 1)  # and inside the figure


def test_a_diverged_run_is_marked_and_does_not_flatten_the_others():
    steps = list(range(1, 21))
    good = [3.0 - 0.05 * s for s in steps]
    bad = [3.0 - 0.05 * s for s in steps[:10]] + [10.0 ** (s - 8) for s in steps[10:15]] + [math.nan] * 5
    ax = plot_loss_curves({"good": good, "bad": bad})
    low, high = ax.get_ylim()
    assert high < 3.5 and low > 1.5, (low, high)  # the good run's range, not 1e7
    marks = [line for line in ax.lines if line.get_gid() == "muonlab-diverged"]
    assert len(marks) == 1 and marks[0].get_xdata()[0] == 11 and marks[0].get_color() == "C1"
    assert any("diverged at step 11" in t.get_text() for t in ax.texts)
    # a run that is NaN from the start is marked at its first step; a healthy figure has no mark
    ax = plot_loss_curves({"good": good, "nan": [math.nan] * 20})
    assert [line.get_xdata()[0] for line in ax.lines if line.get_gid() == "muonlab-diverged"] == [1]
    ax = plot_loss_curves({"good": good})
    assert not [line for line in ax.lines if line.get_gid() == "muonlab-diverged"] and not ax.texts


def test_robust_ylim_shares_one_range_across_axes_and_redraws_its_marks_once():
    fig, axes = plt.subplots(1, 2)
    axes[0].plot([1, 2, 3], [1.0, 2.0, 3.0])
    axes[1].plot([1, 2, 3], [2.0, 1e9, math.inf])
    assert robust_ylim(axes) == [("", 2.0)]
    robust_ylim(axes)
    assert axes[0].get_ylim() == axes[1].get_ylim() and axes[0].get_ylim()[1] < 4
    assert len([line for line in axes[1].lines if line.get_gid() == "muonlab-diverged"]) == 1


def test_spectral_kinds_keep_the_layers_of_a_sequential_apart():
    assert _kind("blocks.0.mlp.fc.weight") == _kind("blocks.1.mlp.fc.weight") == "blocks.mlp.fc.weight"
    assert _kind("0.weight") == "0.weight" and _kind("2.weight") == "2.weight"
    assert _kind("layers.4.weight") == "layers.4.weight"
    assert _kind("blocks.1.0.weight") == _kind("blocks.0.0.weight") == "blocks.0.weight"


def test_blocks_of_a_kind_are_told_apart_by_line_style():
    from muonlab.trace.spectral import SpectralRecord

    names = ["blocks.0.attn.qkv.weight", "blocks.0.mlp.fc.weight", "blocks.1.attn.qkv.weight", "blocks.1.mlp.fc.weight"]
    records = [SpectralRecord(step=s, name=n, weight_sigma=1.0 + i, update_sigma=0.1, update_rms=0.01, shape=(4, 4))
               for s in (1, 2) for i, n in enumerate(names)]
    ax = plot_spectral_layers(records, "weight_sigma")
    drawn = {line.get_ydata()[0]: (line.get_color(), line.get_linestyle()) for line in ax.lines if len(line.get_xdata())}
    assert drawn[1.0][0] == drawn[3.0][0] != drawn[2.0][0]  # one colour per kind
    assert drawn[1.0][1] == drawn[2.0][1] == "-" and drawn[3.0][1] == drawn[4.0][1] == "--"  # one style per block
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["blocks.attn.qkv.weight", "blocks.mlp.fc.weight",
                                                                   "blocks.0", "blocks.1"]


def test_spectral_figures_name_the_newton_schulz_choice_and_mark_a_diverged_run():
    from muonlab.trace.spectral import SpectralRecord

    def run(values, ns):
        records = [SpectralRecord(step=s, name=n, weight_sigma=v * (1 + i), update_sigma=0.1, update_rms=0.01,
                                  shape=(4, 4)) for s, v in zip((5, 10, 15, 20), values)
                   for i, n in enumerate(("0.weight", "2.weight"))]
        return History(spectral=records, ns_choices=ns)

    muon = run([1.0, 1.1, 1.2, 1.3], [dict(dtype="float32", form="gram", backend="torch")])
    broken = run([1.0, 50.0, math.nan, math.nan], [dict(dtype="bfloat16", form="plain", backend="torch")])
    ax = plot_spectral({"muon": muon, "broken": broken}, "0.weight", "weight_sigma")
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["muon (fp32, gram, torch)",
                                                                   "broken (bf16, plain, torch)"]
    assert ax.get_ylim()[1] < 2 and any("diverged at step 10" in t.get_text() for t in ax.texts)
    assert all(float(t).is_integer() for t in ax.get_xticks())
    panel = SpectralPanel.__new__(SpectralPanel)  # the figure alone, without widgets
    panel.runs = {"muon": muon, "broken": broken}
    fig = panel.figure("all matrices", "weight_sigma")
    axes = fig.axes
    assert axes[0].get_ylim() == axes[1].get_ylim() and axes[0].get_ylim()[1] < 3  # shared, set by "muon"
    assert "Newton-Schulz: fp32, gram, torch" in axes[0].get_title()
    assert sorted(t.get_text() for t in fig.legends[0].get_texts()) == ["0.weight", "2.weight"]


def test_viz_exports_every_plot():
    import muonlab.viz.curves
    import muonlab.viz.planner
    import muonlab.viz.spectral
    import muonlab.viz.timeline
    import muonlab.viz.widgets

    for module in (muonlab.viz.curves, muonlab.viz.planner, muonlab.viz.spectral, muonlab.viz.timeline,
                   muonlab.viz.widgets):
        plots = [n for n in dir(module) if (n.startswith("plot_") or n.endswith("_panel"))
                 and callable(getattr(module, n)) and getattr(module, n).__module__ == module.__name__]
        missing = [n for n in plots if n not in muonlab.viz.__all__]
        assert not missing, (module.__name__, missing)
