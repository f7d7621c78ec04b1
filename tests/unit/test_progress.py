"""The launcher's side of worker progress (muonlab.launcher.progress) without processes or a
kernel: folding stream lines, tailing a file being appended to, the displays and their summary."""

from __future__ import annotations

import json

import pytest

from muonlab.launcher import progress
from muonlab.launcher.progress import ProgressMonitor, ProgressState, report_progress


def _line(rank, step, loss=None, total=None) -> str:
    return json.dumps(dict(rank=rank, step=step, loss=loss, total=total, time=0.0))


def test_state_follows_the_slowest_rank_and_averages_complete_steps():
    state = ProgressState(num_ranks=2)
    assert state.slowest_step == 0 and state.mean_losses() == ([], [])
    state.feed(_line(0, 1, 4.0, total=3))
    state.feed(_line(0, 2, 3.0, total=3))
    assert state.slowest_step == 0  # rank 1 has not reported yet
    assert state.mean_losses() == ([], [])
    state.feed(_line(1, 1, 2.0, total=3))
    state.feed('{"rank": 1, "step": 2, "lo')  # a worker killed mid-write
    state.feed("not json")
    assert state.bad_lines == 2
    assert state.slowest_step == 1 and state.total == 3
    assert state.mean_losses() == ([1], [3.0])
    state.feed(_line(1, 2, 1.0))
    state.feed(_line(1, 3))  # a step without a loss moves the bar, not the curve
    assert state.slowest_step == 2
    assert state.mean_losses() == ([1, 2], [3.0, 2.0])
    assert state.summary("fsdp", 84.4) == "fsdp: 2/3 steps, loss 3.000 -> 2.000, 84 s"
    assert state.summary("fsdp", 3, failed=True) == "fsdp: 2/3 steps, loss 3.000 -> 2.000, 3 s (failed)"
    assert ProgressState(1).summary("x", 0.2) == "x: 0 steps, 0 s"


def test_tail_returns_only_complete_lines(tmp_path):
    path = tmp_path / "progress.jsonl"
    tail = progress._Tail(str(path))
    assert tail.lines() == []  # not created yet
    with open(path, "a") as f:
        f.write(_line(0, 1) + "\n" + _line(0, 2)[:10])
    assert tail.lines() == [_line(0, 1)]
    with open(path, "a") as f:
        f.write(_line(0, 2)[10:] + "\n")
    assert tail.lines() == [_line(0, 2)]
    assert tail.lines() == []


def test_report_progress_is_a_no_op_outside_a_launch_and_checks_its_arguments(tmp_path):
    report_progress(step=1, loss=2.0, total=3)  # nothing open: nothing happens
    with pytest.raises(ValueError, match="step"):
        report_progress(step=-1)
    with pytest.raises(ValueError, match="total"):
        report_progress(step=1, total=2.5)
    import torch

    for bad in ("abc", torch.ones(2)):  # refused here as inside a launch, where float() killed the worker
        with pytest.raises(ValueError, match="loss must be None, a number or a one-element tensor"):
            report_progress(step=1, loss=bad)
    path = tmp_path / "progress.jsonl"
    progress._open_stream(str(path), rank=3)
    try:
        import torch

        report_progress(step=1, loss=torch.tensor(2.5), total=2)
        report_progress(step=2)
    finally:
        progress._close_stream()
    report_progress(step=3)  # closed again: not written
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["rank"], r["step"], r["loss"], r["total"]) for r in records] == [(3, 1, 2.5, 2), (3, 2, None, None)]


def _write_run(tmp_path, lines_per_rank):
    dirs = []
    for rank, lines in enumerate(lines_per_rank):
        d = tmp_path / f"rank{rank}"
        d.mkdir()
        (d / progress.PROGRESS_FILE).write_text("".join(line + "\n" for line in lines))
        dirs.append(str(d))
    return dirs


def test_text_monitor_draws_a_bar_and_leaves_the_summary_line(tmp_path, capsys):
    dirs = _write_run(tmp_path, [[_line(0, 1, 5.0, 2)], [_line(1, 1, 3.0, 2)]])
    monitor = ProgressMonitor("ddp", dirs, lambda: 2, "text")
    monitor.poll()
    with open(tmp_path / "rank0" / progress.PROGRESS_FILE, "a") as f:
        f.write(_line(0, 2, 4.0, 2) + "\n")
    with open(tmp_path / "rank1" / progress.PROGRESS_FILE, "a") as f:
        f.write(_line(1, 2, 2.0, 2) + "\n")
    line = monitor.close()
    assert line.startswith("ddp: 2/2 steps, loss 4.000 -> 3.000, ")
    err = capsys.readouterr().err
    assert "loss 4.000" in err  # the bar's postfix while running
    assert err.rstrip().endswith(line)


def test_notebook_display_keeps_a_plot_and_prints_the_summary(tmp_path, capsys):
    pytest.importorskip("ipywidgets", reason="notebook bars and panels are ipywidgets (the lab extra)")
    # outside a kernel the notebook bar's widgets exist unseen and display() prints: the same code runs
    dirs = _write_run(tmp_path, [[_line(0, 1, 5.0, 4), _line(0, 2, 4.5, 4)]])
    monitor = ProgressMonitor("fsdp", dirs, lambda: 1, "notebook")
    monitor.poll()
    assert monitor.display.plotted_steps == 2 and monitor.display.plot_handle is not None
    line = monitor.close(failed=True)
    assert line.startswith("fsdp: 2/4 steps, loss 5.000 -> 4.500, ") and line.endswith("(failed)")
    # the bar's display now holds the summary line (outside a kernel, display prints what it shows)
    assert line in capsys.readouterr().out


def test_loss_plot_is_a_png_and_skips_non_finite_losses():
    state = ProgressState(1)
    for step, loss in enumerate([3.0, float("nan"), 2.0, float("inf")], start=1):
        state.add(dict(rank=0, step=step, loss=loss))
    png = progress.loss_plot_png("run", state)
    assert png.startswith(b"\x89PNG")


def test_a_broken_display_is_dropped_with_a_warning(tmp_path, monkeypatch):
    dirs = _write_run(tmp_path, [[_line(0, 1, 5.0, 2)]])
    monitor = ProgressMonitor("x", dirs, lambda: 1, "text")

    def broken(*args):
        raise RuntimeError("no frontend")

    monkeypatch.setattr(monitor.display, "update", broken)
    with pytest.warns(RuntimeWarning, match="progress display turned off.*no frontend"):
        monitor.poll()
    assert monitor.display is None
    assert monitor.close().startswith("x: 1/2 steps, loss 5.000, ")


def test_in_notebook_kernel_is_false_here():
    assert progress.in_notebook_kernel() is False


def test_progress_state_wants_at_least_one_rank():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="num_ranks must be an int >= 1"):
            ProgressState(bad)
    assert ProgressState(1).summary("run", 0.0) == "run: 0 steps, 0 s"


def test_a_display_dropped_on_error_closes_its_bar_and_the_summary_is_printed(tmp_path, monkeypatch, capsys):
    dirs = _write_run(tmp_path, [[_line(0, 1, 5.0, 2)]])
    monitor = ProgressMonitor("x", dirs, lambda: 1, "text")
    bar = monitor.display.bar

    def broken(*args):
        raise RuntimeError("no frontend")

    monkeypatch.setattr(monitor.display, "update", broken)
    with pytest.warns(RuntimeWarning, match="progress display turned off"):
        monitor.poll()
    assert bar.disable or getattr(bar, "closed", False) or bar not in type(bar)._instances
    line = monitor.close()
    assert line in capsys.readouterr().err  # its display gone, the summary line is printed here


def test_a_display_whose_last_update_fails_is_still_closed(tmp_path, monkeypatch, capsys):
    dirs = _write_run(tmp_path, [[_line(0, 1, 5.0, 2)]])
    monitor = ProgressMonitor("x", dirs, lambda: 1, "text")
    bar = monitor.display.bar
    monkeypatch.setattr(monitor.display, "update", lambda *a: (_ for _ in ()).throw(RuntimeError("late")))
    with pytest.warns(RuntimeWarning, match="late"):
        line = monitor.close()
    assert bar.disable and line in capsys.readouterr().err  # the bar closed, the line shown
