"""The researcher's task 3 of issue 32: a 2-rank run of their own model from a notebook cell, with
no module of their own (``muonlab.experiments.any_model.train_model``), its loss curve and its
timeline; and the same worker with an importable factory, a callable batch source and HSDP,
equal to one process in fp32."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from muonlab import Muon, muon_param_groups, train  # noqa: E402
from muonlab.launcher import launch  # noqa: E402
from muonlab.experiments.any_model import train_model  # noqa: E402

from . import _workers_any_model as W  # noqa: E402

FP32 = dict(ns_dtype=torch.float32, comm_dtype=torch.float32)


def _one_process(steps: int, **kwargs) -> list[float]:
    torch.manual_seed(0)
    model = W.build_mlp()
    opt = Muon(muon_param_groups(model), lr=0.02, **kwargs.pop("muon", {}))
    return train(model, opt, steps=steps, loss_fn="cross_entropy", progress=False, **kwargs).train_loss


@pytest.mark.timeout(300)
def test_task3_two_ranks_of_your_own_model_from_a_cell_in_ten_lines():
    # ---- the cell: 10 lines, the imports and the data included, no module of the researcher's own
    import torch.nn as nn

    from muonlab.launcher import launch
    from muonlab.experiments.any_model import train_model
    from muonlab.viz import plot_loss_curves, plot_timeline
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    x, y = W.dataset()  # the researcher's tensors
    out = launch(train_model, 2, model, "cross_entropy", (x, y), mode="fsdp", steps=6, batch_size=32, timeout_s=240)
    ax_loss = plot_loss_curves({"fsdp, 2 ranks": out[0]["history"]})
    ax_time = plot_timeline(out[0]["step_spans"], steps=3, choices=out[0]["ns_choices"], clock=out[0]["span_clock"])
    # ---- what it gave
    assert set(out) == {0, 1}
    assert out[0]["mean_losses"] == out[1]["mean_losses"] == out[0]["history"].train_loss
    assert out[0]["units"] == ["0", "2", "4"]  # the Sequential's Linear layers, found by parallelize
    assert {s["rank"] for s in out[0]["spans"]} == {0, 1} and out[1]["spans"] is None
    assert {s["step"] for s in out[0]["step_spans"]} == set(range(1, 7)) and out[1]["step_spans"] is None
    assert {s["rank"] for s in out[0]["step_spans"]} == {0, 1} and out[0]["span_clock"] == "host"
    assert {c["path"] for c in out[0]["ns_choices"]} == {"all_to_all"}
    # the one-process run on the same global batches: the wire carries what Newton-Schulz computes
    # in (comm_dtype "auto"), so only the gradient reduction's rounding is left (9e-8 measured after
    # 6 steps on CPUs with and without native bf16; 6e-6 with a bf16 wire)
    reference = _one_process(6, batches=(x, y), batch_size=32)
    assert out[0]["mean_losses"] == pytest.approx(reference, rel=1e-6)
    assert sum(out[0]["mean_losses"][-2:]) < sum(out[0]["mean_losses"][:2])
    label = ax_loss.get_legend().get_texts()[0].get_text()
    assert label.startswith("fsdp, 2 ranks (") and label.endswith(", torch) train"), label
    assert "3 optimizer steps" in ax_time.get_title() and "Newton-Schulz" in ax_time.get_title()
    plt.close("all")


@pytest.mark.timeout(300)
def test_train_model_with_a_factory_a_callable_source_and_hsdp_equals_one_process_in_fp32():
    out = launch(train_model, 2, W.build_mlp, "cross_entropy", W.batch_at, mode="hsdp", replicate=2, steps=4,
                 muon_kwargs=FP32, timeout_s=240, progress=False)
    reference = _one_process(4, batches=W.batch_at, muon=FP32)
    for rank in (0, 1):
        assert out[rank]["mean_losses"] == pytest.approx(reference, rel=1e-5), rank
        # each rank's own slice: 8 of the 16 rows, its loss not the global one
        assert out[rank]["history"].tokens_per_step == 16
    assert out[0]["losses"] != out[1]["losses"]
    assert out[0]["units"] == ["0", "2", "4"]
