"""launch(): real worker processes over gloo on CPU.

Each launch costs seconds of process start-up on a 2-core machine, so one launch checks several
things: the launches after a failure double as the 1-process value checks, and the 4-process one
shares test_mesh.py's launch.
"""

from __future__ import annotations

import importlib
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest

from muonlab.launcher import WorkerError, WorkerTimeout, launch
from tests._proc import alive, children, cmdline
from tests.distributed import _workers_launch as workers

pytestmark = pytest.mark.cold_launch  # the launcher itself


def _assert_gone(pids) -> None:
    """No process with these pids exists (zombies would still answer kill(pid, 0))."""
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def _new_children(before) -> list:
    return [p for p in multiprocessing.active_children() if p not in before]


def _check_rank_info(results, num_procs, args=(), kwargs=None) -> None:
    assert sorted(results) == list(range(num_procs))
    for rank, info in results.items():
        assert info["rank"] == rank
        assert info["world_size"] == num_procs
        assert info["rank_sum"] == sum(range(num_procs))
        assert info["args"] == tuple(args)
        assert info["kwargs"] == (kwargs or {})
        assert info["num_threads"] == 1
        assert info["backend"] == "gloo"
    _assert_gone(info["pid"] for info in results.values())


def _undefined_in_main():  # pretend it was defined in a notebook cell
    return 0


_undefined_in_main.__module__ = "__main__"


@pytest.mark.timeout(30)
def test_unimportable_functions_are_refused_before_starting(launches_started):
    before = set(multiprocessing.active_children())

    def local_fn():
        return 0

    with pytest.raises(ValueError, match=r"_undefined_in_main.*__main__.*\.py module"):
        launch(_undefined_in_main, 2)
    with pytest.raises(ValueError, match=r"local_fn.*importable \.py module"):
        launch(local_fn, 2)
    with pytest.raises(ValueError, match="lambda"):
        launch(lambda: 0, 1)
    with pytest.raises(ValueError, match="nprocs"):
        launch(workers.rank_info, 0)
    assert launches_started == []
    assert _new_children(before) == []


@pytest.mark.timeout(180)
def test_two_ranks_with_a_function_only_on_the_callers_sys_path(tmp_path, monkeypatch):
    # The notebook case: a .py file next to the notebook, importable through the caller's
    # sys.path only (not installed, not under the repository root).
    (tmp_path / "nb_helpers_for_launch.py").write_text(
        textwrap.dedent(
            """
            from tests.distributed._workers_launch import rank_info

            def info(*args, **kwargs):
                return rank_info(*args, **kwargs)
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import nb_helpers_for_launch

    results = launch(nb_helpers_for_launch.info, 2, "a", 2, scale=0.5, label="x", timeout_s=150)
    _check_rank_info(results, 2, args=("a", 2), kwargs={"scale": 0.5, "label": "x"})


@pytest.mark.timeout(180)
def test_worker_error_names_rank_and_traceback_then_launch_again():
    before = set(multiprocessing.active_children())
    with pytest.raises(WorkerError) as info:
        launch(workers.raise_on_rank, 2, 1, "deliberate failure 7f3a", timeout_s=150)
    err = info.value
    message = str(err)
    assert not isinstance(err, WorkerTimeout)
    assert message.startswith("rank 1 of 2 failed in tests.distributed._workers_launch.raise_on_rank")
    assert "Traceback (most recent call last)" in message
    assert "ValueError: deliberate failure 7f3a" in message
    assert 'in raise_on_rank\n    raise ValueError(message)' in message
    assert err.ranks[0] == 1
    assert "deliberate failure 7f3a" in err.failures[1]
    assert _new_children(before) == []

    results = launch(workers.rank_info, 1, 3, key="v", timeout_s=150)
    _check_rank_info(results, 1, args=(3,), kwargs={"key": "v"})


class _ChildPidSampler:
    """Collects the pids of this process's children while a launch runs, from /proc: it never
    waits on them, so it cannot disturb elastic's own bookkeeping."""

    def __init__(self):
        self.before = _child_pids()
        self.seen: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(0.05):
            self.seen |= _child_pids() - self.before

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def _child_pids() -> set[int]:
    return _worker_processes(os.getpid())


def _worker_processes(launcher: int) -> set[int]:
    """The worker processes ``launcher`` started: its spawned children and its forkserver's
    children (not multiprocessing's resource tracker, nor the forkserver itself)."""
    pids = set()
    for pid in children(launcher):
        command = cmdline(pid)
        if b"spawn_main" in command:
            pids.add(pid)
        elif b"multiprocessing.forkserver" in command:
            pids |= set(children(pid))
    return pids


@pytest.mark.timeout(180)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_hanging_worker_times_out_leaves_nothing_then_launch_again(tmp_path):
    before = set(multiprocessing.active_children())
    start = time.monotonic()
    with _ChildPidSampler() as sampler, pytest.raises(WorkerTimeout) as info:
        launch(workers.hang_on_rank0, 2, str(tmp_path), timeout_s=6)
    elapsed = time.monotonic() - start
    # the clock starts once every rank is up, i.e. after the workers wrote their pids
    up_for = time.time() - max(p.stat().st_mtime for p in tmp_path.glob("rank*.pid"))
    assert 6 <= elapsed and up_for < 21, (elapsed, up_for)
    err = info.value
    assert isinstance(err, WorkerError)
    assert "timed out after 6 s" in str(err)
    assert err.ranks == [0], str(err)  # rank 0 sleeps forever; rank 1 returned and waits for it
    assert "all worker processes have been killed" in str(err)
    # the workers' pids as they wrote them, and every child process seen during the launch
    pids = {int(p.read_text()) for p in tmp_path.glob("rank*.pid")} | sampler.seen
    assert pids, "no worker process was seen"
    _assert_gone(pids)
    assert _new_children(before) == []

    results = launch(workers.rank_info, 1, timeout_s=150)
    _check_rank_info(results, 1)


@pytest.mark.timeout(60)
def test_worker_main_runs_module_function_in_a_process_group_from_env(monkeypatch):
    # What `torchrun ... -m muonlab.launcher MODULE:FUNCTION ARGS` runs in each
    # process, here in this process as a world of one.
    import socket

    import torch

    from muonlab.launcher import worker_main

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for key, value in dict(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    ).items():
        monkeypatch.setenv(key, value)
    num_threads = torch.get_num_threads()
    try:
        info = worker_main(
            ["--backend", "gloo", "tests.distributed._workers_launch:rank_info", "--lr", "3"]
        )
    finally:
        torch.set_num_threads(num_threads)
    assert (info["rank"], info["world_size"], info["rank_sum"]) == (0, 1, 0.0)
    assert info["args"] == ("--lr", "3")
    import torch.distributed as dist

    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="MODULE:FUNCTION"):
        worker_main(["no_colon_here"])


@pytest.mark.timeout(180)
def test_sys_exit_nonzero_is_named_with_its_code():
    with pytest.raises(WorkerError) as info:
        launch(workers.exit_on_rank, 2, 1, 3, timeout_s=150)
    err = info.value
    assert err.ranks[0] == 1, str(err)
    assert "rank 1 exited with code 3 (sys.exit(3)" in err.failures[1], str(err)
    assert str(err).startswith("rank 1 of 2 failed in tests.distributed._workers_launch.exit_on_rank")


@pytest.mark.timeout(180)
def test_sys_exit_zero_returns_none_and_fast_ranks_wait_for_slow_ones(tmp_path):
    # rank 0 returns at once, without a collective; rank 1 calls sys.exit(0) 3 s later
    results = launch(workers.exit_on_rank, 2, 1, 0, str(tmp_path), 3.0, timeout_s=150)
    assert results == {0: 0, 1: None}
    exit_call = float((tmp_path / "exit_call").read_text())
    # rank 0's process ended only after rank 1 reached its exit: the teardown waited for it
    assert float((tmp_path / "rank0.end").read_text()) >= exit_call


@pytest.mark.timeout(180)
def test_a_worker_that_vanishes_is_named_long_before_the_timeout(monkeypatch):
    """os._exit(0): no result, no error, no signal. The launch names the rank once the process
    has been gone for _VANISHED_GRACE_S (3 s here, 10 by default), instead of waiting out
    timeout_s (then 40 s more). (With peers, a peer's teardown barrier fails first and names the
    lost connection.)"""
    monkeypatch.setattr(importlib.import_module("muonlab.launcher.process_tools"), "_VANISHED_GRACE_S", 3.0)
    started = time.monotonic()
    with pytest.raises(WorkerError) as info:
        launch(workers.vanish_on_rank, 1, 0, timeout_s=150)
    assert time.monotonic() - started < 100
    assert info.value.ranks == [0], str(info.value)
    assert "rank 0's process ended without returning a result or raising" in info.value.failures[0]


_LAUNCHER_SCRIPT = """
import sys
import tempfile
sys.path[:0] = {path!r}
from muonlab.launcher import launch
from tests.distributed import _workers_launch as workers
{body}
"""


def _run_script(tmp_path, body: str, **popen) -> subprocess.Popen:
    script = tmp_path / "launcher.py"
    script.write_text(_LAUNCHER_SCRIPT.format(path=[os.getcwd()], body=textwrap.dedent(body)))
    return subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, **popen)


@pytest.mark.timeout(240)
def test_script_without_main_guard_gets_an_error_naming_the_fix(tmp_path):
    # no `if __name__ == "__main__":`: every spawned worker re-runs this script
    proc = _run_script(tmp_path, """
        import os
        launcher_pid = os.environ.setdefault("TEST_LAUNCHER_PID", str(os.getpid()))  # workers inherit it
        try:
            launch(workers.rank_info, 2, timeout_s=60, startup_timeout_s=120)
        except Exception as e:
            where = "launcher" if str(os.getpid()) == launcher_pid else "worker"
            print("CAUGHT", where, type(e).__name__, e)
    """, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    out, _ = proc.communicate(timeout=220)
    caught = [line for line in out.splitlines() if line.startswith("CAUGHT launcher")]
    assert len(caught) == 1, out
    assert caught[0].startswith("CAUGHT launcher WorkerError"), out
    assert 'under `if __name__ == "__main__":`' in caught[0] and "launcher.py" in caught[0], out


@pytest.mark.timeout(240)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forkserver by default on Linux only")
def test_workers_get_the_callers_environment_as_it_is_at_each_launch(tmp_path):
    # A forkserver's workers would inherit the environment the forkserver started with (at the
    # first launch), so a later launch must hand its own: changed, removed and added variables.
    proc = _run_script(tmp_path, """
        import json, os
        from muonlab.launcher.process_tools import _forkserver_pid
        if __name__ == "__main__":
            names = ["T_CHANGED", "T_REMOVED", "T_ADDED"]
            os.environ.update(T_CHANGED="before", T_REMOVED="before")
            out = {"first": launch(workers.environment_and_parent, 2, names, warm=False)}
            os.environ.update(T_CHANGED="after", T_ADDED="after")
            del os.environ["T_REMOVED"]
            out["second"] = launch(workers.environment_and_parent, 2, names, warm=False)
            out["spawned"] = launch(workers.environment_and_parent, 1, names, warm=False, start_method="spawn")
            print(json.dumps(dict(out, launcher=os.getpid(), forkserver=_forkserver_pid())))
    """, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=220)
    assert proc.returncode == 0, err
    seen = json.loads(out.splitlines()[-1])
    before = {"T_CHANGED": "before", "T_REMOVED": "before", "T_ADDED": None}
    after = {"T_CHANGED": "after", "T_REMOVED": None, "T_ADDED": "after"}
    assert seen["forkserver"] not in (None, seen["launcher"])
    for launch_name, env, parent in [("first", before, seen["forkserver"]), ("second", after, seen["forkserver"]),
                                     ("spawned", after, seen["launcher"])]:
        for rank, info in seen[launch_name].items():
            assert info["env"] == env, (launch_name, rank, info)
            assert info["ppid"] == parent, (launch_name, rank, info, seen)


@pytest.mark.timeout(240)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_killing_the_launcher_while_workers_start_leaves_no_worker(tmp_path):
    import signal

    # the launcher's temporary folder: it must leave nothing there (its status files live in the
    # run directory, which is kept anyway). A short one: under xdist's long tmp_path the forkserver's
    # socket path would not fit, and the launch would take spawn (test below)
    temp = Path(tempfile.mkdtemp(prefix="ml-kill-"))
    proc = _run_script(tmp_path, """
        if __name__ == "__main__":
            launch(workers.rank_info, 2, timeout_s=300, startup_timeout_s=300)
    """, stdout=subprocess.DEVNULL, stderr=(tmp_path / "launcher.err").open("w"),
        # the workers stay in their start-up (importing the function's module) for 600 s, longer than
        # anything waits here, so only their launcher's death can end them in time: a forkserver's
        # are otherwise up and done within a poll or two of this loop on a loaded machine
        env=dict(os.environ, TMPDIR=str(temp), MUONLAB_TEST_SLOW_IMPORT_S="600"))
    workers_seen: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        while len(workers_seen) < 2 and time.monotonic() < deadline and proc.poll() is None:
            workers_seen |= _worker_processes(proc.pid)
            time.sleep(0.02)
        assert len(workers_seen) == 2, (f"the launcher started no workers (it exited with {proc.poll()}):\n"
                                        + (tmp_path / "launcher.err").read_text()[-3000:])
        proc.kill()  # while the workers are still bootstrapping (importing muonlab, or torch if spawned)
        proc.wait()
        deadline = time.monotonic() + 90
        while any(map(alive, workers_seen)) and time.monotonic() < deadline:
            time.sleep(0.2)
        survivors = [pid for pid in workers_seen if alive(pid)]
        assert not survivors, f"workers {survivors} outlived their launcher"
        left = [entry for entry in os.listdir(temp) if entry.startswith("muonlab")]
        assert not left, f"the killed launcher left {left} in its temporary folder"
    finally:
        proc.kill()
        for pid in workers_seen:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.timeout(120)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="AF_UNIX path limit of Linux")
def test_a_temporary_folder_too_long_for_the_forkserver_socket_takes_spawn(tmp_path):
    # the forkserver listens on <TMPDIR>/pymp-XXXXXXXX/listener-XXXXXXXX, at most 107 bytes on Linux:
    # launch() failed with "AF_UNIX path too long" under a long TMPDIR (xdist's tmp_path is one)
    long = tmp_path / ("t" * 90)
    long.mkdir()
    code = ("from muonlab.launcher.supervisor import _start_method\n"
            "print(_start_method(None))\n"
            "try:\n    _start_method('forkserver')\nexcept ValueError as e:\n    print(e)\n")
    run = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, TMPDIR=str(long)), capture_output=True,
                         text=True, timeout=100)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == "spawn", run.stdout
    assert "start_method='forkserver' can't start here" in lines[1] and "over Linux's 107" in lines[1], run.stdout


@pytest.mark.timeout(240)
def test_timeout_counts_from_when_the_workers_are_up(monkeypatch):
    # each worker spends 12 s importing the function's module, longer than timeout_s: start-up
    # is on its own, generous clock. (timeout_s must still hold the run and its teardown on a
    # loaded machine: 3 s did not, with two cores shared by a dozen processes.)
    monkeypatch.setenv("MUONLAB_TEST_SLOW_IMPORT_S", "12")
    results = launch(workers.rank_info, 2, timeout_s=8, startup_timeout_s=200)
    _check_rank_info(results, 2)
    with pytest.raises(WorkerTimeout) as info:
        launch(workers.rank_info, 2, timeout_s=60, startup_timeout_s=2)
    assert info.value.phase == "startup"
    assert "did not start within startup_timeout_s=2 s" in str(info.value), str(info.value)
    assert "initialised the process group" in str(info.value)


@pytest.mark.timeout(30)
def test_bad_timeouts_are_refused_before_starting(launches_started):
    for name, value in [("timeout_s", 0), ("timeout_s", -1), ("startup_timeout_s", 0),
                        ("startup_timeout_s", float("nan")), ("timeout_s", "60"), ("startup_timeout_s", True)]:
        with pytest.raises(ValueError, match=name):
            launch(workers.rank_info, 1, **{name: value})
    with pytest.raises(ValueError, match="nprocs"):
        launch(workers.rank_info, True)
    with pytest.raises(ValueError, match=r"nprocs=1000000000 is more processes than launch\(\) starts"):
        launch(workers.rank_info, 10**9)
    assert launches_started == []


@pytest.mark.timeout(30)
def test_unknown_backends_and_timeouts_past_the_cap_are_refused_before_starting(monkeypatch, tmp_path,
                                                                                launches_started):
    from muonlab.launcher import RUNS_DIR_ENV

    launch_module = sys.modules["muonlab.launcher.supervisor"]
    monkeypatch.setenv(RUNS_DIR_ENV, str(tmp_path))
    for bad in ("glo", "mpi", 123):
        with pytest.raises(ValueError, match=r"^backend must be None .* 'gloo' or 'nccl', got"):
            launch(workers.rank_info, 1, backend=bad)
    for bad in ("fork", "Spawn", 1):
        with pytest.raises(ValueError, match=r"^start_method must be None .* 'forkserver' or 'spawn', got"):
            launch(workers.rank_info, 1, start_method=bad)
    for name in ("timeout_s", "startup_timeout_s"):
        # 1e14 s is past what the workers' timedelta holds
        with pytest.raises(ValueError, match=rf"^{name}=1e\+14 s is longer than launch\(\) waits"):
            launch(workers.rank_info, 1, **{name: 1e14})
        with pytest.raises(ValueError, match=rf"^{name}="):
            launch(workers.rank_info, 1, **{name: launch_module.MAX_TIMEOUT_S * 1.01})
    assert launches_started == []
    assert os.listdir(tmp_path) == []  # no run directory either
