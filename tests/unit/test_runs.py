"""Run records (muonlab.runs): what train and compare keep, a record loaded in a fresh process and
compared against without running its runs again, reruns that give the same losses to the bit, time
to target in wall clock, the plots taking a loaded record. Tiny models, few steps, one thread."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

import muonlab
from muonlab import runs
from muonlab.experiments import compare as compare_mod
from muonlab.experiments.compare import Comparison, compare, summarize
from muonlab.models import GPTConfig
from muonlab.train import default_device

FP32 = dict(ns_dtype="fp32")  # the same Newton-Schulz dtype on every CPU
TINY = GPTConfig(d_model=32, n_layers=1, n_heads=2, context=16)


@pytest.fixture(autouse=True)
def _one_thread_and_a_runs_folder(tmp_path, monkeypatch):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setenv(runs.RUNS_DIR_ENV, str(tmp_path / "runs"))
    yield
    torch.set_num_threads(before)


def _data(rows: int = 256):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 16, generator=g)
    return x, x[:, :4].argmax(dim=1)  # a class a small MLP learns in a few steps


def _mlp(dropout: float = 0.0) -> nn.Sequential:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(dropout), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 4))


def test_a_train_record_keeps_what_ran_and_reruns_to_the_same_losses_bit_for_bit(tmp_path):
    x, y = _data()
    torch.manual_seed(0)
    model = _mlp(dropout=0.2)  # dropout draws from the global RNG: the record must keep its state
    opt = muonlab.Muon(muonlab.muon_param_groups(model), lr=0.02, ns_dtype=torch.float32)
    hist = muonlab.train(model, opt, steps=6, loss_fn="cross_entropy", batches=(x, y), batch_size=32, seed=5,
                         val_batches=(x, y), eval_every=3, progress=False, record="mlp")
    assert hist.record == str(tmp_path / "runs" / "mlp") and [n for n, *_ in runs.list()] == ["mlp"]

    rec = runs.load("mlp")
    assert rec.kind == "train" and rec.seeds == {"batches": 5}
    h = rec.history
    assert (h.train_loss, h.val_steps, h.val_loss, h.step_time_s) == (
        hist.train_loss, [3, 6], hist.val_loss, hist.step_time_s)
    assert rec.config["train"]["steps"] == 6 and rec.config["loss_fn"] == "cross_entropy"
    assert rec.config["batches"]["kind"] == "dataset" and rec.config["batches"]["kept"]
    assert rec.config["optimizer"]["options"]["ns_dtype"] == {"__dtype__": "float32"}
    prov = rec.provenance
    assert prov["torch"] == torch.__version__ and prov["threads"] == 1
    assert prov["device"] == str(default_device())  # cuda:0 on a GPU machine
    package = os.path.dirname(muonlab.__file__)
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=package)
    tracked = subprocess.run(["git", "ls-files", "--error-unmatch", "__init__.py"], capture_output=True, cwd=package)
    if head.returncode == 0 and tracked.returncode == 0:  # a checkout of muonlab (not a copy inside another's)
        assert prov["git"]["commit"] == head.stdout.strip()

    torch.manual_seed(123)  # another global RNG state: the rerun starts from the kept one
    torch.set_num_threads(2)  # and another thread count: the rerun takes the record's
    again = rec.rerun()
    assert torch.get_num_threads() == 2
    assert again.train_loss == hist.train_loss and again.val_loss == hist.val_loss
    assert again.record is None  # a rerun keeps no record of its own


def test_record_false_keeps_none_and_a_bad_name_is_refused_before_training(tmp_path):
    x, y = _data(64)
    model = _mlp()
    opt = muonlab.Muon(muonlab.muon_param_groups(model), lr=0.02)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="record must be True .* or a folder name"):
        muonlab.train(model, opt, steps=1, loss_fn="cross_entropy", batches=(x, y), batch_size=8, record="../up")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    hist = muonlab.train(model, opt, steps=1, loss_fn="cross_entropy", batches=(x, y), batch_size=8, progress=False,
                         record=False)
    assert hist.record is None and runs.list() == []
    hist = muonlab.train(model, opt, steps=1, loss_fn="cross_entropy", batches=(x, y), batch_size=8, progress=False)
    assert os.path.basename(hist.record).startswith("train-") and len(runs.list()) == 1
    with pytest.raises(ValueError, match="no record 'nope'"):
        runs.load("nope")


def test_compare_optimizers_keeps_a_record_per_optimizer_under_the_name_given():
    x, y = _data(64)
    out = muonlab.compare_optimizers(_mlp(), steps=1, loss_fn="cross_entropy", batches=(x, y), batch_size=8,
                                     progress=False, record="pair")
    assert sorted(n for n, *_ in runs.list()) == ["pair-adamw", "pair-muon"]
    assert runs.load("pair-adamw").history.train_loss == out["adamw"].train_loss


RESEARCHER = """\
from muonlab import runs
from muonlab.experiments.compare import compare

saved = runs.load("saved")
result = compare({"lr 0.05": dict(lr=0.05, ns_dtype="fp32")}, against=saved, progress=False)
print(result.table(seconds=True))
"""


def test_save_a_comparison_load_it_in_a_fresh_process_and_compare_against_it(tmp_path):
    """The research loop: a comparison saved here, loaded in a new Python process, one configuration
    added and compared against the saved runs, which do not run again."""
    x, y = _data()
    first = compare({"muon": dict(lr=0.02, **FP32)}, model=_mlp(), batches=(x, y), batch_size=32,
                    loss_fn="cross_entropy", val_batches=(x, y), seeds=(0, 1, 2), steps=8, progress=False,
                    record="saved")
    assert first.record == str(tmp_path / "runs" / "saved")
    assert len(RESEARCHER.strip().splitlines()) <= 8
    checks = """
        import json
        print(json.dumps(dict(configs=list(result.configs), paired=list(result.paired.values()), record=result.record,
                              muon=[(r.seed, r.seconds, r.train_loss) for r in result.configs["muon"].runs])))
    """
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", RESEARCHER + textwrap.dedent(checks)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    table, facts = out.stdout.rsplit("\n", 2)[0], json.loads(out.stdout.rsplit("\n", 2)[1])
    assert facts["configs"] == ["muon", "lr 0.05"]
    # the saved runs as they were (a rerun would have taken other seconds), paired with the new ones
    # by seed: the fresh process built the same initial model and drew the same batches
    assert facts["muon"] == [[r.seed, r.seconds, r.train_loss] for r in first.configs["muon"].runs]
    assert facts["paired"] == [True, True, True]
    assert "lr 0.05 - muon, seconds to target:" in table and "lr 0.05 - muon, final val loss:" in table
    both = runs.load(os.path.basename(facts["record"]))  # the new record holds the saved runs and the new
    assert list(both.comparison.configs) == ["muon", "lr 0.05"]


def test_normuon_against_muon_on_a_sequential_of_your_own_by_time_to_target():
    x, y = _data()
    # what a researcher writes (8 lines at most)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    result = compare({"muon": dict(lr=0.02), "normuon": dict(lr=0.02, update_rule="normuon")}, model=model,
                     batches=(x, y), batch_size=32, loss_fn="cross_entropy", steps=12, progress=False)
    table = result.table(seconds=True)
    # the seconds are the runs' own step times up to the step that reached the target
    muon = result.configs["muon"]
    assert muon.reached == 3 and muon.seconds_to_target.n == 3
    by_hand = [sum(r.step_seconds[:s]) for r, s in
               ((r, compare_mod._first_at_or_below(compare_mod._smoothed(r.train_loss, result.window), result.target))
                for r in muon.runs)]
    assert muon.seconds_to_target.mean == pytest.approx(sum(by_hand) / 3, rel=1e-12)
    assert muon.seconds_to_target.low < muon.seconds_to_target.mean < muon.seconds_to_target.high
    assert f"seconds to {result.target:.3f} (95% CI)" in table.splitlines()[0]
    assert "normuon - muon, seconds to target:" in table and "normuon - muon, steps to target:" in table
    # no validation source: no final validation loss and no test of it
    assert muon.final_val_loss.n == 0 and all(m != "final_val_loss" for _, _, m, _ in result.tests)
    assert "seconds" not in result.table()  # the default table is as before


def test_one_seed_leaves_time_to_target_undecided():
    x, y = _data(64)
    result = compare({"a": dict(lr=0.02, **FP32), "b": dict(lr=0.03, **FP32)}, model=_mlp, batches=(x, y),
                     batch_size=16, loss_fn="cross_entropy", seeds=(0,), steps=4, progress=False, record=False)
    seconds = result.difference("b", "a", metric="seconds_to_target")
    assert seconds.verdict() == "undecided" and "1 pair(s)" in seconds.note
    table = result.table(seconds=True)
    assert f"{result.configs['b'].seconds_to_target.mean:.3f} (1 run)" in table
    assert f"b - a, seconds to target: {seconds.difference:+.3f}, paired t: undecided (1 pair(s)" in table
    assert result.record is None


def test_a_gpt_comparison_record_reruns_to_the_same_losses_and_the_figure_takes_it():
    import matplotlib.pyplot as plt

    from muonlab.viz import plot_comparison

    result = compare({"a": dict(lr=0.02, **FP32), "b": dict(lr=0.01, **FP32)}, model=TINY, seeds=(0, 1), steps=3,
                     progress=False, record="gpt")
    rec = runs.load("gpt")
    assert rec.config["model"] == {"kind": "gpt", "config": {k: getattr(TINY, k) for k in rec.config["model"]["config"]}}
    assert rec.comparison.table(seconds=True) == result.table(seconds=True)
    again = rec.rerun()
    assert [r.train_loss for c in again.configs.values() for r in c.runs] == \
        [r.train_loss for c in result.configs.values() for r in c.runs]
    ax_curves, _ = plot_comparison(rec)
    try:
        assert len(ax_curves.lines) >= 4  # a line per seed and the means
    finally:
        plt.close(ax_curves.figure)


def test_loss_curves_take_a_loaded_record_beside_a_live_history():
    import matplotlib.pyplot as plt

    from muonlab.viz import plot_loss_curves

    x, y = _data(64)
    model = _mlp()
    opt = muonlab.Muon(muonlab.muon_param_groups(model), lr=0.02)
    hist = muonlab.train(model, opt, steps=3, loss_fn="cross_entropy", batches=(x, y), batch_size=8, progress=False)
    saved = runs.load(os.path.basename(hist.record))
    ax = plot_loss_curves({"saved": saved, "live": hist})
    try:
        lines = {line.get_label().split(" (")[0]: list(line.get_ydata()) for line in ax.lines}
        assert lines["saved"] == lines["live"] == hist.train_loss
    finally:
        plt.close(ax.figure)
    compared = compare({"a": FP32}, model=TINY, seeds=(0,), steps=1, progress=False)
    with pytest.raises(TypeError, match="plot it with plot_comparison"):
        plot_loss_curves(runs.load(os.path.basename(compared.record)))


def _saved_comparison(steps: int = 4, seeds=(0, 1)) -> Comparison:
    made = [compare_mod.Run(config="saved", seed=s, train_loss=[3.0, 2.0, 2.0, 2.0][:steps], final_val_loss=2.0,
                            choices=[], init_digest="w", batch_digest=f"b{s}", seconds=1.0) for s in seeds]
    return summarize(made, {"saved": FP32}, seeds=seeds, steps=steps)


@pytest.mark.parametrize("kwargs, match", [
    (dict(configs={"saved": FP32}), "'saved' is both saved and in configs"),
    (dict(steps=3), "a saved comparison ran 4 steps, these runs 3"),
    (dict(seeds=(0, 1, 2)), r"ran seeds \[0, 1\], these seeds \[0, 1, 2\]"),
    (dict(against="saved"), "against must be a saved comparison"),
    (dict(batch_size=8), r"\['batch_size'\] are read with batches="),
    (dict(record=""), "record must be"),
])
def test_against_and_new_arguments_are_checked_before_any_run(kwargs, match, monkeypatch):
    ran = []
    monkeypatch.setattr(compare_mod, "run_one", lambda *a, **k: ran.append(a))
    args = dict(configs={"new": FP32}, model=TINY, against=_saved_comparison(), progress=False)
    args.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=match):
        compare(args.pop("configs"), **args)
    assert not ran


def test_tensorboard_export_where_the_package_is_installed(tmp_path):
    pytest.importorskip("tensorboard", reason="TensorBoard export is optional (pip install tensorboard)")
    x, y = _data(64)
    model = _mlp()
    opt = muonlab.Muon(muonlab.muon_param_groups(model), lr=0.02)
    hist = muonlab.train(model, opt, steps=2, loss_fn="cross_entropy", batches=(x, y), batch_size=8, progress=False)
    logdir = runs.export_tensorboard(runs.load(os.path.basename(hist.record)))
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(logdir))
