"""A launched run's record (muonlab.runs): train_model on 2 ranks keeps its record in the launch's
own folder (rank 0 writes it), which loads, plots and launches again to the same losses."""

import os

import pytest
import torch

from muonlab import runs
from muonlab.launcher import launch
from muonlab.experiments.any_model import train_model

from . import _workers_any_model as W


@pytest.mark.timeout(300)
def test_a_train_model_record_sits_in_its_launch_folder_and_reruns_to_the_same_losses():
    torch.manual_seed(0)
    model = W.build_mlp()
    x, y = W.dataset()
    out = launch(train_model, 2, model, "cross_entropy", (x, y), mode="fsdp", steps=4, batch_size=32, name="mlp",
                 timeout_s=240)
    folder = os.path.join(runs.runs_dir(), "mlp")
    assert out[0]["record"] == out[0]["history"].record == os.path.abspath(folder) and out[1]["record"] is None
    assert {"record.json", "initial.pt", "data.pt", "launch.json", "rank0", "rank1"} <= set(os.listdir(folder))
    rec = runs.load("mlp")
    assert rec.kind == "train_model" and rec.config["train_model"]["world_size"] == 2
    assert rec.history.train_loss == out[0]["mean_losses"] and rec.plan_table == out[0]["plan_table"]
    again = rec.rerun(timeout_s=240)  # the kept initial model, batches and arguments, on 2 ranks again
    assert again.train_loss == out[0]["mean_losses"]


@pytest.mark.timeout(300)
def test_a_train_worker_record_keeps_the_mean_losses_and_reruns_to_them():
    from muonlab.experiments.train import train_worker

    kwargs = dict(mode="fsdp", steps=3, d_model=32, n_layers=1, n_heads=2, context=16, batch_per_rank=2,
                  ns_dtype_name="fp32")
    out = launch(train_worker, 2, **kwargs, name="gpt", timeout_s=240)
    rec = runs.load("gpt")
    assert out[0]["record"] == os.path.abspath(rec.path) and out[1]["record"] is None
    assert rec.kind == "train_worker" and rec.config["train_worker"]["ns_dtype_name"] == "fp32"
    assert rec.history.train_loss == out[0]["mean_losses"] and rec.history.opt_time_s == out[0]["step_seconds"]
    assert rec.history.tokens_per_step == 2 * 2 * 16 and rec.plan_table == out[0]["plan_table"]
    assert rec.rerun(timeout_s=240).train_loss == out[0]["mean_losses"]
