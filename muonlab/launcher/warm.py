"""Warm workers: one pool of running worker processes that :func:`~muonlab.launcher.launch`
reuses for the next launch on the same ranks.

A cold launch spends time before its first step (new processes start, import muonlab, connect a
process group; spawned ones import torch too) and after its last (processes exit, elastic's agent
notices). Within one notebook kernel a researcher launches again and again on the same ranks, so
:func:`launch` keeps the workers of a finished launch running, each waiting for its next task, with
the process group connected:

- a task is what a cold launch hands its workers (``fn`` and its arguments pickled, the run
  directory, the clocks), sent down a pipe per rank; each task gets its own run directory,
  per-rank logs (the worker points its stdout and stderr there), error file and progress stream,
  exactly as a cold launch's;
- one pool at a time: a launch with other ranks, device, backend or environment, or after a
  module the workers imported changed on disk, shuts the idle pool down and starts a new one;
- a task that fails, times out, vanishes or is interrupted takes the whole pool down (it is ended
  the way a cold launch's workers are), so the next launch starts fresh: a half-failed process
  group is never reused;
- between tasks each worker ends the processes its task started (its process group) and resets
  what a task may have changed process-wide (working directory, environment, default dtype,
  grad mode, intra-op threads, CUDA cache); module-level state of the task's own modules is
  kept, as in any long-lived process;
- on GPUs the workers keep their CUDA context (and each its device) between launches; the
  cache of freed blocks is emptied after each task, :func:`shutdown_workers` frees the rest;
- the pool ends with the kernel (``atexit``; if the kernel is killed, the workers get SIGKILL
  from the kernel's death, see ``_die_with_parent``, and EOF on their pipe) or on request:
  :func:`shutdown_workers`.

This module holds both sides: :func:`_pool_worker_entry` runs in each worker, :class:`WorkerPool`
and the pool registry in the launching process. :mod:`muonlab.launcher.supervisor` drives them.
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import hashlib
import logging
import os
import pickle
import signal
import sys
import sysconfig
import threading
import time
import warnings
from datetime import timedelta
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from ..distributed.device import init_process_group
from ..processes import proc_stat
from . import progress as _progress
from .process_tools import (
    _AGENT_THREAD,
    _ELASTIC_LOGGERS,
    _HAS_PROC,
    _TERM_GRACE_S,
    _WORKER_STARTS,
    _end_process_groups,
    _process_gone,
    _stop_workers,
    _vanished,
    _worker_pids,
)
from .run_dir import (
    _LAUNCH_ENV,
    _STATUS_DIR_ENV,
    LAUNCHER_LOG,
    _rank_dir,
    _ranks_in,
    _status_path,
    _status_text,
    _timeout_report,
    _write_status,
)
from .worker import _become_worker, _call, _teardown, _wait_for_peers, report_failure, unrecorded_as_error

__all__ = ["WorkerPool", "pool_info", "shutdown_workers"]


@dataclasses.dataclass(frozen=True)
class Task:
    """One launch's work for every rank of a pool (pickled down each rank's pipe)."""

    payload: bytes  # pickled (fn, args, kwargs), unpickled only in the worker
    timeouts: tuple[float, float]  # (collective timeout, start-up limit)
    sys_path: tuple[str, ...]
    status_dir: str
    run_dir: str
    cwd: str


# --------------------------------------------------------------------------------------------
# Inside a worker


def _point_output_at(rank_dir: str) -> None:
    """This rank's stdout and stderr (file descriptors 1 and 2, so child processes and C code
    follow) to ``rank_dir``'s logs: each task's output lands in its own run directory."""
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, name in ((1, "stdout.log"), (2, "stderr.log")):
        target = os.open(os.path.join(rank_dir, name), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(target, fd)
        os.close(target)


def _reset_process_state(task: Task, env: dict[str, str], rank_dir: str, threads: int) -> None:
    """Undo what an earlier task may have changed process-wide, so a task sees what a fresh worker
    would (the environment the pool started with, the caller's directory, torch's defaults)."""
    os.environ.clear()
    os.environ.update(env)
    # elastic's `record` writes a failure's traceback where this names: this task's rank folder
    os.environ["TORCHELASTIC_ERROR_FILE"] = os.path.join(rank_dir, "error.json")
    os.chdir(task.cwd)
    for entry in reversed(task.sys_path):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    torch.set_num_threads(threads)
    # A fresh process's generators start from a seed of their own: no draw of an unseeded task
    # follows from a seed an earlier task set (every device's generator).
    torch.seed()


def _processes_in_group(pgid: int) -> list[int]:
    """Running processes of process group ``pgid`` other than this one (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        fields = proc_stat(entry)
        if fields is not None and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            out.append(int(entry))
    return out


def _end_task_processes() -> None:
    """End the processes this task started: they are in this worker's process group (it leads
    one, see ``_lead_own_process_group``); SIGTERM, then SIGKILL after the grace a cold launch
    gives. A cold launch signals the whole group once its worker has ended; a warm worker lives
    on, so it signals the others itself."""
    if not _HAS_PROC:
        return
    pids = _processes_in_group(os.getpid())
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + _TERM_GRACE_S
        while pids and time.monotonic() < deadline:
            time.sleep(0.02)
            pids = _processes_in_group(os.getpid())
        if not pids:
            break
    try:  # reap our own children (the task's grandchildren were reparented to init)
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass


_MODULE_SOURCES: dict[str, str | None] = {}  # module name -> its source file, None if installed


def _module_files() -> dict[str, float]:
    """{source file: mtime} of the modules loaded here that are not Python's or an installed
    package's (the caller's code and muonlab in a checkout): the launcher restarts the pool when
    one changes, as the workers still run the old code. Each module's file is looked up once."""
    installed = tuple(os.path.realpath(sysconfig.get_paths()[key]) + os.sep
                      for key in ("stdlib", "platstdlib", "purelib", "platlib"))
    for name, module in list(sys.modules.items()):
        if name in _MODULE_SOURCES:
            continue
        path = getattr(module, "__file__", None)
        real = os.path.realpath(path) if isinstance(path, str) and path.endswith(".py") else None
        _MODULE_SOURCES[name] = None if real is None or real.startswith(installed) else real
    out = {}
    for real in set(_MODULE_SOURCES.values()) - {None}:
        try:
            out[real] = os.stat(real).st_mtime
        except OSError:
            pass
    return out


def _run_task(task: Task, rank: int, world: int, first: bool, device: str, backend: str | None) -> str:
    """Run one task on this rank, as ``_worker_entry`` runs a cold launch's. Returns "keep" (the
    result is written, the process group is there for the next task), "retire" (the result is
    written, but the task destroyed the group) or "abandon" (this rank returned, another failed:
    the pool is ending). A failure is re-raised: the process ends, and elastic's agent ends the
    pool as it ends a cold launch's workers."""
    status_dir = task.status_dir
    _write_status(status_dir, rank, "pid", str(os.getpid()))
    _progress._open_stream(os.path.join(_rank_dir(task.run_dir, rank), _progress.PROGRESS_FILE), rank)

    def mark_failed() -> None:
        if not os.path.exists(os.path.join(status_dir, f"rank{rank}.failed")):
            _write_status(status_dir, rank, "failed", repr(time.time()))

    try:
        fn, args, kwargs = pickle.loads(task.payload)
        if first:
            init_process_group(device, backend, timeout_s=task.timeouts[0], connect_timeout_s=task.timeouts[1])
            # What exists now (torch, the group, the modules) lives as long as the pool: out of the
            # collector's sight, each collection between tasks looks at the tasks' objects only.
            gc.freeze()
        else:  # this launch's collective timeout on the group the pool keeps
            dist.distributed_c10d._set_pg_timeout(timedelta(seconds=task.timeouts[0]))
        _write_status(status_dir, rank, "ready", "")
        watch = _progress._CollectiveWatch(_status_path(status_dir, rank, "collective")).start()
        try:
            result = _call(fn, args, kwargs)
        except BaseException:
            watch.stop()  # before the process group goes: the watch reads its counters
            mark_failed()
            # as a cold worker fails: the group destroyed before the process ends (the pool ends
            # with this failure anyway), its peers' collectives then fail at once
            _teardown(wait_for_peers=False)
            raise
        watch.stop()
        # The cold teardown without destroying the group: no rank goes on before the slowest has
        # returned. (The cold one collects garbage first, so objects of fn's that hold the group
        # die before the group; here the group lives on, so that waits until the task is done.)
        _write_status(status_dir, rank, "returned", "")
        if not _wait_for_peers(status_dir, world):
            return "abandon"
        if dist.is_initialized():
            dist.barrier()
        with open(os.path.join(status_dir, f"rank{rank}.result"), "wb") as f:
            pickle.dump(result, f, protocol=pickle.HIGHEST_PROTOCOL)
        return "keep" if dist.is_initialized() else "retire"
    except BaseException as e:
        mark_failed()
        report_failure(rank, status_dir, e)
        error = unrecorded_as_error(rank, e)
        if error is not None:
            raise error from e
        raise
    finally:
        _progress._close_stream()


def _after_task(rank: int, status_dir: str) -> None:
    """The processes a finished task started are ended before the launcher hears it is done; its
    garbage (a collection takes 0.1 s and more) and CUDA cache are freed after, while the pool idles."""
    _end_task_processes()
    if rank == 0:
        with open(os.path.join(status_dir, "modules.pkl"), "wb") as f:
            pickle.dump(_module_files(), f)
    _write_status(status_dir, rank, "done", str(os.getpid()))
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@record
def _pool_worker_entry(first_task: Task, device: str, backend: str | None, launcher_pid: int,
                       inboxes: list[Connection]) -> None:
    """What each process of a pool runs: the first task, then each task its pipe brings, until
    the pipe says stop (None) or closes (the launcher is gone)."""
    _become_worker(launcher_pid)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    inbox = inboxes[rank]
    for other in inboxes:
        if other is not inbox:
            other.close()
    # what every task starts from (not the first launch's status folder, long gone by then)
    env = {k: v for k, v in os.environ.items() if k != _STATUS_DIR_ENV}
    # a fresh worker's intra-op threads: one on a CPU rank (init_process_group's), torch's own else
    threads = 1 if device == "cpu" else torch.get_num_threads()
    task, first = first_task, True
    while task is not None:
        rank_dir = _rank_dir(task.run_dir, rank)
        _point_output_at(rank_dir)
        _reset_process_state(task, env, rank_dir, threads)
        outcome = _run_task(task, rank, world, first, device, backend)
        if outcome == "abandon":  # as a cold worker whose peer failed: end, the agent ends the rest
            return
        if outcome == "retire":  # so the launcher takes this worker's end for no death
            _write_status(task.status_dir, rank, "retiring", "")
        _after_task(rank, task.status_dir)
        if outcome == "retire":  # the task destroyed the process group: no further task can run
            return
        first = False
        try:
            task = inbox.recv()
        except (EOFError, OSError):
            task = None
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# In the launcher


def pool_key(nprocs: int, device: str, backend: str | None, start_method: str) -> tuple:
    """What a pool must match to run a launch: ranks, device, backend, the environment the
    workers were started with (what they read at import, e.g. $MUONLAB_DEVICE or thread counts)
    and the start method (a launch asking for spawned workers gets them).
    Variables elastic and launch set while a launch runs are left out, and pytest's
    PYTEST_CURRENT_TEST, which it rewrites for every test (a suite's launches share a pool)."""
    left_out = (*_LAUNCH_ENV, "PYTEST_CURRENT_TEST")
    env = sorted((k, v) for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_") and k not in left_out)
    digest = hashlib.sha1(repr(env).encode()).hexdigest()
    return (nprocs, device, backend, digest, start_method)


class WorkerPool:
    """The running workers of one warm launch and elastic's agent that started them.

    Created by the first launch with its first task (:meth:`start`); later launches hand it tasks
    (:meth:`send`). ``outcome`` is what the agent thread ended with (set when ``agent_done``).
    """

    def __init__(self, key: tuple, config, device_backend: tuple[str, str | None]):
        self.key = key
        self.nprocs = key[0]
        self.config = config
        self.run_id = config.run_id
        self.device_backend = device_backend
        self.agent_done = threading.Event()
        self.outcome: dict[str, Any] = {}
        self.pids: set[int] = set()
        self.rank_pids: dict[int, int] = {}
        self.started_wall = time.time()
        self.module_files: dict[str, float] = {}
        self.tasks_run = 0
        self.busy = True
        self.alive = True
        self.last_run_dir: str | None = None
        self._readers, self._writers = zip(*(Pipe(duplex=False) for _ in range(self.nprocs)))

    def start(self, first_task: Task) -> None:
        """Start elastic's agent (on a thread) with the workers' entry and the first task."""
        from torch.distributed.launcher.api import elastic_launch

        args = (first_task, *self.device_backend, os.getpid(), list(self._readers))

        def run_agent() -> None:
            try:
                self.outcome["values"] = elastic_launch(self.config, _pool_worker_entry)(*args)
            except BaseException as e:  # handed to the launching thread
                self.outcome["error"] = e
            finally:
                self.agent_done.set()

        _WORKER_STARTS.watch(self.run_id)
        threading.Thread(target=run_agent, name=_AGENT_THREAD + self.run_id, daemon=True).start()

    def send(self, task: Task) -> None:
        for writer in self._writers:
            writer.send(task)

    def pids_of(self, status_dir: str | None = None) -> set[int]:
        """The pool's worker processes: those elastic started, and those that wrote their pid."""
        pids = _WORKER_STARTS.pids(self.run_id) | self.pids
        if status_dir is not None:
            pids |= _worker_pids(status_dir, self.run_id)
        return pids

    def stale(self) -> str | None:
        """Why the workers may not run what the caller now has on disk (None: they may)."""
        for path, mtime in self.module_files.items():
            try:
                changed = os.stat(path).st_mtime != mtime
            except OSError:
                changed = True
            if changed:
                return f"{path} changed since the workers imported it"
        return None

    def finished_task(self, status_dir: str) -> None:
        """Note what a successful task's workers left: their pids and module files; a pool whose
        task destroyed the process group ends (its workers are leaving) and is not reused."""
        self.pids |= _worker_pids(status_dir, self.run_id)
        for rank in _ranks_in(status_dir, "pid"):
            try:
                self.rank_pids[rank] = int(_status_text(status_dir, rank, "pid"))
            except ValueError:
                pass
        if _ranks_in(status_dir, "retiring"):
            self.alive = False
        try:
            with open(os.path.join(status_dir, "modules.pkl"), "rb") as f:
                self.module_files = pickle.load(f)
        except (OSError, pickle.UnpicklingError, EOFError):
            self.module_files = {}
        self.tasks_run += 1

    def ended_workers(self) -> dict[int, int]:
        """{rank: pid} of the workers that have ended (or are zombies) while the pool idles: a
        pool with one is dead (its process group broken), whatever elastic's agent has noticed yet."""
        return {rank: pid for rank, pid in sorted(self.rank_pids.items()) if _process_gone(pid)}

    def death_text(self, ended: dict[int, int]) -> str:
        """"the worker of rank 1 (pid 123, killed by signal SIGKILL)": the ranks in ``ended``, with
        how each ended where elastic's agent has said. Where the agent has ended the others too
        (SIGTERM), the ranks that ended otherwise are the ones named."""
        error = self.outcome.get("error")
        failures = getattr(error, "failures", {}) if self.agent_done.is_set() else {}

        def how(rank: int) -> str:
            failure = failures.get(rank)
            if failure is None:
                return ""
            if failure.exitcode < 0:
                return f", killed by signal {failure.signal_name()}"
            return f", exit code {failure.exitcode}"

        first = {rank: pid for rank, pid in ended.items() if how(rank) != ", killed by signal SIGTERM"}
        named = first or ended
        parts = [f"{rank} (pid {pid}{how(rank)})" for rank, pid in named.items()]
        return ("the worker of rank " if len(parts) == 1 else "the workers of ranks ") + ", ".join(parts)

    def kill(self, status_dir: str | None = None, agent_ends: bool = True) -> None:
        """End the pool at once (after a failure, a timeout, an interrupt): the cold launch's
        SIGTERM-then-SIGKILL of every worker and its process group."""
        self.alive = False
        _stop_workers(lambda: self.pids_of(status_dir), self.agent_done, agent_ends=agent_ends)
        self._closed(status_dir)

    def shutdown(self) -> float:
        """End an idle pool in order: each worker leaves its loop and destroys its process group,
        elastic's agent sees them all succeed. Returns the seconds it took."""
        started = time.monotonic()
        self.alive = False
        for writer in self._writers:
            try:
                writer.send(None)
            except (OSError, ValueError):
                pass
        if not self.agent_done.wait(_TERM_GRACE_S):
            _stop_workers(self.pids_of, self.agent_done)
        self._closed(None)
        return time.monotonic() - started

    def _closed(self, status_dir: str | None) -> None:
        _end_process_groups(self.pids_of(status_dir))
        _WORKER_STARTS.forget(self.run_id)
        for conn in (*self._writers, *self._readers):
            conn.close()
        global _POOL
        with _POOL_LOCK:
            if _POOL is self:
                _POOL = None


_POOL_LOCK = threading.Lock()
_POOL: WorkerPool | None = None
_RESERVED = False  # a launch is starting the next pool: the others run cold meanwhile


def take_pool(key: tuple) -> tuple[WorkerPool | None, str]:
    """The idle pool matching ``key``, marked busy, and why a new one is needed otherwise:
    returns (pool, "") or (None, reason), the caller then holding the right to start the next
    pool (:func:`register` it, or :func:`unreserve` if it does not get that far). Reason "busy":
    another thread's launch holds the pool or is starting one, and this launch runs cold."""
    global _POOL, _RESERVED
    with _POOL_LOCK:
        pool = _POOL
        if _RESERVED or (pool is not None and pool.busy):
            return None, "busy"
        # Checked here, before a task is handed out: a worker killed while idle breaks the process
        # group, and the task would fail on it (blamed on the function it never ran), the agent
        # noticing only a moment later.
        ended = pool.ended_workers() if pool is not None and pool.alive else {}
        if pool is not None and pool.alive and not ended and not pool.agent_done.is_set() and pool.key == key:
            if pool.stale() is None:
                pool.busy = True
                return pool, ""
        _POOL, _RESERVED = None, True
    if pool is None:
        return None, "no pool"
    died = pool.alive and (ended or "error" in pool.outcome)
    try:
        with _quiet_elastic(pool.last_run_dir):
            if died:  # every process of it ended, reaped, its agent returned
                pool.kill()
            else:
                pool.shutdown()
    except BaseException:
        unreserve()
        raise
    if died:
        reason = f"{pool.death_text(ended or pool.ended_workers())} ended while the pool was idle"
        # one line, as the launch's other events; stacklevel: the caller of launch()
        warnings.warn(f"muonlab launch: warm workers restarted: {reason}; the pool was shut down and "
                      f"this launch starts new workers", RuntimeWarning, stacklevel=5)
        return None, reason
    reason = "the pool's workers had ended" if pool.agent_done.is_set() or not pool.alive else (
        "other ranks, device, backend, environment or start method" if pool.key != key else pool.stale())
    return None, reason


def register(pool: WorkerPool) -> None:
    """``pool`` is the pool now (started by the launch that :func:`take_pool` let start one)."""
    global _POOL, _RESERVED
    with _POOL_LOCK:
        _POOL, _RESERVED = pool, False


def unreserve() -> None:
    global _RESERVED
    with _POOL_LOCK:
        _RESERVED = False


def release(pool: WorkerPool) -> None:
    """A launch is done with ``pool`` (alive: kept for the next launch)."""
    with _POOL_LOCK:
        pool.busy = False


class _quiet_elastic:
    """elastic's launcher-side log lines while a pool shuts down go to its last run's launcher.log
    (never to the notebook), as during a launch."""

    def __init__(self, run_dir: str | None):
        self.run_dir = run_dir
        self.loggers = [logging.getLogger(name) for name in _ELASTIC_LOGGERS]

    def __enter__(self):
        self.saved = [lg.propagate for lg in self.loggers]
        try:
            self.handler: logging.Handler = logging.FileHandler(os.path.join(self.run_dir, LAUNCHER_LOG))
        except (OSError, TypeError):
            self.handler = logging.NullHandler()
        for lg in self.loggers:
            lg.addHandler(self.handler)
            lg.propagate = False
        return self

    def __exit__(self, *exc):
        for lg, flag in zip(self.loggers, self.saved):
            lg.removeHandler(self.handler)
            lg.propagate = flag
        self.handler.close()


def shutdown_workers() -> float | None:
    """End the warm workers :func:`~muonlab.launcher.launch` keeps (if any); the next launch
    starts fresh ones. Returns the seconds the shutdown took, or None when there was no pool.
    A pool running a launch on another thread is left to it. Called at interpreter exit too."""
    global _POOL
    with _POOL_LOCK:
        pool = _POOL
        if pool is None or pool.busy:
            return None
        _POOL = None
    with _quiet_elastic(pool.last_run_dir):
        return pool.shutdown()


def pool_info() -> dict | None:
    """The warm pool's state, for a notebook or a test: ranks, worker pids, tasks run, busy."""
    with _POOL_LOCK:
        pool = _POOL
        if pool is None:
            return None
        return {"nprocs": pool.nprocs, "device": pool.key[1], "backend": pool.key[2],
                "pids": sorted(pool.pids), "tasks_run": pool.tasks_run, "busy": pool.busy}


atexit.register(shutdown_workers)



def _results_on_disk(status_dir: str, nprocs: int) -> dict[int, bytes]:
    out = {}
    for rank in range(nprocs):
        with open(os.path.join(status_dir, f"rank{rank}.result"), "rb") as f:
            out[rank] = f.read()
    return out


_TASK_POLL_S = 0.01
"""How often the launcher looks at a warm task's status files: its end is noticed within this."""
_TICK_S = 0.25


def wait_for_task(pool: WorkerPool, status_dir: str, limits: tuple[float, float],
                  tick: Callable[[], None]) -> dict[str, Any]:
    """Wait for the pool's current task, as ``_run_agent`` waits for a cold launch. Returns
    {"values": {rank: pickled result}} (the pool is kept), or, with the pool ended, what the agent
    ended with ({"error": ...}), {"timed_out": ...} or {"vanished": [...]}. A Ctrl-C ends the pool
    and propagates."""
    nprocs = pool.nprocs
    timeout_s, startup_timeout_s = limits
    phase, deadline = "startup", time.monotonic() + startup_timeout_s
    gone_since: dict[int, float] = {}
    next_tick = 0.0
    try:
        while True:
            now = time.monotonic()
            if now >= next_tick:
                tick()
                next_tick = now + _TICK_S
            if pool.agent_done.is_set():  # a worker failed or ended: the agent ended the pool
                break
            if len(_ranks_in(status_dir, "done")) == nprocs and not _ranks_in(status_dir, "failed"):
                return {"values": _results_on_disk(status_dir, nprocs)}
            if phase == "startup" and len(_ranks_in(status_dir, "ready")) == nprocs:
                phase, deadline = "run", time.monotonic() + timeout_s
            vanished = _vanished(status_dir, gone_since)
            if vanished:
                pool.kill(status_dir, agent_ends=False)
                return {"vanished": vanished}
            if now >= deadline:
                report = _timeout_report(status_dir, nprocs, phase)
                pool.kill(status_dir)
                return {"timed_out": report}
            pool.agent_done.wait(_TASK_POLL_S)
    except BaseException:  # KeyboardInterrupt in a notebook: the pool goes down with the launch
        pool.kill(status_dir)
        raise
    pool.alive = False
    pool._closed(status_dir)
    outcome = dict(pool.outcome)
    if "values" in outcome:  # every worker ended without an error, yet not every rank finished
        missing = sorted(set(range(nprocs)) - _ranks_in(status_dir, "done"))
        return {"vanished": missing or list(range(nprocs))}
    return outcome
