"""The worker entry points of muonlab.experiments and the demo refuse bad arguments by name, before
any training or any worker process starts (one process, no process group)."""

from __future__ import annotations

import pytest

from muonlab import demo
from muonlab.experiments.checkpoint import resume_and_train, train_and_save
from muonlab.experiments.faults import faulty_training
from muonlab.experiments.train import train_worker

# small enough that a call that wrongly got as far as training ends quickly
TINY = dict(d_model=16, n_layers=1, n_heads=2, context=8, batch_per_rank=2, steps=1)


def _never(*args, **kwargs):
    raise AssertionError("started work before refusing its arguments")


@pytest.mark.parametrize("call, param", [
    (lambda out: demo.run(out, nprocs=2, device="gpu"), "device"),
    (lambda out: demo.run(out, nprocs="2"), "nprocs"),
    (lambda out: demo.run(out, steps=0), "steps"),
    (lambda out: demo.run(out, width=6), "width"),
    (lambda out: demo.run(out, layers=0), "layers"),
    (lambda out: demo.run_distributed(out, mode="hsdp"), "mode"),
    (lambda out: demo.run_distributed(out, steps=0), "steps"),
    (lambda out: demo.run_distributed(out, nprocs=0), "nprocs"),
    (lambda out: demo.run_distributed(out, nprocs=3, mode="ep"), "nprocs"),
    (lambda out: demo.run_distributed(out, device="gpu"), "device"),
])
def test_the_demo_refuses_bad_arguments_before_any_training(call, param, tmp_path, monkeypatch):
    monkeypatch.setattr(demo, "run_single", _never)
    monkeypatch.setattr(demo, "launch", _never)
    with pytest.raises(ValueError, match=rf"^{param} must"):
        call(tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kwargs, param", [
    (dict(steps=0), "steps"),
    (dict(steps=-3), "steps"),
    (dict(mode="hsdp"), "mode"),
    (dict(mode="ep", ep=1, num_experts=0), "num_experts"),
    (dict(mode="ep", ep=0), "ep"),
    (dict(batch_per_rank=0), "batch_per_rank"),
    (dict(comm_dtype_name="bf8"), "comm_dtype_name"),
    (dict(ns_dtype_name="fp8"), "ns_dtype_name"),
    (dict(seed="x"), "seed"),
])
def test_train_worker_refuses_bad_arguments_by_name(kwargs, param):
    with pytest.raises(ValueError, match=rf"^{param} must"):
        train_worker(**{**TINY, **kwargs})


@pytest.mark.parametrize("kwargs, message", [
    (dict(steps=-1, save_at=-1), r"^steps must"),
    (dict(steps=2, save_at=5), r"^save_at=5 is past the run's steps=2"),
    (dict(steps=2, save_at=-1), r"^save_at must"),
    (dict(steps=2, save_at=1, width=6), r"^width must be a multiple of 4"),
])
def test_train_and_save_refuses_a_run_that_cannot_be(kwargs, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        train_and_save(str(tmp_path / "ckpt"), **kwargs)
    assert not (tmp_path / "ckpt").exists()


def test_resume_and_train_refuses_steps_that_train_nothing(tmp_path, monkeypatch):
    from muonlab import checkpoint

    with pytest.raises(ValueError, match=r"^steps must"):
        resume_and_train(str(tmp_path), 0, width=16)
    monkeypatch.setattr(checkpoint, "load", lambda *args, **kwargs: 3)  # a checkpoint at step 3
    with pytest.raises(ValueError, match=r"^steps=2 leaves nothing to train: .* at step 3"):
        resume_and_train(str(tmp_path), 2, width=16)


@pytest.mark.parametrize("kwargs, message", [
    (dict(fail_rank=3, fail_step=0, steps=1), r"^fail_rank=3 never comes: this run has ranks 0 to 0"),
    (dict(fail_rank=-1, fail_step=0, steps=1), r"^fail_rank must"),
    (dict(fail_rank=0, fail_step=5, steps=2), r"^fail_step=5 never comes: this run has steps 0 to 1"),
    (dict(fail_rank=0, fail_step=0, steps=0), r"^steps must"),
])
def test_faulty_training_refuses_a_fault_that_never_comes(kwargs, message):
    with pytest.raises(ValueError, match=message):
        faulty_training(**kwargs)


def test_faulty_training_fails_as_asked_in_one_process():
    with pytest.raises(RuntimeError, match="injected fault on rank 0 at step 1"):
        faulty_training(0, 1, steps=2)
