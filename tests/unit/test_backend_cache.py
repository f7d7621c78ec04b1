"""backend="auto"'s cache of measured choices: where it lives, what its key holds, and that
processes sharing the file keep each other's entries. The measurement itself needs CUDA; a
stand-in answers for it, as in tests/kernels/test_runner.py."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from muonlab.kernels import backend_choice
from muonlab.kernels.config import NSConfig

# A device where both backends can run, so that a choice between them is made: the GPU where there
# is one, else the CPU under Triton's interpreter (set by tests/conftest.py on a CPU-only machine).
# On a GPU machine the CPU has only the torch backend, and would never consult the cache.
CPU = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def measured(tmp_path, monkeypatch):
    """A fresh cache in ``tmp_path``, with a stand-in measurement that records its calls."""
    monkeypatch.setenv("MUONLAB_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(backend_choice, "_memory", {})
    calls = []
    monkeypatch.setattr(backend_choice, "_measure", lambda shape, *a: calls.append(shape) or "triton")
    return calls


def test_a_writer_keeps_what_another_process_wrote_since_it_read_the_file(measured):
    """Two processes (two jobs, or ranks meeting different shapes) measure at once: each read
    the file before the other wrote. The later writer merges the file on disk into its own
    choices; it rewrote the file from its memory alone, dropping the other's entry."""
    cfg = NSConfig()
    backend_choice.faster_backend((4, 64, 128), torch.bfloat16, cfg, CPU)  # the first process writes it
    path = backend_choice.cache_file(CPU)
    backend_choice._memory[path] = {}  # the second process read the file before that write
    backend_choice.faster_backend((4, 64, 256), torch.bfloat16, cfg, CPU)
    on_disk = json.loads(path.read_text())
    assert sorted(k.split("|")[0] for k in on_disk) == ["(4, 64, 128)", "(4, 64, 256)"]
    backend_choice._memory.clear()  # a later process measures neither again
    backend_choice.faster_backend((4, 64, 128), torch.bfloat16, cfg, CPU)
    assert measured == [(4, 64, 128), (4, 64, 256)]


def test_a_choice_another_process_stored_is_not_measured_again(measured):
    """A key missing from the copy read at start is looked up on disk again before measuring."""
    cfg = NSConfig()
    path = backend_choice.cache_file(CPU)
    backend_choice.faster_backend((2, 16, 32), torch.bfloat16, cfg, CPU)
    on_disk = json.loads(path.read_text())
    on_disk[backend_choice._key((2, 16, 48), torch.bfloat16, cfg)] = "torch"  # another process's entry
    path.write_text(json.dumps(on_disk))
    assert backend_choice.faster_backend((2, 16, 48), torch.bfloat16, cfg, CPU) == "torch"
    assert measured == [(2, 16, 32)]


def test_the_cache_file_is_written_under_a_lock_between_processes(measured):
    """While another process holds the sidecar lock (read, merge, replace), a write waits."""
    fcntl = pytest.importorskip("fcntl")
    path = backend_choice.cache_file(CPU)
    path.parent.mkdir(parents=True, exist_ok=True)
    backend_choice._memory[path] = {"k": "torch"}
    with open(path.with_name(path.name + ".lock"), "a") as held:  # a second open file: flock excludes it
        fcntl.flock(held, fcntl.LOCK_EX)
        writer = threading.Thread(target=backend_choice._store, args=(path,))
        writer.start()
        writer.join(timeout=0.3)
        assert writer.is_alive() and not path.exists()
    writer.join(timeout=10)
    assert json.loads(path.read_text()) == {"k": "torch"}


def test_a_failed_write_leaves_no_temporary_file_and_keeps_the_choice(measured, monkeypatch):
    def refused(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(backend_choice.os, "replace", refused)
    assert backend_choice.faster_backend((2, 16, 32), torch.bfloat16, NSConfig(), CPU) == "triton"
    path = backend_choice.cache_file(CPU)
    assert not path.exists() and not list(path.parent.glob("*.tmp"))
    backend_choice.faster_backend((2, 16, 32), torch.bfloat16, NSConfig(), CPU)
    assert len(measured) == 1  # kept in this process's memory


@pytest.mark.parametrize("xdg", ["", "relative/cache"])
def test_an_empty_or_relative_xdg_cache_home_counts_as_unset(xdg, tmp_path, monkeypatch):
    """XDG Base Directory spec: empty means unset, a relative path is invalid and ignored. Taken
    as given, the cache went into whatever directory the process ran in."""
    monkeypatch.delenv("MUONLAB_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", xdg)
    assert backend_choice.cache_dir() == tmp_path / "home" / ".cache" / "muonlab"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert backend_choice.cache_dir() == tmp_path / "xdg" / "muonlab"
    monkeypatch.setenv("MUONLAB_CACHE_DIR", "")  # empty: unset too
    assert backend_choice.cache_dir().is_absolute()


def test_an_fp32_choice_is_keyed_by_the_matmul_precision(measured):
    """The fp32 matmul precision decides whether both backends use TF32 or IEEE products, so a
    choice timed under one is measured again under the other (it was reused, from disk too)."""
    before = torch.get_float32_matmul_precision()
    try:
        for precision in ("highest", "high", "highest"):
            torch.set_float32_matmul_precision(precision)
            backend_choice.faster_backend((4, 32, 64), torch.float32, NSConfig(), CPU)
            backend_choice.faster_backend((4, 32, 64), torch.bfloat16, NSConfig(), CPU)  # bf16: one key for both
    finally:
        torch.set_float32_matmul_precision(before)
    assert measured == [(4, 32, 64)] * 3
    assert sum(k.endswith("|high") for k in json.loads(Path(backend_choice.cache_file(CPU)).read_text())) == 1
