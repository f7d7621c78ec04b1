"""compare(): seeds pair the runs (same start, same batches), a real difference is found and none is
invented, diverged runs are kept out of the statistics, bad input is refused before any run; the
figure and the panel read the result. A tiny GPT, a few steps, one thread (a loaded 2-core machine
runs a 2-thread torch many times slower)."""

from __future__ import annotations

import math

import pytest
import torch

from muonlab.experiments import compare as compare_mod
from muonlab.experiments.compare import Comparison, compare, run_one, summarize
from muonlab.models import GPTConfig

TINY = GPTConfig(d_model=32, n_layers=1, n_heads=2, context=16)
FP32 = dict(ns_dtype="fp32", ns_backend="torch")  # the same Newton-Schulz on every CPU (and on a GPU)


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def lr_result() -> Comparison:
    """Muon at lr 0.02 against a configuration that barely learns, and an identical twin."""
    torch.set_num_threads(1)
    configs = {"lr 0.02": dict(lr=0.02, **FP32), "lr 1e-4": dict(lr=1e-4, adamw_lr=1e-5, **FP32),
               "lr 0.02 again": dict(lr=0.02, **FP32)}
    return compare(configs, model=TINY, seeds=(0, 1, 2), steps=12, progress=False)


def test_one_seed_pairs_start_and_batches_and_seeds_differ(lr_result):
    runs = {(r.config, r.seed): r for c in lr_result.configs.values() for r in c.runs}
    for seed in (0, 1, 2):
        assert len({runs[(name, seed)].init_digest for name in lr_result.configs}) == 1
        assert len({runs[(name, seed)].batch_digest for name in lr_result.configs}) == 1
    assert len({runs[("lr 0.02", s)].init_digest for s in (0, 1, 2)}) == 3
    assert len({runs[("lr 0.02", s)].batch_digest for s in (0, 1, 2)}) == 3
    assert lr_result.paired == {0: True, 1: True, 2: True}
    # the same configuration from the same seed is the same run, to the bit
    assert runs[("lr 0.02", 1)].train_loss == runs[("lr 0.02 again", 1)].train_loss


def test_a_real_difference_is_significant_and_identical_configurations_are_not(lr_result):
    slow = lr_result.difference("lr 1e-4", "lr 0.02")
    assert slow.test == "paired t" and slow.df == 2
    assert slow.difference > 0.1 and slow.significant() and slow.low > 0, slow
    # an A/A comparison: bit-identical runs, no spread to weigh a difference against, undecided;
    # unpaired, the seeds' spread is there and the verdict is "not significant"
    twin = lr_result.difference("lr 0.02 again", "lr 0.02")
    assert twin.difference == 0.0 and twin.verdict() == "undecided" and not twin.significant()
    welch = lr_result.difference("lr 0.02 again", "lr 0.02", test="welch")
    assert welch.test == "Welch t" and welch.p_value == 1.0 and welch.verdict() == "not significant"
    # the tests held by the result: each configuration against the first, on every metric
    assert [(a, b, m) for a, b, m, _ in lr_result.tests] == [
        ("lr 1e-4", "lr 0.02", "final_val_loss"), ("lr 1e-4", "lr 0.02", "steps_to_target"),
        ("lr 1e-4", "lr 0.02", "seconds_to_target"), ("lr 0.02 again", "lr 0.02", "final_val_loss"),
        ("lr 0.02 again", "lr 0.02", "steps_to_target"), ("lr 0.02 again", "lr 0.02", "seconds_to_target")]


def test_summaries_intervals_and_the_table(lr_result):
    fast = lr_result.configs["lr 0.02"]
    finals = [r.final_val_loss for r in fast.runs]
    assert fast.final_val_loss.mean == pytest.approx(sum(finals) / 3)
    assert fast.final_val_loss.low < min(finals) and fast.final_val_loss.high > max(finals)  # t_{.975,2} > 2
    assert fast.steps == list(range(1, 13)) and len(fast.mean) == len(fast.low) == 12
    assert all(lo <= m <= hi for lo, m, hi in zip(fast.low, fast.mean, fast.high))
    # the default target is what the first configuration reached in every seed: the one that barely
    # learns never gets there, and its steps-to-target has no test
    ends = [sum(r.train_loss[-lr_result.window:]) / lr_result.window for r in fast.runs]
    assert lr_result.target == pytest.approx(max(ends)) and fast.reached == 3
    assert lr_result.configs["lr 1e-4"].reached == 0 and lr_result.configs["lr 1e-4"].steps_to_target.n == 0
    assert math.isnan(lr_result.difference("lr 1e-4", "lr 0.02", metric="steps_to_target").p_value)
    # what ran, per plan batch: a float32 Newton-Schulz on torch, recorded and summarized
    assert all(c["dtype"] == "float32" and c["backend"] == "torch" for c in fast.runs[0].choices)
    assert "float32, torch" in fast.choices and fast.choices in fast.label
    table = lr_result.table()
    assert "lr 1e-4 - lr 0.02, final val loss: +" in table and "significant at 0.05" in table
    assert ("lr 0.02 again - lr 0.02, final val loss: +0.000, paired t: undecided (no spread: all 3 pairs "
            "differ by the same amount)") in table
    assert "0/3 reached" in table


def _made_up(finals: dict[str, list[float]], reach: dict[str, list[int]], steps: int = 10) -> Comparison:
    """A comparison of runs made up here: per configuration each seed's final validation loss and
    the step its training loss drops from 3 to 2 (the target)."""
    runs = [compare_mod.Run(config=name, seed=seed, final_val_loss=final, choices=[], init_digest="w",
                            batch_digest=f"batches {seed}", seconds=0.0, step_seconds=[0.5] * steps,
                            train_loss=[3.0 if i + 1 < reach[name][seed] else 2.0 for i in range(steps)])
            for name in finals for seed, final in enumerate(finals[name])]
    configs = {name: FP32 for name in finals}
    return summarize(runs, configs, seeds=range(len(finals["a"])), steps=steps, target=2.0, window=1)


@pytest.mark.parametrize("case", ["no spread", "one seed"])
def test_undecided_is_what_every_verdict_says_without_spread_or_with_one_seed(case, monkeypatch):
    """Every seed giving the same difference (notebook 07's panel at smoke size: steps to target
    -2.0 in both seeds), or a single seed: the table, the HTML, the figure's title and the
    panel's status say "undecided" and why, never "significant"."""
    import matplotlib.pyplot as plt

    from muonlab.viz import compare as viz

    if case == "no spread":  # b's losses 0.1 above a's in both seeds, its target 2 steps later
        result, why = _made_up({"a": [4.0, 4.5], "b": [4.1, 4.6]}, {"a": [5, 7], "b": [7, 9]}), "no spread"
    else:
        result, why = _made_up({"a": [4.0], "b": [4.1]}, {"a": [5], "b": [7]}), "1 pair(s)"
    assert [t.verdict() for _, _, _, t in result.tests] == ["undecided", "undecided", "undecided"]
    table = result.table(seconds=True)
    assert "b - a, final val loss: +0.100, paired t: undecided (" + why in table
    assert "b - a, steps to target: +2.0, paired t: undecided (" + why in table
    # steps of 0.5 s: the seconds follow the steps, 1 s later in every seed
    assert "b - a, seconds to target: +1.000, paired t: undecided (" + why in table
    assert "significant" not in table and "significant" not in viz.comparison_html(result)
    _, ax_finals = viz.plot_comparison(result)
    try:
        title = ax_finals.get_title()
        assert "b - a: +0.100, paired t\nundecided (" + why in title and "significant" not in title
    finally:
        plt.close(ax_finals.figure)
    pytest.importorskip("ipywidgets", reason="panels are ipywidgets (the lab extra)")
    monkeypatch.setattr(viz, "compare", lambda *args, **kwargs: result)
    panel = viz.compare_panel({"a": FP32, "b": FP32}, model=TINY, seeds=2, steps=3)
    assert panel.update() is result
    assert panel.status.value.endswith("; b - a final val loss +0.100, undecided (" + result.tests[0][3].note + ")")
    plt.close("all")


def test_a_diverged_run_is_kept_shown_and_left_out_of_the_statistics():
    configs = {"fine": dict(lr=0.02, **FP32), "wild": dict(lr=0.02, adamw_lr=300.0, **FP32)}
    result = compare(configs, model=TINY, seeds=(0, 1), steps=6, progress=False)
    wild = result.configs["wild"]
    assert wild.diverged_seeds == [0, 1] and len(wild.runs) == 2 and wild.final_val_loss.n == 0
    assert "0,1" in result.table()
    diff = result.difference("wild", "fine")
    assert math.isnan(diff.p_value) and "pair" in diff.note


def test_a_run_that_ends_well_above_its_start_counts_as_diverged():
    run = run_one("x", FP32, model=TINY, seed=0, steps=2)
    run.train_loss = [5.0, 4.0, 6.5]
    assert run.diverged
    run.train_loss = [5.0, float("inf"), 4.0]
    assert run.diverged
    run.train_loss = [5.0, 5.9, 5.3]  # a run that did not learn has not diverged
    assert not run.diverged


def test_summarize_falls_back_to_welch_when_the_runs_were_not_paired(lr_result):
    runs = [r for c in lr_result.configs.values() for r in c.runs]
    runs[0].batch_digest = "a different batch stream"
    configs = {name: c.settings for name, c in lr_result.configs.items()}
    unpaired = summarize(runs, configs, seeds=(0, 1, 2), steps=12)
    assert unpaired.paired[0] is False and unpaired.difference("lr 1e-4", "lr 0.02").test == "Welch t"
    assert "tests are unpaired" in unpaired.table()


@pytest.mark.parametrize("kwargs, match", [
    (dict(configs={"a": dict(lr=0.02, bogus=1)}), "configuration 'a'.*bogus"),
    (dict(configs={"a": dict(optimizer="sgd")}), "configuration 'a': optimizer must be one of"),
    (dict(configs={"a": dict(preset="keller", ns_coefficients="xtuner")}), "both preset and ns_coefficients"),
    (dict(configs={"a": dict(ns_dtype="fp8")}), "ns_dtype 'fp8'"),
    (dict(configs={}), "non-empty dict"),
    (dict(seeds=(0, 0)), "seeds must be distinct"),
    (dict(seeds=3), "sequence of seeds"),
    (dict(seeds=(0, -1)), "each seed"),
    (dict(steps=0), "steps must be"),
    (dict(confidence=1.5), "confidence"),
    (dict(device="cpu"), "give nprocs"),
])
def test_bad_input_is_refused_before_any_run(kwargs, match, monkeypatch):
    ran = []
    monkeypatch.setattr(compare_mod, "run_one", lambda *a, **k: ran.append(a))
    args = dict(configs={"a": dict(lr=0.02)}, model=TINY, seeds=(0, 1), steps=2, progress=False)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        compare(args.pop("configs"), **args)
    assert not ran


def test_a_preset_and_a_named_dtype_reach_the_optimizer():
    run = run_one("p", dict(preset="polar_express", ns_dtype="float32", ns_form="plain"), model=TINY, seed=0,
                  steps=1)
    assert {c["form"] for c in run.choices} == {"plain"} and {c["dtype"] for c in run.choices} == {"float32"}


def test_the_figure_keeps_a_diverged_seed_off_the_axis_and_marks_it():
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    from muonlab.viz import plot_comparison

    configs = {"fine": dict(lr=0.02, **FP32), "wild": dict(lr=0.02, adamw_lr=300.0, **FP32)}
    result = compare(configs, model=TINY, seeds=(0, 1), steps=5, progress=False)
    ax_curves, ax_finals = plot_comparison(result)
    try:
        starts = [r.train_loss[0] for r in result.configs["fine"].runs]
        assert ax_curves.get_ylim()[1] < max(starts) + 0.2  # the diverged runs did not stretch it
        assert isinstance(ax_curves.xaxis.get_major_locator(), MaxNLocator)
        assert all(float(t).is_integer() for t in ax_curves.get_xticks())
        legend = [t.get_text() for t in ax_curves.figure.legends[0].get_texts()]
        assert any(t.startswith("fine (") and "float32" in t for t in legend) and "diverged seed" in legend
        assert "diverged: seeds 0, 1" in [t.get_text() for t in ax_finals.texts]
    finally:
        plt.close(ax_curves.figure)
    with pytest.raises(TypeError, match="Comparison"):
        plot_comparison({"fine": result.configs["fine"]})


def test_the_panel_runs_shows_the_table_and_says_what_failed():
    pytest.importorskip("ipywidgets", reason="panels are ipywidgets (the lab extra)")
    from muonlab.viz import compare_panel

    configs = {"lr 0.02": dict(lr=0.02, **FP32), "lr 1e-4": dict(lr=1e-4, adamw_lr=1e-5, **FP32),
               "unused": dict(lr=0.05, **FP32)}
    panel = compare_panel(configs, model=TINY, seeds=2, steps=3, chosen=["lr 0.02", "lr 1e-4"], progress=False)
    result = panel.update()
    assert isinstance(result, Comparison) and panel.last is result and list(result.configs) == ["lr 0.02", "lr 1e-4"]
    assert result.seeds == [0, 1] and result.steps == 3
    assert panel.table.value.count("<tr>") == 3 and "lr 1e-4 - lr 0.02" in panel.table.value
    assert panel.status.value.startswith("done: 2 configurations x 2 seeds, 3 steps; lr 1e-4 - lr 0.02")
    assert len(panel.output.outputs) == 1 and "image/png" in panel.output.outputs[0]["data"]
    panel.choice.value = ()
    assert panel.update() is None
    assert panel.status.value.startswith("failed: 0 configurations") and panel.table.value == ""
    assert panel.output.outputs == ()
    with pytest.raises(ValueError, match="seeds=9"):
        compare_panel(configs, model=TINY, seeds=9)
    with pytest.raises(ValueError, match="chosen"):
        compare_panel(configs, model=TINY, chosen=["nope"])
