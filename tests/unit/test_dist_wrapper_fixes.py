"""The distributed wrappers' fixes that need no process group: the rank-device rule on plain values
(and rank_device reading a bound group), mesh size checks, parallelize's refusals before it moves the
model, train_worker's num_experts, and History.opt_step_ms."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from muonlab.distributed import parallelize
from muonlab.distributed.device import group_device, rank_device
from muonlab.distributed.mesh import _check_size
from muonlab.experiments.train import train_worker
from muonlab.models import GPT, GPTConfig
from muonlab.train import History

# the module, not the function muonlab.distributed re-exports under the same name
parallelize_module = importlib.import_module("muonlab.distributed.parallelize")
CUDA1 = torch.device("cuda", 1)


@pytest.mark.parametrize("backend, bound, cuda_available, current, expected", [
    # launch(device="cuda", backend="gloo"): the group is bound to the GPU asked for; the backend
    # overrides the backend only, so the rank computes there
    ("gloo", CUDA1, True, 0, CUDA1),
    ("nccl", CUDA1, True, 0, CUDA1),
    # NCCL without a bound device (a user's group under torchrun): the current CUDA device
    ("nccl", None, True, 3, torch.device("cuda", 3)),
    ("cpu:gloo,cuda:nccl", None, True, 2, torch.device("cuda", 2)),
    # gloo started for CPU workers, on a GPU node or not
    ("gloo", None, True, 0, torch.device("cpu")),
    ("gloo", None, False, None, torch.device("cpu")),
    ("gloo", torch.device("cpu"), True, 0, torch.device("cpu")),
])
def test_the_rank_device_follows_the_bound_device_whatever_the_backend(backend, bound, cuda_available, current,
                                                                       expected):
    assert group_device(backend, bound, cuda_available, current) == expected


def test_rank_device_of_a_gloo_group_bound_to_a_gpu_is_that_gpu(monkeypatch):
    # what init_process_group leaves behind for launch(device="cuda", backend="gloo"), faked on the CPU
    class Group:
        bound_device_id = CUDA1

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_group", lambda: Group())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert rank_device() == CUDA1
    Group.bound_device_id = None  # no bound device: a gloo group wants CPU tensors, as before
    assert rank_device() == torch.device("cpu")


@pytest.mark.parametrize("value, expected", [(1, 1), (np.int64(2), 2), (np.int32(4), 4), (torch.tensor(3), 3)])
def test_mesh_sizes_accept_what_check_whole_accepts(value, expected):
    got = _check_size("ep", value)
    assert got == expected and type(got) is int


@pytest.mark.parametrize("value", [None, 0, -1, 2.0, True, "2", np.float64(2.0)])
def test_mesh_sizes_refuse_the_rest_by_name(value):
    with pytest.raises(ValueError, match=r"^ep must be a positive int"):
        _check_size("ep", value)


def _never(model):
    raise AssertionError("parallelize moved the model before refusing the call")


@pytest.mark.parametrize("kwargs, message", [
    (dict(mode="ddp", block_attr="blocks"), r"^block_attr is read in 'fsdp', 'hsdp' and 'ep' modes only"),
    (dict(mode="ddp", reshard_after_forward=True), r"^reshard_after_forward is read in 'fsdp', 'hsdp' and 'ep'"),
    (dict(mode="hsdp"), r"^mode 'hsdp' needs a 2-D mesh"),
])
def test_parallelize_refuses_before_moving_the_model(kwargs, message, monkeypatch):
    monkeypatch.setattr(parallelize_module, "to_rank_device", _never)
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=message):
        parallelize(GPT(GPTConfig(d_model=16, n_layers=1, n_heads=2, context=8)), **kwargs)


def test_parallelize_refuses_a_ddp_wrapped_model(monkeypatch):
    monkeypatch.setattr(parallelize_module, "to_rank_device", _never)
    # a DDP wrapper without a process group: only its type matters to the check
    wrapped = nn.parallel.DistributedDataParallel.__new__(nn.parallel.DistributedDataParallel)
    nn.Module.__init__(wrapped)
    with pytest.raises(ValueError, match=r"^parallelize\(mode 'ddp'\) got a model that is already wrapped in "
                                         r"DistributedDataParallel"):
        parallelize(wrapped, "ddp")


@pytest.mark.parametrize("num_experts", [1, np.int64(1)])
def test_train_worker_needs_two_experts_for_top_2_routing(num_experts):
    with pytest.raises(ValueError, match=r"^num_experts must be >= 2 in 'ep' mode: each token is routed to top_k=2"):
        train_worker("ep", ep=1, num_experts=num_experts, steps=1, d_model=16, n_layers=1, n_heads=2, context=8,
                     batch_per_rank=1)


@pytest.mark.parametrize("times, expected_ms", [
    ([0.500, 0.010], 10.0),  # the first step allocates state: not the step's cost
    ([0.500, 0.010, 0.011, 0.012], 11.0),  # the median of the later steps
    ([0.500, 0.010, 0.014], 12.0),  # an even number of later steps: the mean of the middle two
    ([0.200], 200.0),  # one step is all there is
    ([], 0.0),
])
def test_opt_step_ms_is_the_median_of_the_steps_after_the_first(times, expected_ms):
    assert History(opt_time_s=times).opt_step_ms == pytest.approx(expected_ms)
