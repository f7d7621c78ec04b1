"""The device rule (muonlab/distributed/device.py): the pure choice with and without CUDA, and real
gloo workers launched by it."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from muonlab.launcher import launch
from muonlab.distributed.device import DEVICE_ENV, backend_for, choose_device
from tests.distributed import _workers_device as workers

pytestmark = pytest.mark.cold_launch  # the processes a launch starts


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this process sees ``n`` CUDA devices (0: none); the choice reads only these two."""
    def pretend(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return pretend


def test_without_cuda_every_rank_is_on_the_cpu(gpus, monkeypatch):
    gpus(0)
    monkeypatch.delenv(DEVICE_ENV, raising=False)
    assert choose_device(local_rank=3, local_world_size=4) == torch.device("cpu")
    assert choose_device("cpu") == torch.device("cpu")
    with pytest.raises(RuntimeError, match="local rank 1: device 'cuda' was asked for, but CUDA is not available"):
        choose_device("cuda", local_rank=1, local_world_size=2)


def test_with_a_gpu_per_rank_rank_r_is_on_cuda_local_rank(gpus, monkeypatch):
    gpus(8)
    monkeypatch.delenv(DEVICE_ENV, raising=False)
    assert choose_device(local_rank=5, local_world_size=8) == torch.device("cuda", 5)
    assert choose_device("cuda", local_rank=0, local_world_size=1) == torch.device("cuda", 0)
    # the launcher's variables, as torchrun and elastic_launch set them
    monkeypatch.setenv("LOCAL_RANK", "7")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert choose_device() == torch.device("cuda", 7)
    assert backend_for(choose_device()) == "nccl"
    assert backend_for(torch.device("cpu")) == "gloo"


def test_an_explicit_choice_overrides_the_rule(gpus, monkeypatch):
    gpus(8)
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    assert choose_device(local_rank=2, local_world_size=8) == torch.device("cpu")
    # the argument beats the environment
    assert choose_device("cuda", local_rank=2, local_world_size=8) == torch.device("cuda", 2)
    assert choose_device("auto", local_rank=2, local_world_size=8) == torch.device("cuda", 2)
    monkeypatch.setenv(DEVICE_ENV, "gpu")
    with pytest.raises(ValueError, match=r"\$MUONLAB_DEVICE must be one of \('auto', 'cpu', 'cuda'\), got 'gpu'"):
        choose_device()
    with pytest.raises(ValueError, match=r"^device must be one of"):
        choose_device("tpu")


def test_too_few_gpus_falls_back_to_the_cpu_with_a_warning_or_refuses_cuda(gpus, monkeypatch):
    gpus(2)
    monkeypatch.delenv(DEVICE_ENV, raising=False)
    with pytest.warns(RuntimeWarning, match="4 ranks on this node but 2 CUDA device"):
        assert choose_device(local_rank=0, local_world_size=4) == torch.device("cpu")
    with pytest.raises(ValueError, match="local rank 3 of 4 on this node: device 'cuda' needs one GPU per rank, "
                                         "but CUDA has 2"):
        choose_device("cuda", local_rank=3, local_world_size=4)


@pytest.mark.timeout(30)
def test_launch_refuses_a_device_it_cannot_give_before_starting(launches_started):
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match="device must be one of"):
        launch(workers.device_info, 2, device="gpu")
    with pytest.raises(ValueError, match="rank 0: backend 'nccl' needs a CUDA device, but this rank's device is cpu"):
        launch(workers.device_info, 2, device="cpu", backend="nccl")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="device 'cuda' was asked for, but CUDA is not available"):
            launch(workers.device_info, 2, device="cuda")
    assert launches_started == []
    assert [p for p in multiprocessing.active_children() if p not in before] == []


@pytest.mark.timeout(240)
@pytest.mark.auto_device
def test_launched_workers_follow_the_rule_on_this_machine(monkeypatch):
    # auto_device: no pin, so this is the rule a researcher gets by default (here: no GPU)
    expected = "cuda" if torch.cuda.device_count() >= 2 else "cpu"
    results = launch(workers.device_info, 2, timeout_s=120)
    for rank, info in results.items():
        assert info["rank"] == rank
        assert info["world_sum"] == 2.0
        device = f"cuda:{rank}" if expected == "cuda" else "cpu"
        assert (info["backend"], info["rank_device"], info["model_device"]) == (backend_for(expected), device, device)
    # and the override, as a researcher on a GPU node would ask for CPU workers
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    for info in launch(workers.device_info, 2, timeout_s=120).values():
        assert (info["backend"], info["rank_device"], info["collective_device"], info["model_device"], info["env"]) \
            == ("gloo", "cpu", "cpu", "cpu", "cpu")
