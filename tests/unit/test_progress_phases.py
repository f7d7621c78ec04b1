"""The launch display's phases, step rate and timings (muonlab.launcher.progress), without
processes: what the bar says while ranks start, run and tear down, and a rate that a poll catching
up on many steps at once cannot inflate."""

from __future__ import annotations

import json

from muonlab.launcher import progress
from muonlab.launcher.progress import LaunchPhase, ProgressMonitor, ProgressState, phase_text, timing_text


def _record(rank, step, time, total=10, loss=1.0) -> dict:
    return dict(rank=rank, step=step, loss=loss, total=total, time=time)


def test_phase_text_follows_the_ranks_from_start_to_teardown():
    state = ProgressState(4)
    assert phase_text(state, LaunchPhase(0, 0)) == "ranks up 0/4"
    assert phase_text(state, LaunchPhase(3, 0)) == "ranks up 3/4"
    assert phase_text(state, LaunchPhase(4, 1)) == "connecting 1/4"
    assert phase_text(state, LaunchPhase(4, 4)) == "no step yet"
    state.add(_record(0, 1, 100.0))
    assert phase_text(state, LaunchPhase(4, 4)) == ""  # steps coming in: the bar says it
    assert phase_text(state, LaunchPhase(4, 4, 4)) == "tearing down"
    assert phase_text(ProgressState(2), 1) == "ranks up 1/2"  # an int: the count of ranks ready


def test_step_rate_comes_from_the_workers_timestamps_not_from_the_polls():
    # The 31,913 step/s: the bar was reset when the total first arrived and then set to
    # the steps already done, so tqdm divided them by the microseconds since the reset.
    state = ProgressState(2)
    assert state.steps_per_s() is None
    for step in range(1, 6):  # one poll reads five steps of each rank at once
        state.add(_record(0, step, 100.0 + 0.5 * step))
        state.add(_record(1, step, 100.0 + 0.25 * step))
    assert state.steps_per_s() == 2.0  # the slower rank: 4 steps in 2 s
    assert state.first_step_time() == 100.5
    one = ProgressState(1)
    one.add(_record(0, 1, 50.0))
    assert one.steps_per_s() is None  # one report says nothing about a rate


def test_the_text_bar_shows_phases_and_an_honest_rate(tmp_path, capsys):
    rank_dir = tmp_path / "rank0"
    rank_dir.mkdir()
    phases = iter([LaunchPhase(0, 0), LaunchPhase(1, 1), LaunchPhase(1, 1, 1)])
    current = [LaunchPhase(0, 0)]

    def phase_of():
        return current[0]

    monitor = ProgressMonitor("run", [str(rank_dir)], phase_of, "text")
    current[0] = next(phases)
    monitor.poll()
    assert "run (ranks up 0/1)" in monitor.display.bar.desc
    with open(rank_dir / progress.PROGRESS_FILE, "w") as f:
        for step in range(1, 6):
            f.write(json.dumps(_record(0, step, 1000.0 + step, total=5)) + "\n")
    current[0] = next(phases)
    monitor.poll()
    bar = monitor.display.bar
    assert bar.n == 5 and bar.total == 5 and bar.desc == "run"
    assert "1 step/s" in str(bar), str(bar)
    current[0] = next(phases)
    monitor.poll()
    assert bar.desc == "run (tearing down)"
    line = monitor.close(timings={"startup_s": 3.14, "first_step_s": 4.0, "teardown_s": 0.21, "workers": "cold"})
    assert line.startswith("run: 5/5 steps, loss 1.000 -> 1.000, ")
    assert line.endswith("(start-up 3.1 s, first step 4.0 s, teardown 0.2 s, cold workers)"), line
    assert "step/s" not in capsys.readouterr().err.replace("1 step/s", "")  # no other rate was drawn


def test_timing_text_leaves_out_what_a_launch_did_not_reach():
    assert timing_text({"startup_s": None, "first_step_s": None, "teardown_s": 0.04,
                        "workers": "reused warm"}) == "teardown 0.0 s, reused warm workers"
    assert timing_text({}) == ""
