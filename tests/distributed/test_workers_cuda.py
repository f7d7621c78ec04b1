"""The worker entry points on a GPU: 1-rank NCCL runs started exactly as a notebook does, with no
device argument, so the rule of muonlab/distributed/device.py puts the rank on cuda:0.

Skipped without CUDA. On a GPU node (the image needs torch, pytest, matplotlib, tqdm; not
ipywidgets or nbval)::

    PYTHONPATH=$PWD python3 -m pytest tests/distributed/test_workers_cuda.py
"""

from __future__ import annotations

import math

import pytest
import torch

from muonlab.launcher import launch
from muonlab.experiments.checkpoint import resume_and_train, train_and_save
from muonlab.experiments.train import train_worker
from tests.distributed import _workers_device as workers

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU: 1-rank NCCL runs of the workers on cuda:0"),
    pytest.mark.auto_device,  # the machine's own rule, not tests/distributed's CPU pin
    pytest.mark.cold_launch,  # each run in new processes, as measured on the GPU machines so far
]

ON_GPU = {"params": ["cuda:0"], "state": ["cuda:0"]}
MODEL = dict(steps=3, d_model=64, n_layers=2, n_heads=4, context=64, batch_per_rank=4)
# start-up (importing torch, CUDA and NCCL initialisation) has its own clock; runs are seconds
LIMITS = dict(timeout_s=300, startup_timeout_s=300)


@pytest.mark.timeout(700)
@pytest.mark.parametrize("mode", ["fsdp", "ddp", "ep"])
def test_train_worker_runs_on_cuda0_with_nccl(mode):
    extra = dict(ep=1, num_experts=4) if mode == "ep" else {}
    res = launch(train_worker, 1, mode=mode, **MODEL, **extra, **LIMITS)[0]
    assert res["device"] == "cuda:0"
    assert res["devices"] == ON_GPU
    assert len(res["losses"]) == MODEL["steps"]
    assert all(math.isfinite(x) for x in res["losses"] + res["mean_losses"]), res["losses"]


@pytest.mark.timeout(700)
def test_checkpoint_save_and_resume_on_cuda0(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = launch(train_and_save, 1, path, 4, 2, **LIMITS)[0]
    resumed = launch(resume_and_train, 1, path, 4, **LIMITS)[0]
    assert saved["devices"] == resumed["devices"] == ON_GPU
    assert resumed["step"] == 2
    for name, p in saved["saved_params"].items():
        assert p.device.type == "cpu"  # handed back as plain data
        assert torch.equal(resumed["loaded_params"][name], p), name
    losses = saved["straight"] + saved["before"] + resumed["after"]
    assert all(math.isfinite(x) for x in losses), losses
    # GPU kernels may sum in another order from run to run: close, not bit-equal
    assert resumed["after"] == pytest.approx(saved["straight"][2:], rel=1e-3)


@pytest.mark.timeout(700)
def test_nccl_rank_collectives_and_errors():
    info = launch(workers.device_info, 1, **LIMITS)[0]
    assert (info["backend"], info["rank_device"], info["collective_device"], info["model_device"]) \
        == ("nccl", "cuda:0", "cuda:0", "cuda:0")
    assert launch(workers.nonfinite_over_the_group, 1, **LIMITS)[0] == dict(skipped=True, ranks=[0], unchanged=True)
    message = launch(workers.ddp_of_a_cpu_model, 1, **LIMITS)[0]
    assert message.startswith("rank 0: apply_ddp over an NCCL group needs the model on this rank's GPU, "
                               "but parameter 'weight' is on the CPU"), message


@pytest.mark.timeout(300)
def test_cpu_workers_on_a_gpu_node_when_asked():
    info = launch(workers.device_info, 1, device="cpu", **LIMITS)[0]
    assert (info["backend"], info["rank_device"], info["model_device"]) == ("gloo", "cpu", "cpu")
