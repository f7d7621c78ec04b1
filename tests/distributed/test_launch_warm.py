"""Warm workers (launch(..., warm=True), muonlab.launcher.warm): real worker processes over gloo
on CPU. A second launch on the same ranks reuses the running workers and their process group; a
failure or a timeout takes the pool down and the next launch starts fresh; nothing outlives
shutdown_workers(). Each test starts at most two pools (a pool's start is a cold launch's, seconds
on a loaded machine); every clock counts from when the workers are up."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time

import pytest

from muonlab.launcher import WorkerError, WorkerTimeout, launch
from muonlab.launcher import LAUNCH_INFO, RUNS_DIR_ENV, WARM_ENV, shutdown_workers
from tests.distributed import _workers_warm as workers
from tests.distributed._common import running

pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
              pytest.mark.cold_launch]  # warm= given where it matters; the rest cold




def _wait_gone(pids, limit_s: float = 30.0) -> list[int]:
    """The pids still running after up to ``limit_s`` (a killed process may take a moment)."""
    deadline = time.monotonic() + limit_s
    while any(map(running, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [pid for pid in pids if running(pid)]


def _info(name: str) -> dict:
    with open(os.path.join(os.environ[RUNS_DIR_ENV], name, LAUNCH_INFO)) as f:
        return json.load(f)


def _read(*parts: str) -> str:
    with open(os.path.join(os.environ[RUNS_DIR_ENV], *parts)) as f:
        return f.read()


@pytest.fixture(autouse=True)
def _no_pool_left():
    """Each test starts without a pool and leaves none."""
    shutdown_workers()
    yield
    shutdown_workers()


@pytest.mark.timeout(240)
def test_a_second_launch_reuses_the_workers_and_steps_at_once(capsys):
    first = launch(workers.pid_and_steps, 2, 3, "first", warm=True, name="warm_first", timeout_s=150)
    pids = {rank: out["pid"] for rank, out in first.items()}
    assert _info("warm_first")["workers"] == "new warm"

    started = time.time()
    second = launch(workers.pid_and_steps, 2, 4, "second", warm=True, name="warm_second", timeout_s=150,
                    progress=True)
    elapsed = time.time() - started
    assert {rank: out["pid"] for rank, out in second.items()} == pids, "the second launch started new workers"
    assert all(out["world"] == 2 for out in second.values())  # the kept process group still works
    info = _info("warm_second")
    assert info["workers"] == "reused warm"
    # Reused workers are up when the launch starts: its first step comes at once. The bound is
    # generous for a loaded machine (a cold start-up takes seconds on an idle one).
    assert info["first_step_s"] is not None and info["first_step_s"] < 3.0, info
    assert info["startup_s"] < 3.0 and info["teardown_s"] < 3.0 and elapsed < 10.0, (info, elapsed)
    # the run's own logs and progress stream, not the first run's
    for rank in range(2):
        assert f"stdout second rank {rank}" in _read("warm_second", f"rank{rank}", "stdout.log")
        assert f"stderr second rank {rank}" in _read("warm_second", f"rank{rank}", "stderr.log")
        assert "second" not in _read("warm_first", f"rank{rank}", "stdout.log")
        steps = [json.loads(line)["step"] for line in _read("warm_second", f"rank{rank}", "progress.jsonl").splitlines()]
        assert steps == [1, 2, 3, 4]
    summary = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warm_second: 4/4 steps")]
    assert len(summary) == 1 and "reused warm workers" in summary[0] and "teardown" in summary[0], summary

    assert shutdown_workers() is not None
    assert not _wait_gone(pids.values(), limit_s=0.1), "workers outlived shutdown_workers()"
    assert shutdown_workers() is None  # nothing left to end


@pytest.mark.timeout(240)
def test_a_task_leaves_no_process_state_or_child_behind(tmp_path):
    launch(workers.change_process_state, 2, warm=True, timeout_s=150)
    child_pids = launch(workers.start_child, 2, str(tmp_path), warm=True, timeout_s=150)
    # the task's child processes ended with the task, though its workers live on
    assert not _wait_gone(child_pids.values(), limit_s=0.1), "a task's child process outlived it"
    after = launch(workers.pid_and_steps, 2, 1, "after", warm=True, timeout_s=150)
    assert len({out["pid"] for out in after.values()}) == 2
    for out in after.values():
        assert (out["leak"], out["dtype"], out["grad"], out["cwd"]) == (None, "torch.float32", True, os.getcwd())
    # a fresh process seeds itself anew; the earlier task seeded its ranks 0 and 1
    assert {out["seed"] for out in after.values()}.isdisjoint({0, 1}), after


def test_a_bad_warm_workers_variable_is_refused_before_anything_starts(monkeypatch, launches_started):
    monkeypatch.setenv(WARM_ENV, "maybe")
    with pytest.raises(ValueError, match=r'\$MUONLAB_WARM_WORKERS must be "1" \(warm workers\) or "0"'):
        launch(workers.pid_and_steps, 1, 1, "x")
    assert launches_started == []


@pytest.mark.timeout(240)
def test_the_environment_can_make_launches_warm_by_default(monkeypatch):
    monkeypatch.setenv(WARM_ENV, "1")
    launch(workers.pid_and_steps, 1, 1, "first", name="env_warm_first", timeout_s=150)
    launch(workers.pid_and_steps, 1, 1, "second", name="env_warm_second", timeout_s=150)
    assert (_info("env_warm_first")["workers"], _info("env_warm_second")["workers"]) == ("new warm", "reused warm")
    monkeypatch.setenv(WARM_ENV, "0")
    launch(workers.pid_and_steps, 1, 1, "third", name="env_cold", timeout_s=150)
    assert _info("env_cold")["workers"] == "cold"


@pytest.mark.timeout(300)
def test_a_failing_task_takes_the_pool_down_and_the_next_launch_starts_fresh():
    before = launch(workers.pid_and_steps, 2, 1, "before", warm=True, timeout_s=150)
    with pytest.raises(WorkerError) as info:
        launch(workers.fail_on_rank, 2, 1, warm=True, name="warm_fails", timeout_s=150)
    err = info.value
    assert str(err).startswith("rank 1 of 2 failed in tests.distributed._workers_warm.fail_on_rank"), str(err)
    assert "ValueError: deliberate failure in a warm task on rank 1" in err.failures[1]
    assert "deliberate failure in a warm task" in _read("warm_fails", "rank1", "stderr.log")
    old = [out["pid"] for out in before.values()]
    assert not _wait_gone(old), "the failed pool's workers outlived the launch"

    after = launch(workers.pid_and_steps, 2, 1, "after", warm=True, name="warm_after", timeout_s=150)
    assert _info("warm_after")["workers"] == "new warm"
    assert not {out["pid"] for out in after.values()} & set(old)
    assert _info("warm_fails")["failed"] is True
    # sys.exit(n) in a warm task: named with its code, as in a cold one
    with pytest.raises(WorkerError) as info:
        launch(workers.exit_on_rank, 2, 1, 3, warm=True, timeout_s=150)
    assert "rank 1 exited with code 3 (sys.exit(3)" in info.value.failures[1], str(info.value)
    assert not _wait_gone([out["pid"] for out in after.values()]), "the exited pool's workers outlived it"


@pytest.mark.timeout(300)
def test_a_worker_killed_while_idle_is_noticed_before_the_next_task_is_handed_out():
    first = launch(workers.pid_and_steps, 2, 1, "first", warm=True, timeout_s=150)
    old = [out["pid"] for out in first.values()]
    killed = first[1]["pid"]
    os.kill(killed, signal.SIGKILL)
    assert not _wait_gone([killed]), "the killed worker still runs"
    # at once, before elastic's agent has noticed and ended the pool itself: the task used to be
    # handed to the broken pool and fail, blamed on the function it never ran
    with pytest.warns(RuntimeWarning) as warned:
        after = launch(workers.pid_and_steps, 2, 1, "after", warm=True, name="warm_after_kill", timeout_s=150)
    lines = [str(w.message) for w in warned if "warm workers restarted" in str(w.message)]
    # rank 1 is named with its pid; rank 0 too where elastic's agent had already ended it (loaded machine)
    assert len(lines) == 1 and re.search(rf"ranks? (0 \(pid \d+\), )?1 \(pid {killed}\b", lines[0]), lines
    assert "ended while the pool was idle; the pool was shut down" in lines[0] and "\n" not in lines[0], lines
    info = _info("warm_after_kill")
    assert (info["workers"], info["failed"]) == ("new warm", False), info
    assert all(out["world"] == 2 for out in after.values())
    assert not {out["pid"] for out in after.values()} & set(old)
    assert not _wait_gone(old, limit_s=0.1), "a worker of the dead pool outlived its restart"


@pytest.mark.timeout(300)
def test_a_keyboard_interrupt_in_a_warm_task_is_recorded_as_the_ranks_error(tmp_path):
    launch(workers.pid_and_steps, 2, 1, "before", warm=True, timeout_s=150)  # the pool is up
    with pytest.raises(WorkerError) as info:
        launch(workers.interrupt_on_rank, 2, 1, str(tmp_path), warm=True, name="warm_interrupt", timeout_s=150)
    ended = time.time()
    err = info.value
    # The worker records it as an error and exits nonzero, so elastic reports it at once. It used to
    # exit with code 0 and no record (torch's spawn wrapper takes a KeyboardInterrupt for a Ctrl-C),
    # found only after the launcher's grace for a vanished process (10 s).
    assert not isinstance(err, WorkerTimeout) and err.ranks[0] == 1, str(err)
    assert "ended without returning" not in str(err), str(err)
    assert "KeyboardInterrupt: deliberate interrupt in a warm task" in err.failures[1], str(err)
    assert "WorkerBaseException: KeyboardInterrupt raised on rank 1" in err.failures[1], str(err)
    raised = float((tmp_path / "raised").read_text())
    print(f"\nKeyboardInterrupt in a warm task surfaced {ended - raised:.2f} s after it was raised")


@pytest.mark.timeout(300)
def test_a_timed_out_task_takes_the_pool_down_and_a_new_rank_count_starts_a_new_pool():
    one = launch(workers.pid_and_steps, 1, 1, "one", warm=True, timeout_s=150)
    # another number of ranks: the idle 1-rank pool is ended, a 2-rank one started
    two = launch(workers.pid_and_steps, 2, 1, "two", warm=True, name="warm_two", timeout_s=150)
    assert _info("warm_two")["workers"] == "new warm"
    assert not _wait_gone([one[0]["pid"]], limit_s=0.1), "the 1-rank pool outlived its replacement"
    with pytest.raises(WorkerTimeout) as info:
        launch(workers.hang_on_rank, 2, 0, warm=True, timeout_s=3)
    assert (info.value.phase, info.value.ranks) == ("run", [0]), str(info.value)
    assert not _wait_gone([out["pid"] for out in two.values()]), "the timed-out pool's workers outlived it"
    assert shutdown_workers() is None  # the pool went down with the timeout


@pytest.mark.timeout(300)
def test_a_changed_module_starts_a_new_pool(tmp_path, monkeypatch):
    # A researcher edits the .py file next to the notebook and launches again: the warm workers
    # imported the old code, so they must not run it.
    module = tmp_path / "nb_warm_module.py"
    module.write_text("import os\n\ndef version():\n    return (1, os.getpid())\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import nb_warm_module

    old = launch(nb_warm_module.version, 1, warm=True, timeout_s=150)
    assert old[0][0] == 1
    module.write_text("import os\n\ndef version():\n    return (2, os.getpid())\n")
    os.utime(module, (time.time() + 5, time.time() + 5))  # a new mtime even on a coarse clock
    new = launch(nb_warm_module.version, 1, warm=True, name="warm_changed", timeout_s=150)
    assert new[0][0] == 2 and new[0][1] != old[0][1], (old, new)
    assert _info("warm_changed")["workers"] == "new warm"


@pytest.mark.timeout(30)
def test_warm_must_be_a_bool_or_none(launches_started):
    with pytest.raises(ValueError, match=r"warm must be None .* True or False, got 'yes'"):
        launch(workers.pid_and_steps, 1, 1, "x", warm="yes")
    assert launches_started == []


@pytest.mark.timeout(240)
def test_a_cold_launch_shows_its_phases_in_order_and_records_its_timings(monkeypatch):
    from muonlab.launcher import progress

    seen = []
    poll, close = progress.ProgressMonitor.poll, progress.ProgressMonitor.close

    def recording_poll(self):
        seen.append(self.phase_of())
        poll(self)

    def recording_close(self, *args, **kwargs):  # the display's last update shows this phase
        seen.append(self.phase_of())
        return close(self, *args, **kwargs)

    monkeypatch.setattr(progress.ProgressMonitor, "poll", recording_poll)
    monkeypatch.setattr(progress.ProgressMonitor, "close", recording_close)
    launch(workers.pid_and_steps, 2, 2, "cold", warm=False, name="cold_phases", timeout_s=150)
    # from no rank up to all returned (the last poll may come before the last rank returns: a
    # forkserver's workers tear down in well under a poll's interval; the display's close shows it)
    assert seen[0].up == 0 and seen[-1] == (2, 2, 2), seen
    for before, after in zip(seen, seen[1:]):  # each count only grows
        assert all(b <= a for b, a in zip(before, after)), seen
    info = _info("cold_phases")
    assert info["workers"] == "cold" and not info["failed"]
    assert 0 < info["startup_s"] <= info["first_step_s"] <= info["total_s"], info
    assert info["teardown_s"] is not None and info["teardown_s"] < info["total_s"], info
