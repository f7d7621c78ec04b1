"""Optimizer state offload (muonlab.optim.offload) in one process: bit-identical steps, what stays
on the device, checkpoints across places, and the errors of the "disk" store."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
from collections import namedtuple

import pytest
import torch

from muonlab import Muon, checkpoint, muon_param_groups
from muonlab.models import GPT, GPTConfig
from muonlab.optim.offload import OffloadError

CFG = dict(d_model=24, n_layers=2, n_heads=2, context=16)
HYPER = dict(lr=0.02, weight_decay=0.01, momentum=0.9, adamw_lr=3e-3)


def build(dtype=torch.float32, **offload):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG)).to(dtype)
    return model, Muon(muon_param_groups(model), **HYPER, **offload)


def train(model, opt, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, 256, (2, CFG["context"]), generator=gen)
        model(x, x).backward()
        opt.step()
        opt.zero_grad()


def snapshot(model, opt):
    names = {p: n for n, p in model.named_parameters()}
    state = {(names[p], k): v.detach().clone() for p, s in opt.state.items() for k, v in s.items()}
    return {n: p.detach().clone() for n, p in model.named_parameters()}, state


def assert_same(a, b):
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            assert x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]), k


def places(tmp_path):
    return {"cpu": dict(state_offload="cpu"),
            "disk": dict(state_offload="disk", offload_dir=str(tmp_path / "disk")),
            "disk_keep_momentum": dict(state_offload="disk", offload_dir=str(tmp_path / "keep"),
                                       keep_muon_momentum_in_memory=True)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("place", ["cpu", "disk", "disk_keep_momentum"])
def test_offloaded_steps_are_bit_identical(tmp_path, place, dtype):
    ref_model, ref_opt = build(dtype)
    train(ref_model, ref_opt, 3)
    model, opt = build(dtype, **places(tmp_path)[place])
    train(model, opt, 3)
    assert_same(snapshot(ref_model, ref_opt), snapshot(model, opt))
    sd = opt.state_dict()["state"]
    # momentum in the parameter's dtype (Muon's default), AdamW moments fp32, offloaded or not
    assert all(v.dtype == (dtype if k == "momentum_buffer" else torch.float32)
               for s in sd.values() for k, v in s.items() if k != "step")


def test_only_the_window_is_on_the_device(tmp_path):
    model, opt = build(**places(tmp_path)["disk"])
    train(model, opt, 2)
    res = opt.state_residency()
    per_param = [sum(v.numel() * 4 for k, v in s.items() if k != "step") for s in opt.state.values()]
    assert res["device_bytes"] == 0 and res["offloaded_bytes"] == sum(per_param)
    # one parameter being updated and the next one being fetched, never more
    assert 0 < res["peak_window_bytes"] <= sum(sorted(per_param)[-2:])
    keep_model, keep = build(**places(tmp_path)["disk_keep_momentum"])
    train(keep_model, keep, 1)
    momentum = sum(s["momentum_buffer"].numel() * 4 for s in keep.state.values() if "momentum_buffer" in s)
    assert keep.state_residency()["device_bytes"] == momentum > 0


def test_nonfinite_skip_leaves_offloaded_state_untouched(tmp_path):
    model, opt = build(**places(tmp_path)["disk"])
    train(model, opt, 2)
    before = snapshot(model, opt)
    x = torch.randint(0, 256, (2, CFG["context"]))
    model(x, x).backward()
    next(model.parameters()).grad[0, 0] = float("nan")
    opt.step()
    assert opt.skipped_steps == 1
    assert_same(before, snapshot(model, opt))


@pytest.mark.parametrize("saved,loaded", [("disk", None), (None, "disk"), ("cpu", "disk"), ("disk", "cpu")])
def test_checkpoint_between_places_resumes_exactly(tmp_path, saved, loaded):
    opts = {None: {}, **places(tmp_path)}
    straight = build()
    train(*straight, 3)
    model, opt = build(**{**opts[saved], **({"offload_dir": str(tmp_path / "s")} if saved == "disk" else {})})
    train(model, opt, 2)
    checkpoint.save(str(tmp_path / "ckpt"), model, opt, 2)
    model, opt = build(**opts[loaded])
    checkpoint.load(str(tmp_path / "ckpt"), model, opt)
    if loaded is not None:  # loaded into the store, not left on the device
        assert opt.state_residency()["device_bytes"] == 0
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randint(0, 256, (2, CFG["context"]), generator=gen) for _ in range(3)]
    model(xs[2], xs[2]).backward()
    opt.step()
    assert_same(snapshot(*straight), snapshot(model, opt))


def test_state_dict_round_trip_and_copies(tmp_path):
    model, opt = build(state_offload="cpu")
    train(model, opt, 2)
    twin = copy.deepcopy(opt)
    assert twin.state_residency()["offloaded_bytes"] == opt.state_residency()["offloaded_bytes"]
    disk_model, disk = build(**places(tmp_path)["disk"])
    disk.load_state_dict(opt.state_dict())
    assert disk.state_residency()["device_bytes"] == 0
    assert_same(snapshot(model, opt)[1:], snapshot(disk_model, disk)[1:])
    with pytest.raises(TypeError, match="can't be copied"):
        copy.deepcopy(disk)
    with pytest.raises(ValueError, match="add_param_group"):
        disk.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3, 3))]})


# ------------------------------------------------------------------ errors, before anything changes


def test_bad_options_are_refused_at_construction(tmp_path):
    with pytest.raises(ValueError, match="unknown state_offload 'gpu'"):
        build(state_offload="gpu")
    with pytest.raises(ValueError, match="needs offload_dir"):
        build(state_offload="disk")
    with pytest.raises(ValueError, match="offload_dir is only used"):
        build(state_offload="cpu", offload_dir=str(tmp_path))
    with pytest.raises(TypeError, match="keep_muon_momentum_in_memory"):
        build(state_offload="cpu", keep_muon_momentum_in_memory="yes")
    with pytest.raises(ValueError, match="keep_muon_momentum_in_memory=True needs state_offload"):
        build(keep_muon_momentum_in_memory=True)


def test_unwritable_offload_dir_is_named(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(OffloadError, match="a_file"):
        build(state_offload="disk", offload_dir=str(blocker / "sub"))


def test_full_disk_is_refused_before_writing(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 1000, 1000))
    with pytest.raises(OffloadError, match="1000 bytes free") as err:
        build(state_offload="disk", offload_dir=str(tmp_path / "full"))
    assert str(tmp_path / "full") in str(err.value)
    assert not (tmp_path / "full" / "muonlab_state_rank0.bin").exists()


def test_a_live_runs_lock_is_refused_and_a_stale_one_taken_over(tmp_path):
    d = tmp_path / "locked"
    d.mkdir()
    lock = d / "muonlab_state_rank0.lock"
    lock.write_text(str(os.getppid()))  # a live process that is not this one
    with pytest.raises(OffloadError, match=f"another live run \\(pid {os.getppid()}"):
        build(state_offload="disk", offload_dir=str(d))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock.write_text(str(dead.pid))
    model, opt = build(state_offload="disk", offload_dir=str(d))
    assert lock.read_text().split()[0] == str(os.getpid())
    with pytest.raises(OffloadError, match="another live run"):  # this run holds it now
        build(state_offload="disk", offload_dir=str(d))


@pytest.mark.parametrize("owner", ["this pid, held by no store of this process", "a live pid started later"])
def test_a_lock_whose_pid_was_reused_is_taken_over(tmp_path, owner):
    """A run killed outright leaves its lock; restarted in a container the new run often gets
    its pid again (pid 1), or another rank alive now does: the lock was refused as a live run's."""
    d = tmp_path / "locked"
    d.mkdir()
    lock = d / "muonlab_state_rank0.lock"
    if owner.startswith("this pid"):
        lock.write_text(str(os.getpid()))  # as a lock of an earlier version reads
    else:
        live_start = open(f"/proc/{os.getppid()}/stat").read().rpartition(")")[2].split()[19]
        lock.write_text(f"{os.getppid()} {int(live_start) + 1}")
    model, opt = build(state_offload="disk", offload_dir=str(d))
    assert lock.read_text().split()[0] == str(os.getpid())


def _stepped_disk(tmp_path):
    model, opt = build(state_offload="disk", offload_dir=str(tmp_path / "d"))
    train(model, opt, 1)
    x = torch.randint(0, 256, (2, CFG["context"]))
    model(x, x).backward()
    return model, opt, tmp_path / "d" / "muonlab_state_rank0.bin"


def test_a_truncated_state_file_is_caught_before_the_step(tmp_path):
    model, opt, path = _stepped_disk(tmp_path)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    size = path.stat().st_size
    os.truncate(path, size // 2)
    with pytest.raises(OffloadError, match="truncated") as err:
        opt.step()
    assert str(path) in str(err.value)
    assert all(torch.equal(params[n], p) for n, p in model.named_parameters())
    os.truncate(path, size)  # nothing touched the mapping, so the run can go on once restored


def test_a_changed_state_file_header_is_caught_before_the_step(tmp_path):
    model, opt, path = _stepped_disk(tmp_path)
    before = snapshot(model, opt)
    with open(path, "r+b") as f:
        f.write(b"NOT-MUONLAB-FILE")
    with pytest.raises(OffloadError, match="header changed") as err:
        opt.step()
    assert str(path) in str(err.value)
    assert_same(before, snapshot(model, opt))


def test_one_file_per_rank_with_a_manifest_holds_the_state(tmp_path):
    import json

    from muonlab.optim.offload import MAGIC

    model, opt = build(**places(tmp_path)["disk"])
    train(model, opt, 2)
    assert sorted(os.listdir(tmp_path / "disk")) == ["muonlab_state_rank0.bin", "muonlab_state_rank0.lock"]
    raw = (tmp_path / "disk" / "muonlab_state_rank0.bin").read_bytes()
    assert raw.startswith(MAGIC)
    start = len(MAGIC) + 16
    length = int.from_bytes(raw[start:start + 8], "little")
    manifest = json.loads(raw[start + 8:start + 8 + length])
    assert manifest["size"] == len(raw)
    names = {n: p for n, p in model.named_parameters()}
    assert {(s["name"], s["key"]) for s in manifest["slots"]} == {
        (n, k) for n, p in names.items() for k in opt.state[p] if k != "step"}
    for slot in manifest["slots"]:
        value = opt.state[names[slot["name"]]][slot["key"]]
        stored = torch.frombuffer(bytearray(raw[slot["offset"]:slot["offset"] + value.numel() * 4]),
                                  dtype=torch.float32).view(value.shape)
        assert torch.equal(stored, value), slot["name"]


def test_the_next_parameters_state_is_fetched_while_one_computes(tmp_path):
    model, opt = build(**places(tmp_path)["disk"])
    train(model, opt, 1)
    store = opt._offload.by_key["exp_avg"]
    params = [p for g in opt.param_groups if g["algorithm"] == "adamw" for p in g["params"]][:3]
    index = {id(p): i for i, p in enumerate(params)}
    fetched, seen = [], []
    real = store._fetch
    store._fetch = lambda p, stored: (fetched.append(index[id(p)]), real(p, stored))[1]
    for i, (m, v) in store.each([(i, p, opt.state[p]) for i, p in enumerate(params)], ("exp_avg", "exp_avg_sq")):
        seen.append(list(fetched))
        assert m.data_ptr() != opt.state[params[i]]["exp_avg"].data_ptr()  # a working copy, not the file
    assert seen == [[0, 1], [0, 1, 2], [0, 1, 2]]


def test_dropping_an_optimizer_releases_its_directory(tmp_path):
    import gc

    model, opt = build(**places(tmp_path)["disk"])
    with pytest.raises(OffloadError, match="this process"):
        build(**places(tmp_path)["disk"])
    del opt
    gc.collect()
    assert not (tmp_path / "disk" / "muonlab_state_rank0.lock").exists()
    build(**places(tmp_path)["disk"])  # the directory is free again


def test_a_disk_too_full_for_the_state_file_is_an_offload_error_when_built(tmp_path, monkeypatch):
    """The file's blocks are claimed when it is made: a sparse file claimed them at the first
    write into its mapping, and a disk filled meanwhile killed the process with SIGBUS."""
    import errno

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OffloadError, match="can't hold the optimizer state file"):
        build(state_offload="disk", offload_dir=str(tmp_path / "d"))
    assert sorted(os.listdir(tmp_path / "d")) == []  # neither the file nor the lock is left
