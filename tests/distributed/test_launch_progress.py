"""launch()'s run directory and progress stream, with real worker processes over gloo on CPU.

The suite's runs go to a temporary $MUONLAB_RUNS_DIR (tests/distributed/conftest.py).
"""

from __future__ import annotations

import json
import os

import pytest

from muonlab.launcher import WorkerError, launch
from muonlab.launcher import RUNS_DIR_ENV
from tests.distributed import _workers_launch as workers

pytestmark = pytest.mark.cold_launch  # a cold launch's phases


def _stream(run_dir: str, rank: int) -> list[dict]:
    with open(os.path.join(run_dir, f"rank{rank}", "progress.jsonl")) as f:
        return [json.loads(line) for line in f]


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


@pytest.mark.timeout(180)
def test_progress_stream_and_logs_are_kept_in_the_run_directory(capsys):
    results = launch(workers.report_steps, 2, 3, name="progress_check", progress=True, timeout_s=150)
    assert results == {0: 0, 1: 1}
    run_dir = os.path.join(os.environ[RUNS_DIR_ENV], "progress_check")
    for rank in range(2):
        records = _stream(run_dir, rank)
        assert [(r["rank"], r["step"], r["loss"], r["total"]) for r in records] == [
            (rank, step, 10.0 * rank + step, 3) for step in (1, 2, 3)]
        assert [r["time"] for r in records] == sorted(r["time"] for r in records)
        # the workers' own output stays in their logs after the launch returned
        assert f"stdout line from rank {rank}" in _read(os.path.join(run_dir, f"rank{rank}", "stdout.log"))
        assert f"stderr line from rank {rank}" in _read(os.path.join(run_dir, f"rank{rank}", "stderr.log"))
    # progress=True outside a notebook: a text bar on stderr, closed by one plain summary line
    err = capsys.readouterr().err
    summary = [line for line in err.splitlines() if line.startswith("progress_check: 3/3 steps")]
    assert len(summary) == 1 and ", loss 6.000 -> 8.000, " in summary[0], err[-500:]
    assert "stderr line from rank" not in err  # worker output never reaches the caller's console

    # the same name again: the run directory is reused, its old logs replaced
    launch(workers.report_steps, 1, 2, name="progress_check", progress=False, timeout_s=150)
    assert [r["step"] for r in _stream(run_dir, 0)] == [1, 2]
    assert not os.path.exists(os.path.join(run_dir, "rank1"))


@pytest.mark.timeout(180)
def test_failed_launch_names_its_logs_and_keeps_the_traceback():
    with pytest.raises(WorkerError) as info:
        launch(workers.report_steps, 2, 5, 1, timeout_s=150)
    err = info.value
    assert err.ranks[0] == 1, str(err)
    # no name given: <function>-<time> under the runs root
    assert os.path.dirname(err.run_dir) == os.environ[RUNS_DIR_ENV]
    assert os.path.basename(err.run_dir).startswith("report_steps-")
    stderr_log = os.path.join(err.run_dir, "rank1", "stderr.log")
    assert str(err).splitlines()[1] == f"full logs: {stderr_log} (every rank's: {err.run_dir}{os.sep})"
    text = _read(stderr_log)
    assert "Traceback (most recent call last)" in text
    assert "RuntimeError: deliberate failure on rank 1 after step 1" in text
    # what the failing rank reported before it failed is in its stream
    assert [r["step"] for r in _stream(err.run_dir, 1)] == [1]
    # elastic's own report of the failure went to the launcher's log, not to the console
    assert "failed (exitcode" in _read(os.path.join(err.run_dir, "launcher.log"))


@pytest.mark.timeout(30)
def test_bad_name_or_progress_is_refused_before_starting(monkeypatch, tmp_path, launches_started):
    monkeypatch.setenv(RUNS_DIR_ENV, str(tmp_path))
    for bad in ("", "a/b", "..", ".hidden", 3):
        with pytest.raises(ValueError, match="name must be"):
            launch(workers.rank_info, 1, name=bad)
    with pytest.raises(ValueError, match="progress must be"):
        launch(workers.rank_info, 1, progress="yes")
    assert launches_started == []
    assert os.listdir(tmp_path) == []  # no run directory either
