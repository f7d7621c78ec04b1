"""The launcher's process utilities: which processes are a launch's workers (elastic's start events
and the pids they wrote), whether one has ended or vanished, and ending them and what they started
(signals to each worker's process group); the forkserver's pid and socket path."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import tempfile
import threading
import time
from typing import Callable

from torch.distributed.elastic.events import Event

from ..processes import proc_stat
from .run_dir import _ranks_in, _status_text

# Seconds a signalled worker gets to exit (and elastic's agent to notice) before the next step.
_TERM_GRACE_S = 5.0


_AGENT_JOIN_S = 30.0


# The launcher-side loggers of torch's elastic agent. launch() reports failures itself, as one
# WorkerError naming the rank; elastic's warnings (a traceback per failed worker, each process it
# terminates, signal handlers it cannot install off the main thread), with pids and timestamps,
# go to the run's launcher.log instead of the notebook.
_ELASTIC_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing.spawn")


# Names of elastic's agent threads: a launch's launcher.log takes no line from another launch's agent.
_AGENT_THREAD = "muonlab-launch-agent-"


class _WorkerStarts(logging.Handler):
    """The pid of every worker process elastic's agent starts, by the launch's run id.

    elastic records a "START" event per worker (on the logger of its "null" event destination) right
    after starting it, long before the worker can write its own pid (a spawned worker first imports
    torch: seconds, minutes under load). So a launch stopped during its workers' start-up still
    knows its own processes, and never needs to guess them from this process's children (which
    include the workers of other launches running on other threads). With $LOGLEVEL above INFO
    elastic drops these events, and a launch knows only the pids its workers wrote."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self._pids: dict[str, set[int]] = {}

    def watch(self, run_id: str) -> None:
        with self.lock:
            self._pids[run_id] = set()

    def forget(self, run_id: str) -> None:
        with self.lock:
            self._pids.pop(run_id, None)

    def pids(self, run_id: str) -> set[int]:
        with self.lock:
            return set(self._pids.get(run_id, ()))

    def emit(self, record: logging.LogRecord) -> None:  # called under self.lock
        try:
            meta = Event.deserialize(record.getMessage()).metadata
            if meta.get("state") == "START" and meta.get("run_id") in self._pids:
                self._pids[meta["run_id"]].add(int(meta["worker_id"]))
        except Exception:  # another event, or one of another shape: not a worker's start
            pass


_WORKER_STARTS = _WorkerStarts()


logging.getLogger("torchelastic-events-null").addHandler(_WORKER_STARTS)


def _worker_pids(status_dir: str, run_id: str) -> set[int]:
    """This launch's worker processes: those elastic started, and those that wrote their pid."""
    recorded = set()
    for rank in _ranks_in(status_dir, "pid"):
        try:
            recorded.add(int(_status_text(status_dir, rank, "pid")))
        except ValueError:
            pass
    return _WORKER_STARTS.pids(run_id) | recorded


def _stop_workers(pids_of: Callable[[], set[int]], agent_done: threading.Event, agent_ends: bool = True) -> None:
    """SIGTERM, then SIGKILL, every worker of this launch and what each started, and wait for
    elastic's agent to end.

    ``pids_of()`` lists this launch's workers (:func:`_worker_pids`, re-read each round: the agent
    may still have been starting them), never another launch's. elastic's agent notices them die,
    ends the rest of its workers, joins them and returns, so no worker outlives the launch, not even
    as a zombie. ``agent_ends=False`` (a worker vanished: elastic waits for its result for ever)
    waits for the workers alone and reaps them; the agent's thread, a daemon, is left waiting.
    """
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids_of():
            _signal_worker(pid, sig)
        if not agent_ends:
            deadline = time.monotonic() + _TERM_GRACE_S
            while not all(map(_process_gone, pids_of())) and time.monotonic() < deadline:
                time.sleep(0.05)
        elif agent_done.wait(_TERM_GRACE_S):
            return
    if agent_ends:
        agent_done.wait(_AGENT_JOIN_S)
    else:
        multiprocessing.active_children()  # joins the children that ended: the agent never will


def _signal_worker(pid: int, sig: int) -> None:
    """``sig`` to worker ``pid`` and to the processes it started (its process group)."""
    _signal_group(pid, sig)
    if _started_here(pid):  # not reaped yet, so the pid is still the worker's
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _signal_group(pgid: int, sig: int) -> bool:
    """``sig`` to process group ``pgid``; False if there is no such group. A worker's group outlives
    the worker while something it started runs, and its number is not reused meanwhile, so the group
    named by a worker's pid is that worker's (or none)."""
    if not hasattr(os, "killpg"):
        return False
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _end_process_groups(pids: set[int]) -> None:
    """End what this launch's workers started (see :func:`_lead_own_process_group`), once the
    workers have ended: SIGTERM to each worker's group, SIGKILL to what is left after _TERM_GRACE_S."""
    running = [pid for pid in pids if _signal_group(pid, signal.SIGTERM)]
    deadline = time.monotonic() + _TERM_GRACE_S
    while running and time.monotonic() < deadline:
        time.sleep(0.05)
        running = [pid for pid in running if _group_running(pid)]
    for pid in running:
        _signal_group(pid, signal.SIGKILL)


AF_UNIX_PATH_MAX = 107


"""Linux's longest AF_UNIX socket path (``sun_path``'s 108 bytes, less the terminating NUL)."""


def _forkserver_address() -> str | None:
    """Why this process's forkserver could not start here, or None. It listens on an AF_UNIX socket
    at ``<tmp>/pymp-XXXXXXXX/listener-XXXXXXXX`` (multiprocessing's temporary folder, in
    ``tempfile.gettempdir()``), and under a long TMPDIR that path is over Linux's limit: the launch
    then failed with "AF_UNIX path too long" after starting its agent."""
    if _forkserver_pid() is not None:  # running already: its socket is bound
        return None
    folder = multiprocessing.current_process()._config.get("tempdir")  # made at its first use, then kept
    folder = folder or os.path.join(tempfile.gettempdir(), "pymp-" + "x" * 8)
    address = os.path.join(folder, "listener-" + "x" * 8)
    if len(os.fsencode(address)) <= AF_UNIX_PATH_MAX:
        return None
    return (f"its socket path in the temporary folder {tempfile.gettempdir()!r} (TMPDIR) would be "
            f"{len(os.fsencode(address))} bytes, over Linux's {AF_UNIX_PATH_MAX} for AF_UNIX sockets")


def _forkserver_pid() -> int | None:
    """The pid of this process's forkserver, None if it has none running. (multiprocessing keeps it
    in a private attribute: read defensively.)"""
    server = getattr(sys.modules.get("multiprocessing.forkserver"), "_forkserver", None)
    return getattr(server, "_forkserver_pid", None)


_VANISHED_GRACE_S = 10.0


"""How long a worker may be gone without its "done" mark before the launch calls it vanished:
time for elastic's agent to report a nonzero exit code or a signal itself, stopping the other
workers first (it polls every 0.1 s; it reaps the process, so its exit code can't be read here)."""


_HAS_PROC = os.path.isdir("/proc/self")


def _process_gone(pid: int) -> bool:
    """The process has ended (a zombie counts as ended: it runs nothing)."""
    if _HAS_PROC:
        fields = proc_stat(pid)
        return fields is None or fields[0] in ("Z", "X")
    try:  # no /proc here: ask the kernel (a zombie then looks alive)
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    return False


def _started_here(pid: int) -> bool:
    """``pid`` is a child of this process or of its forkserver (which reaps the workers it forks),
    not yet reaped (without /proc: assumed so)."""
    if not _HAS_PROC:
        return True
    fields = proc_stat(pid)
    return fields is not None and int(fields[1]) in (os.getpid(), _forkserver_pid())


def _group_running(pgid: int) -> bool:
    """Some process of group ``pgid`` still runs (zombies waiting for init to reap them don't count)."""
    if not _HAS_PROC:
        return _signal_group(pgid, 0)
    for entry in os.listdir("/proc"):
        fields = proc_stat(entry) if entry.isdigit() else None
        if fields is not None and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


def _vanished(status_dir: str, gone_since: dict[int, float]) -> list[int]:
    """Ranks whose process ended without writing "done" (os._exit, or a kill elastic did not
    report) at least ``_VANISHED_GRACE_S`` ago; ``gone_since`` keeps when each was first seen gone."""
    now, out = time.monotonic(), []
    for rank in sorted(_ranks_in(status_dir, "pid") - _ranks_in(status_dir, "done")):
        try:
            pid = int(_status_text(status_dir, rank, "pid"))
        except ValueError:
            continue
        if not _process_gone(pid):
            continue
        if now - gone_since.setdefault(rank, now) >= _VANISHED_GRACE_S:
            out.append(rank)
    return out
