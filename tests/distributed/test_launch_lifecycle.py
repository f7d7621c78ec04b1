"""launch() from start to end: what a worker starts ends with the launch, a worker may end the
process group itself, concurrent launches in one process keep to their own workers and names, and
run names are taken literally. Real worker processes over gloo on CPU, 1 or 2 ranks each; every
clock in a test counts from when the workers are up, so a loaded machine only makes them slower."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

import pytest

from muonlab.launcher import WorkerError, WorkerTimeout, launch
from muonlab.launcher import RUNS_DIR_ENV
from tests.distributed import _workers_launch as workers
from tests.distributed._common import running

pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
              pytest.mark.cold_launch]  # the launcher itself




def _child_pids(out_dir) -> list[int]:
    pids = [int(p.read_text()) for p in out_dir.glob("child*.pid")]
    assert pids, "the workers started no child process"
    return pids


def _wait_for(path, limit_s: float = 200.0) -> None:
    deadline = time.monotonic() + limit_s
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} did not appear within {limit_s} s"
        time.sleep(0.1)


class _InThread:
    """``launch(*args, **kwargs)`` on a thread of its own; ``result()`` joins it and hands back its
    return value or its exception."""

    def __init__(self, *args, **kwargs):
        self.outcome: dict = {}
        self.thread = threading.Thread(target=self._run, args=args, kwargs=kwargs, daemon=True)
        self.thread.start()

    def _run(self, *args, **kwargs):
        try:
            self.outcome["value"] = launch(*args, **kwargs)
        except BaseException as e:
            self.outcome["error"] = e

    def result(self, limit_s: float = 250.0):
        self.thread.join(limit_s)
        assert not self.thread.is_alive(), "the launch on the other thread did not end"
        if "error" in self.outcome:
            raise self.outcome["error"]
        return self.outcome["value"]


@pytest.mark.timeout(240)
def test_processes_a_worker_starts_end_with_a_failed_launch(tmp_path):
    with pytest.raises(WorkerError) as info:
        launch(workers.start_child_then, 2, "raise", str(tmp_path), timeout_s=150)
    assert "deliberate failure after starting a child process" in str(info.value)
    survivors = [pid for pid in _child_pids(tmp_path) if running(pid)]
    assert not survivors, f"the workers' child processes {survivors} outlived the launch"


@pytest.mark.timeout(240)
def test_processes_a_worker_starts_end_with_a_timed_out_or_finished_launch(tmp_path):
    (tmp_path / "hang").mkdir()
    (tmp_path / "return").mkdir()
    with pytest.raises(WorkerTimeout):
        launch(workers.start_child_then, 1, "hang", str(tmp_path / "hang"), timeout_s=3)
    assert launch(workers.start_child_then, 1, "return", str(tmp_path / "return"), timeout_s=150) == {0: 0}
    for case in ("hang", "return"):
        survivors = [pid for pid in _child_pids(tmp_path / case) if running(pid)]
        assert not survivors, f"{case}: the worker's child process {survivors} outlived the launch"


@pytest.mark.timeout(240)
def test_a_timeout_names_only_the_ranks_still_in_their_function(tmp_path, monkeypatch):
    # Rank 0 returns at once and waits for rank 1, which sleeps for ever. That wait used to end on
    # the collective timeout (timeout_s), racing the launcher's clock of the same length: rank 0 was
    # named with rank 1, or failed in its teardown barrier, by chance. A few runs: one may pass by luck.
    monkeypatch.setenv(RUNS_DIR_ENV, str(tmp_path))
    for attempt in range(3):
        with pytest.raises(WorkerTimeout) as info:
            launch(workers.hang_on_rank, 2, 1, timeout_s=3, name=f"hang{attempt}")
        err = info.value
        assert (err.phase, err.ranks) == ("run", [1]), f"attempt {attempt}: {err}"
        assert "rank 1 still running" in str(err), str(err)
        # the rank that returned waited on no clock of its own, so it recorded no error
        assert not (tmp_path / f"hang{attempt}" / "rank0" / "error.json").exists(), f"attempt {attempt}"


@pytest.mark.timeout(240)
def test_a_hang_names_the_rank_that_hung_not_the_ones_waiting_for_it_in_a_collective():
    # Rank 1 sleeps; rank 0 waits for it in a barrier, so both are still in their function at the
    # timeout. Each rank's collective watch tells them apart: only rank 1 is named.
    with pytest.raises(WorkerTimeout) as info:
        launch(workers.hang_while_others_wait_in_a_collective, 2, 1, timeout_s=8)
    err = info.value
    assert (err.phase, err.ranks, err.waiting) == ("run", [1], [0]), str(err)
    assert "rank 1 still running, not inside a collective; rank 0 waited for it inside one" in str(err), str(err)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["KeyboardInterrupt", "DeliberateStop"])
def test_a_base_exception_in_a_worker_fails_the_launch_naming_the_rank_and_its_type(kind):
    # Neither is an Exception: elastic recorded no error for them, and torch's spawn wrapper ended
    # a KeyboardInterrupt's process with code 0, so the launch named the rank waiting in the
    # barrier (its connection broke) or gave no type. Now each is recorded as an error.
    with pytest.raises(WorkerError) as info:
        launch(workers.base_exception_on_rank, 2, 1, kind, timeout_s=150)
    err = info.value
    assert not isinstance(err, WorkerTimeout), str(err)
    assert err.ranks[0] == 1 and str(err).startswith("rank 1 of 2 failed"), str(err)
    assert f"{kind}: deliberate {kind}" in err.failures[1], str(err)
    assert f"WorkerBaseException: {kind} raised on rank 1" in err.failures[1], str(err)


@pytest.mark.timeout(240)
def test_a_worker_that_destroys_the_process_group_itself_returns_normally():
    assert launch(workers.destroy_group_then_return, 2, timeout_s=150) == {0: 0, 1: 1}


@pytest.mark.timeout(300)
def test_a_launch_that_times_out_leaves_a_concurrent_launch_and_the_loggers_alone(tmp_path):
    elastic_logger = logging.getLogger("torch.distributed.elastic")
    before = (elastic_logger.propagate, list(elastic_logger.handlers), os.environ.get("MUONLAB_LAUNCH_STATUS_DIR"))
    (tmp_path / "a").mkdir()
    flag = str(tmp_path / "b_may_return")
    late = _InThread(workers.hang_on_rank0, 1, str(tmp_path / "a"), timeout_s=4, name="times_out")
    _wait_for(tmp_path / "a" / "rank0.pid")  # the late launch is running; its 4 s have begun
    healthy = _InThread(workers.wait_for_file, 1, flag, timeout_s=150, name="healthy")
    with pytest.raises(WorkerTimeout):
        late.result()
    # the healthy launch's worker, started while the late one ran, was not stopped with it
    _wait_for(flag + ".waiting")
    (tmp_path / "b_may_return").write_text("")
    assert healthy.result() == {0: 0}
    after = (elastic_logger.propagate, list(elastic_logger.handlers), os.environ.get("MUONLAB_LAUNCH_STATUS_DIR"))
    assert after == before


@pytest.mark.timeout(240)
def test_a_name_in_use_by_a_running_launch_is_refused(tmp_path):
    import fcntl

    flag = str(tmp_path / "may_return")
    running = _InThread(workers.wait_for_file, 1, flag, timeout_s=150, name="busy")
    _wait_for(flag + ".waiting")
    run_dir = os.path.join(os.environ[RUNS_DIR_ENV], "busy")
    try:
        with pytest.raises(ValueError, match=r"name 'busy' is in use by a launch still running"):
            launch(workers.rank_info, 1, timeout_s=60, name="busy")
        assert os.path.exists(os.path.join(run_dir, "rank0", "stderr.log"))  # the running launch's logs
    finally:
        (tmp_path / "may_return").write_text("")
    assert running.result() == {0: 0}
    with open(os.path.join(run_dir, ".lock")) as lock:  # free again once the launch ended
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)


@pytest.mark.timeout(240)
def test_run_names_with_glob_characters_touch_no_other_run(tmp_path, monkeypatch):
    monkeypatch.setenv(RUNS_DIR_ENV, str(tmp_path))
    earlier = tmp_path / "exp1" / "rank0" / "stderr.log"
    earlier.parent.mkdir(parents=True)
    earlier.write_text("an earlier run's log\n")
    with pytest.raises(WorkerError) as info:
        launch(workers.raise_on_rank, 1, 0, "failure in exp[1]", timeout_s=150, name="exp[1]")
    assert info.value.run_dir == str(tmp_path / "exp[1]")
    assert "ValueError: failure in exp[1]" in info.value.failures[0]
    assert launch(workers.rank_info, 1, timeout_s=150, name="*")[0]["rank"] == 0
    assert earlier.read_text() == "an earlier run's log\n"
    assert sorted(os.listdir(tmp_path)) == ["*", "exp1", "exp[1]"]
