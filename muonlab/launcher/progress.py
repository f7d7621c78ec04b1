"""Progress of launched workers: reported by each rank, shown while :func:`launch` waits.

Worker side: :func:`report_progress` appends one JSON line (rank, step, loss, total, time) to this
rank's ``progress.jsonl`` in the launch's run directory, and does nothing outside a launch. A
line per step costs one small write; a file survives the worker's crash, and the launcher reads
it without any handshake that could block a worker. Besides, while the function runs, a thread
of each worker notes whether the rank is inside a collective (:func:`collectives_in_flight`): at a
timeout, the rank that hung is told apart from those waiting for it.

Launcher side: :class:`ProgressState` folds the lines into per-rank steps and losses (no display,
so it is tested without a kernel); :class:`ProgressMonitor` tails the files when ``launch`` polls
it and drives a display: in a notebook a tqdm bar (the slowest rank's step, the latest mean loss,
the step rate) and a loss plot redrawn about once a second, elsewhere an optional text bar on
stderr. The bar names the launch's phase (:class:`LaunchPhase`): "ranks up k/N" while the worker
processes start, "connecting" while they form the process group, "no step yet" until the first
report, then the steps, then "tearing down" once every rank has returned. The step rate comes
from the workers' own timestamps (steps between a rank's first and latest report over the time
between them, the slowest rank's), never from how many steps one poll happened to catch up on.
Closing leaves a plain-text line ("fsdp: 10/10 steps, loss 3.21 -> 2.95, 84 s (start-up 3.1 s,
teardown 0.4 s)") for viewers that cannot render widgets.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import sys
import time
import warnings
from typing import Any, NamedTuple, TextIO

from ..bars import in_notebook_kernel

__all__ = ["PROGRESS_FILE", "LaunchPhase", "ProgressMonitor", "ProgressState", "collectives_in_flight",
           "in_notebook_kernel", "report_progress"]

PROGRESS_FILE = "progress.jsonl"

# ---------------------------------------------------------------------------------- in a worker

_sink: TextIO | None = None
_sink_rank = 0


def _open_stream(path: str, rank: int) -> None:
    """Make :func:`report_progress` append to ``path`` (called by launch's worker entry)."""
    global _sink, _sink_rank
    _close_stream()
    _sink, _sink_rank = open(path, "a", buffering=1), rank


def _close_stream() -> None:
    global _sink
    if _sink is not None:
        _sink.close()
        _sink = None


def report_progress(*, step: int, loss: Any = None, total: int | None = None) -> None:
    """Tell the launching process that this rank has done ``step`` steps (of ``total``).

    ``step`` counts the steps this rank has finished in the current launch (1, 2, ...), ``loss``
    is a number or a one-element tensor (this rank's loss at that step), ``total`` the number of
    steps the launch will run when known. Outside a :func:`muonlab.launcher.launch` worker it
    does nothing, so worker functions can call it unconditionally.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"report_progress: step must be an int >= 0, got {step!r}")
    if total is not None and (isinstance(total, bool) or not isinstance(total, int) or total < 0):
        raise ValueError(f"report_progress: total must be None or an int >= 0, got {total!r}")
    value = None if loss is None else _loss_value(loss)  # checked in or out of a launch alike
    if _sink is None:
        return
    record = {"rank": _sink_rank, "step": step, "loss": value, "total": total, "time": time.time()}
    _sink.write(json.dumps(record) + "\n")


def _loss_value(loss: Any) -> float:
    try:
        return float(loss)
    except (TypeError, ValueError, RuntimeError):  # a str, a tensor of several elements, ...
        raise ValueError(f"report_progress: loss must be None, a number or a one-element tensor, got "
                         f"{loss!r}") from None


# ---------------------------------------------------------------------------------- collectives


def collectives_in_flight() -> dict[str, tuple[int, int]]:
    """This process's process groups with a collective entered and not finished: {torch's group
    id: (last collective enqueued, last completed)}, from the counters c10d keeps per group
    whether or not its flight recorder is on; {} where this torch does not expose them."""
    try:
        import torch.distributed as dist

        if not dist.is_initialized():
            return {}
        from torch._C._distributed_c10d import _dump_fr_trace_json

        status = json.loads(_dump_fr_trace_json(False, True)).get("pg_status", {})
        counts = {pg: (int(s["last_enqueued_collective"]), int(s["last_completed_collective"]))
                  for pg, s in status.items()}
    except Exception:  # no such dump here, or a layout of another torch: nothing known
        return {}
    return {pg: c for pg, c in counts.items() if c[0] > c[1]}


class _CollectiveWatch:
    """While a launched function runs, a daemon thread notes about once a second whether this
    rank is inside a collective, in the file ``path`` ("1" or "0", rewritten when that changes).

    At a timeout the launcher reads it to tell the rank that hung from the ranks that wait for it
    in a collective. Sampled, not traced: a collective's completion reaches c10d's counters a
    moment after it returns, so one sample can be stale; a hang outlasts many samples. The
    thread reads counters only, never touching the process group, so it cannot block a collective.
    """

    EVERY_S = 1.0

    def __init__(self, path: str):
        import threading

        self.path = path
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="muonlab-collective-watch", daemon=True)

    def start(self) -> "_CollectiveWatch":
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the thread (within one sample) before the task's status folder goes."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        noted = None
        while True:
            inside = "1" if collectives_in_flight() else "0"
            if inside != noted:
                try:  # whole or not at all: the launcher may read it at any moment
                    with open(self.path + ".tmp", "w") as f:
                        f.write(inside)
                    os.replace(self.path + ".tmp", self.path)
                    noted = inside
                except OSError:  # the status folder is gone: the launch is over
                    return
            if self._stop.wait(self.EVERY_S):
                return


# ---------------------------------------------------------------------------------- folding


class ProgressState:
    """What the ranks have reported: per rank its last step, per step each rank's loss.

    ``add`` takes one parsed record, ``feed`` one JSON line (a malformed line is counted in
    ``bad_lines`` and skipped: a worker killed mid-write leaves at most one).
    """

    def __init__(self, num_ranks: int):
        if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
            raise ValueError(f"num_ranks must be an int >= 1, got {num_ranks!r}")
        self.num_ranks = num_ranks
        self.last_step: dict[int, int] = {}
        self.losses: dict[int, dict[int, float]] = {}  # step -> {rank: loss}
        self.total: int | None = None
        self.bad_lines = 0
        # per rank, (step, worker's time) of its first and of its latest report: the step rate
        self.first_report: dict[int, tuple[int, float]] = {}
        self.last_report: dict[int, tuple[int, float]] = {}

    def feed(self, line: str) -> None:
        try:
            record = json.loads(line)
            self.add(record)
        except (ValueError, TypeError, KeyError):
            self.bad_lines += 1

    def add(self, record: dict) -> None:
        rank, step = int(record["rank"]), int(record["step"])
        self.last_step[rank] = step
        if record.get("time") is not None:
            stamp = (step, float(record["time"]))
            self.first_report.setdefault(rank, stamp)
            self.last_report[rank] = stamp
        if record.get("total") is not None:
            self.total = int(record["total"])
        if record.get("loss") is not None:
            self.losses.setdefault(step, {})[rank] = float(record["loss"])

    @property
    def slowest_step(self) -> int:
        """Steps every rank has finished (0 until each rank has reported)."""
        if len(self.last_step) < self.num_ranks:
            return 0
        return min(self.last_step.values())

    def steps_per_s(self) -> float | None:
        """The slowest rank's step rate, from the workers' timestamps: steps between its first and
        latest report over the seconds between them (None until every rank has two reports apart
        in time). Start-up and a poll that catches up on many steps at once do not enter it."""
        rates = []
        for rank in range(self.num_ranks):
            if rank not in self.first_report:
                return None
            (step0, t0), (step1, t1) = self.first_report[rank], self.last_report[rank]
            if t1 <= t0 or step1 <= step0:
                return None
            rates.append((step1 - step0) / (t1 - t0))
        return min(rates)

    def first_step_time(self) -> float | None:
        """The workers' time (time.time()) at which every rank had reported a step (None: not yet)."""
        if len(self.first_report) < self.num_ranks:
            return None
        return max(t for _, t in self.first_report.values())

    def mean_losses(self) -> tuple[list[int], list[float]]:
        """(steps, mean loss over the ranks) for the steps every rank has reported a loss for."""
        steps = [s for s in sorted(self.losses) if len(self.losses[s]) == self.num_ranks]
        return steps, [sum(self.losses[s].values()) / self.num_ranks for s in steps]

    def summary(self, name: str, elapsed_s: float, failed: bool = False, timings: dict | None = None) -> str:
        """One plain line: ``"fsdp: 10/10 steps, loss 3.21 -> 2.95, 84 s"``, then, given the
        launch's ``timings`` (see :func:`timing_text`), where the time went in brackets."""
        done = f"{self.slowest_step}/{self.total}" if self.total is not None else f"{self.slowest_step}"
        text = f"{name}: {done} steps"
        _, means = self.mean_losses()
        if means:
            text += f", loss {means[0]:.3f} -> {means[-1]:.3f}" if len(means) > 1 else f", loss {means[0]:.3f}"
        text += f", {elapsed_s:.0f} s" if elapsed_s >= 10 or not timings else f", {elapsed_s:.1f} s"
        if timings:
            text += f" ({timing_text(timings)})"
        return text + (" (failed)" if failed else "")


def timing_text(timings: dict) -> str:
    """``"start-up 3.1 s, first step 4.2 s, teardown 0.4 s, warm workers"`` from launch's timings:
    ``startup_s`` (until every rank had its process group), ``first_step_s`` (until every rank had
    reported a step), ``teardown_s`` (from the last rank's return to the launch's), ``workers``."""
    parts = [f"{label} {timings[key]:.1f} s" for key, label in
             (("startup_s", "start-up"), ("first_step_s", "first step"), ("teardown_s", "teardown"))
             if timings.get(key) is not None]
    if timings.get("workers"):
        parts.append(f"{timings['workers']} workers")  # "cold", "new warm", "reused warm"
    return ", ".join(parts)


class LaunchPhase(NamedTuple):
    """How far a launch's ranks are: ``up`` have started (their process runs launch's worker code),
    ``ready`` have their process group, ``returned`` have returned from the function."""

    up: int
    ready: int
    returned: int = 0


def phase_text(state: ProgressState, phase: LaunchPhase | int) -> str:
    """What the bar says besides the steps: "ranks up k/N", "connecting", "no step yet", "tearing
    down", or "" while steps come in. An int ``phase`` is the count of ranks ready."""
    if not isinstance(phase, LaunchPhase):
        phase = LaunchPhase(int(phase), int(phase))
    n = state.num_ranks
    if phase.returned >= n:
        return "tearing down"
    if state.last_step:
        return ""
    if phase.ready < n:
        return f"ranks up {phase.up}/{n}" if phase.up < n else f"connecting {phase.ready}/{n}"
    return "no step yet"


class _Tail:
    """New complete lines of a file that another process appends to."""

    def __init__(self, path: str):
        self.path, self.offset, self.partial = path, 0, b""

    def lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:  # not created yet
            return []
        self.offset += len(data)
        *complete, self.partial = (self.partial + data).split(b"\n")
        return [line.decode("utf-8", "replace") for line in complete if line.strip()]


# ---------------------------------------------------------------------------------- displays


class _TextDisplay:
    """A tqdm bar on stderr (``progress=True`` outside a notebook)."""

    # tqdm's own rate is left out: the bar's count is set, not stepped, so tqdm would divide the
    # steps one poll caught up on by the time since its last redraw (once 31,913 step/s)
    BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"
    COUNT_FORMAT = "{desc}: {n_fmt} steps [{elapsed}{postfix}]"

    def __init__(self, name: str):
        from tqdm import tqdm

        self.name = name
        self.bar = tqdm(total=None, desc=name, unit="step", file=sys.stderr, leave=False, dynamic_ncols=True,
                        bar_format=self.COUNT_FORMAT)

    def update(self, state: ProgressState, phase: LaunchPhase | int) -> None:
        bar = self.bar
        what = phase_text(state, phase)
        desc = f"{self.name} ({what})" if what else self.name
        if desc != bar.desc:
            bar.set_description_str(desc, refresh=False)
        if state.total is not None and bar.total != state.total:
            started = bar.start_t
            bar.reset(total=state.total)  # also resizes a notebook bar's widget
            bar.start_t = started  # elapsed counts from the launch's start, not from here
            bar.bar_format = self.BAR_FORMAT
        bar.n = state.slowest_step
        postfix = []
        _, means = state.mean_losses()
        if means:
            postfix.append(f"loss {means[-1]:.3f}")
        rate = state.steps_per_s()
        if rate is not None:
            postfix.append(f"{rate:.3g} step/s" if rate >= 1 else f"{1 / rate:.3g} s/step")
        if postfix:
            bar.set_postfix_str(", ".join(postfix), refresh=False)
        bar.refresh()

    def close(self, state: ProgressState, line: str) -> None:
        self.bar.close()
        print(line, file=sys.stderr, flush=True)


class _NotebookDisplay(_TextDisplay):
    """A notebook tqdm bar plus a loss plot, each in a display updated in place.

    When the launch ends, the bar's display is replaced by the plain summary line (a viewer
    without the widget's state would otherwise show the bar's text as first drawn, "0%"), and the
    plot's display keeps the last figure.
    """

    PLOT_EVERY_S = 1.0

    def __init__(self, name: str):
        from IPython.display import DisplayHandle

        from ..bars import notebook_bar

        self.name = name
        self.bar_handle = DisplayHandle()
        self.bar = notebook_bar(name, None, handle=self.bar_handle)
        self.bar.bar_format = self.COUNT_FORMAT
        self.plot_handle = None
        self.plotted_steps = 0
        self.last_plot = 0.0

    def update(self, state: ProgressState, phase: LaunchPhase | int) -> None:
        super().update(state, phase)
        now = time.monotonic()
        if now - self.last_plot >= self.PLOT_EVERY_S:
            self._plot(state)
            self.last_plot = now

    def _plot(self, state: ProgressState) -> None:
        from IPython.display import DisplayHandle, Image

        steps, means = state.mean_losses()
        if not steps or len(steps) == self.plotted_steps:
            return
        self.plotted_steps = len(steps)
        image = Image(data=loss_plot_png(self.name, state), format="png")
        if self.plot_handle is None:
            # one display, updated in place: the cell keeps only the latest figure
            self.plot_handle = DisplayHandle()
            self.plot_handle.display(image)
        else:
            self.plot_handle.update(image)

    def close(self, state: ProgressState, line: str) -> None:
        self._plot(state)
        self.bar.close()
        self.bar_handle.update({"text/plain": line}, raw=True)


def loss_plot_png(name: str, state: ProgressState) -> bytes:
    """PNG of the mean loss over the ranks per step (a Figure, not pyplot: nothing left open)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    steps, means = state.mean_losses()
    finite = [(s, m) for s, m in zip(steps, means) if math.isfinite(m)]
    fig = Figure(figsize=(5.5, 2.6))
    ax = fig.add_subplot()
    ax.plot([s for s, _ in finite], [m for _, m in finite], "o-", ms=3)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step (this launch)")
    ax.set_ylabel("loss")
    ax.set_title(f"{name}: mean loss over {state.num_ranks} rank{'s' if state.num_ranks > 1 else ''}", fontsize=10)
    ax.grid(alpha=0.3)
    if len(finite) < len(means):
        ax.text(0.99, 0.95, "non-finite losses not drawn", transform=ax.transAxes, ha="right", va="top", fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    return buf.getvalue()


# ---------------------------------------------------------------------------------- the monitor


class ProgressMonitor:
    """Tails the ranks' progress files of one launch and drives a display.

    ``poll`` (called by launch's wait loop, about every 0.25 s, on the caller's thread, so widget
    and display updates never come from another thread) reads what is new; ``close`` reads the
    rest and leaves the summary line. ``display`` is "notebook", "text" or None (only fold).
    ``phase_of()`` says how far the ranks are: a :class:`LaunchPhase` (or the count of ranks
    ready, an int).
    """

    def __init__(self, name: str, rank_dirs: list[str], phase_of, display: str | None):
        self.name = name
        self.state = ProgressState(len(rank_dirs))
        self.tails = [_Tail(os.path.join(d, PROGRESS_FILE)) for d in rank_dirs]
        self.phase_of = phase_of
        self.started = time.monotonic()
        if display not in ("notebook", "text", None):
            raise ValueError(f"display must be 'notebook', 'text' or None, got {display!r}")
        self.display: _TextDisplay | None = None
        self._dropped = False  # a display was turned off after an error
        if display is not None:
            self._guarded(lambda: setattr(self, "display", (_NotebookDisplay if display == "notebook"
                                                             else _TextDisplay)(name)))

    def _guarded(self, show) -> None:
        # A display that breaks (a missing frontend package, a plotting error) must not stop the
        # launch it watches: it is dropped with a warning (its bar closed, if it can be) and the
        # workers run on; close() then prints the summary line itself.
        try:
            show()
        except Exception as e:
            warnings.warn(f"launch progress display turned off: {type(e).__name__}: {e}", RuntimeWarning, stacklevel=2)
            bar = getattr(self.display, "bar", None)
            if bar is not None:
                with contextlib.suppress(Exception):
                    bar.close()
            self.display, self._dropped = None, True

    def read(self) -> None:
        """Fold what the ranks wrote since the last read into ``state`` (no display)."""
        for tail in self.tails:
            for line in tail.lines():
                self.state.feed(line)

    def poll(self) -> None:
        # the phase first: a rank reports its steps before it returns, so steps read after the
        # phase are never older than it (else "tearing down" could show over 0 steps)
        phase = self.phase_of()
        self.read()
        if self.display is not None:
            self._guarded(lambda: self.display.update(self.state, phase))

    def close(self, failed: bool = False, timings: dict | None = None) -> str:
        """Read what is left, close the display; return the summary line (with the launch's
        ``timings``, see :func:`timing_text`)."""
        self.read()
        line = self.state.summary(self.name, time.monotonic() - self.started, failed, timings)
        if self.display is not None:
            self._guarded(lambda: self.display.update(self.state, self.phase_of()))
        if self.display is not None:  # closed even when the last update failed
            self._guarded(lambda: self.display.close(self.state, line))
        if self._dropped:  # its display is gone: the line is shown here instead
            print(line, file=sys.stderr, flush=True)
        return line
