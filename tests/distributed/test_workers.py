"""The worker entry points of muonlab.experiments run on gloo CPU workers: train_worker in every
mode, the checkpoint workers' save and resume, and the demo's distributed half. (Their numbers are
checked elsewhere: test_parallelize, test_expert_parallel, test_checkpoint; here, that each entry
point runs under launch() and computes where the device rule says. test_workers_cuda.py is the
same on a GPU.)"""

from __future__ import annotations

import math

import pytest
import torch

from muonlab.launcher import launch
from muonlab.experiments.train import MODES
from tests.distributed import _workers_device as workers


def _on_cpu(res: dict) -> None:
    assert res["device"] == "cpu"
    assert res["devices"] == {"params": ["cpu"], "state": ["cpu"]}


@pytest.mark.timeout(300)
def test_every_worker_runs_on_cpu_workers(tmp_path):
    results = launch(workers.every_worker, 2, str(tmp_path), timeout_s=200)
    for rank, out in results.items():
        for mode in MODES:
            res = out[mode]
            assert (res["rank"], res["world_size"], res["mode"]) == (rank, 2, mode)
            _on_cpu(res)
            assert len(res["losses"]) == workers.TINY["steps"]
            assert all(math.isfinite(x) for x in res["losses"] + res["mean_losses"]), (mode, res["losses"])
            assert res["mean_losses"] == results[0][mode]["mean_losses"]
        saved, resumed = out["saved"], out["resumed"]
        assert saved["devices"] == resumed["devices"] == {"params": ["cpu"], "state": ["cpu"]}
        save_at, steps = workers.CKPT["save_at"], workers.CKPT["steps"]
        assert resumed["step"] == save_at
        for name, p in saved["saved_params"].items():
            assert torch.equal(resumed["loaded_params"][name], p), name
        # the resumed run continues the straight one
        assert resumed["after"] == pytest.approx(saved["straight"][save_at:steps], rel=1e-5)
        assert saved["before"] == pytest.approx(saved["straight"][:save_at], rel=1e-6)


@pytest.mark.timeout(300)
def test_the_demos_distributed_half_runs_on_cpu_workers(tmp_path, capsys):
    from muonlab.demo import run_distributed

    results = run_distributed(tmp_path, steps=1, nprocs=2, timeout_s=200)
    assert sorted(results) == [0, 1]
    for res in results.values():
        _on_cpu(res)
        assert all(math.isfinite(x) for x in res["losses"])
    assert "fsdp on 2 CPU workers" in capsys.readouterr().out
    assert (tmp_path / "timeline.png").stat().st_size > 0
    assert (tmp_path / "trace.json").stat().st_size > 0
