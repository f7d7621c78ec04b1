"""Start distributed worker processes from a notebook or a script, or under torchrun.

One machine, from a notebook or a script::

    from muonlab.distributed import launch
    from mywork import train          # a function in an importable .py module

    results = launch(train, 4, steps=100)      # {rank: return value of train on that rank}

``launch`` starts ``nprocs`` processes through torch.distributed's own elastic launcher
(``elastic_launch``, a static rendezvous on a free port of 127.0.0.1; start method "forkserver"
where the platform has it, else "spawn", see ``start_method``),
initialises the default process group in each by the rule of :mod:`muonlab.distributed.device`
(rank ``r`` on ``cuda:r`` with NCCL when CUDA has a GPU per process, else gloo on the CPU;
``device="cpu"`` or ``$MUONLAB_DEVICE=cpu`` keeps CPU workers on a GPU node),
calls ``fn(*args, **kwargs)`` and hands back each rank's return value. Each rank's stdout and stderr
go to ``runs/<name>/rank<r>/`` (kept after the call), never to the notebook; what the workers report
with :func:`~muonlab.distributed.progress.report_progress` is shown while the call waits (a bar and
a live loss plot in a notebook, see :mod:`muonlab.distributed.progress`). A worker that raises gives a
:class:`WorkerError` carrying the worker's traceback and the path of its log;
a launch whose workers are not all up (process group initialised) within ``startup_timeout_s``, or
that runs past ``timeout_s`` seconds after that, is stopped, its processes killed, and gives a
:class:`WorkerTimeout` naming the phase. In a notebook kernel the workers are kept for the next
launch on the same ranks (warm workers, :mod:`muonlab.distributed.warm`; ``warm=`` and
:func:`shutdown_workers`). The worker function must live in a module the children can
import: a function defined in a notebook cell (module ``__main__``), a lambda or a nested function
is refused before anything starts. The children get the caller's ``sys.path``, so a ``.py`` file
next to the notebook is found, and its ``os.environ`` as it is at the launch. The children re-run the
caller's main script before they start (either start method): in a script, call ``launch`` under
``if __name__ == "__main__":`` (launch says so if it is not).

Several nodes (GPUs), with the same worker functions, under torchrun::

    torchrun --nnodes=N --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT \\
        -m muonlab.distributed.launch mypkg.mymod:train [ARG ...]

Here ``python -m muonlab.distributed.launch MODULE:FUNCTION [ARG ...]`` (:func:`worker_main`) runs in
every process torchrun starts: it initialises the default process group from torchrun's environment
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; NCCL on ``cuda:LOCAL_RANK`` when CUDA
has a GPU per local rank, else gloo), calls ``FUNCTION(*ARGS)`` with the remaining command-line
words as strings, and destroys the group. ``--backend``, ``--device`` and ``--timeout-s`` may come before
``MODULE:FUNCTION``. From Python, :func:`run_worker` does the same for a function object. Errors are
recorded with torch.distributed.elastic's ``record``, so torchrun's summary shows the traceback.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import gc
import glob
import importlib
import json
import logging
import multiprocessing
import os
import pickle
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import uuid
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch.distributed as dist
from torch.distributed.elastic.events import Event
from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from ..processes import proc_stat
from . import progress as _progress
from .device import DEVICE_CHOICES, DEVICE_ENV, check_backend, choose_device, init_process_group

try:
    import fcntl
except ImportError:  # not on Windows: there a run directory is not locked
    fcntl = None

__all__ = ["WorkerBaseException", "WorkerError", "WorkerTimeout", "launch", "run_worker", "shutdown_workers",
           "worker_main"]

# Seconds a signalled worker gets to exit (and elastic's agent to notice) before the next step.
_TERM_GRACE_S = 5.0
_AGENT_JOIN_S = 30.0


class WorkerError(RuntimeError):
    """One or more worker processes of :func:`launch` failed.

    ``failures`` maps each failed rank to its error text (the worker's traceback where Python
    recorded one); ``ranks`` lists those ranks, the first observed failure first; ``run_dir`` is
    the launch's run directory (each rank's logs in ``rank<r>/``), None if there was none.
    """

    def __init__(self, message: str, failures: dict[int, str] | None = None, run_dir: str | None = None):
        super().__init__(message)
        self.failures = dict(failures or {})
        self.ranks = list(self.failures)
        self.run_dir = run_dir


class WorkerTimeout(WorkerError):
    """:func:`launch` ran out of time; ``ranks`` are the ranks that hung: still running their
    function then and not inside a collective (a rank that had returned and was waiting for the
    others is not among them). ``waiting`` are the ranks that were running but inside a
    collective, waiting for those; where every running rank was inside one (ranks in different
    collectives), ``ranks`` names them all and ``waiting`` is empty.

    ``phase`` says which limit expired: ``"startup"`` (``startup_timeout_s``: not every rank had
    initialised its process group) or ``"run"`` (``timeout_s``, counted from when every rank had).
    """

    def __init__(self, message: str, ranks: list[int], phase: str = "run", run_dir: str | None = None,
                 waiting: list[int] | None = None):
        super().__init__(message, {rank: "still running at the timeout" for rank in ranks}, run_dir)
        self.phase = phase
        self.waiting = list(waiting or [])


class WorkerBaseException(RuntimeError):
    """What a launched worker raises in place of a BaseException that is neither an Exception nor
    SystemExit (KeyboardInterrupt, GeneratorExit, a class of the user's), chained to it: elastic
    records no error for those, and torch's spawn wrapper ends a process that raised
    KeyboardInterrupt with exit code 0, as if it had succeeded, so the launcher learnt of the
    failure only when it gave up waiting for the rank's result. Raised as this, it is recorded
    as any error is (the traceback names the original type) and the process exits with code 1.
    """


# --------------------------------------------------------------------------------------------
# Inside a worker


def _call(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    # sys.exit(0) or sys.exit() ends a script successfully; in a worker it counts as returning
    # None, so the rank still takes part in the teardown below instead of vanishing from it.
    try:
        return fn(*args, **kwargs)
    except SystemExit as e:
        if e.code in (0, None):
            return None
        raise


def _teardown(wait_for_peers: bool) -> None:
    # Objects of fn's that hold a process group (a DDP Reducer, in a reference cycle) must die
    # while the group lives: collected after destroy_process_group, gloo's destructor joins a
    # thread that never returns (seen as a worker hanging while pickling its result).
    gc.collect()
    if not dist.is_initialized():  # fn destroyed the group itself, as torchrun scripts end
        return
    try:
        if wait_for_peers:
            # A rank that returns early must not close its connections while slower ranks are
            # still connecting to it (gloo's connectFullMesh then fails on them).
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _call_in_process_group(
    fn: Callable[..., Any],
    device: str | None,
    backend: str | None,
    timeout_s: float,
    args: tuple,
    kwargs: dict,
    on_error: Callable[[], None] | None = None,
    on_ready: Callable[[], None] | None = None,
    startup_timeout_s: float | None = None,
    on_return: Callable[[], bool] | None = None,
) -> Any:
    """``on_return`` (under :func:`launch`) runs once ``fn`` has returned and waits for the other
    ranks itself; it says whether they all returned too (False: one failed, so no barrier)."""
    # Connecting waits for the slowest rank's start-up (importing torch under load can take
    # minutes), so it gets the start-up limit; collectives get timeout_s from then on.
    init_process_group(device, backend, timeout_s=timeout_s, connect_timeout_s=startup_timeout_s)
    if on_ready is not None:
        on_ready()
    try:
        result = _call(fn, args, kwargs)
    except BaseException:
        if on_error is not None:
            on_error()
        _teardown(wait_for_peers=False)
        raise
    _teardown(wait_for_peers=on_return() if on_return is not None else True)
    return result


def _die_with_parent(launcher_pid: int | None = None) -> None:
    """SIGKILL this process when its launcher dies; exit now if it died already.

    If the launching process is killed outright (a notebook kernel restart), its workers would
    otherwise live on. A spawned worker is the launcher's child: Linux's parent-death signal ends
    it, and since that covers only deaths after it is set (spawn's bootstrapping imports torch
    first, seconds or minutes under load), a launcher that died meanwhile is caught by comparing the
    parent's pid. A forkserver's worker is the forkserver's child, and the forkserver outlives the
    launcher while any of its children runs: a thread waits on the launcher's end of the pipe
    multiprocessing keeps open to each child (``parent_process().sentinel``), at EOF from the
    launcher's death on, so a death before this call is caught too.
    """
    if launcher_pid is None:  # not started by launch(): nothing to watch
        return
    if os.getppid() == launcher_pid and sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            pr_set_pdeathsig = 1
            libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
        except Exception:
            pass
    parent = multiprocessing.parent_process()
    if parent is None or parent.pid != launcher_pid:  # not the launcher's: an orphan already
        os._exit(1)
    if os.getppid() != launcher_pid:  # a forkserver's child (or a spawned one whose launcher died)
        threading.Thread(target=_exit_when_gone, args=(parent.sentinel,), name="muonlab-launcher-watch",
                         daemon=True).start()


def _become_worker(launcher_pid: int | None) -> None:
    """What every worker process does first, cold or warm: take the environment launch() handed
    it, lead a process group of its own, end with its launcher, and, forked, behave as a spawned
    worker."""
    _take_launch_env()
    _lead_own_process_group()
    _die_with_parent(launcher_pid)
    _settle_forked_worker()


def _settle_forked_worker() -> None:
    """What a worker forked by the forkserver does to behave as a spawned one.

    Its heap holds every object of the forkserver's imports (torch): the collector's first full
    pass would write to each (copy-on-write faults over the whole heap, a second or more), and a
    failing worker collects in its teardown, so a rank raising alongside another was killed before
    it could record its error. ``gc.freeze()`` moves them out of the collector's sight at once.
    And it ends with ``os._exit``, which skips what code registered with :mod:`atexit` (the
    worker's function, a library); a spawned worker runs that as its interpreter exits. Here
    multiprocessing runs it as it finishes the process, after elastic has taken the result."""
    if multiprocessing.get_start_method(allow_none=True) != "forkserver":
        return
    from multiprocessing import util

    gc.freeze()
    # the handlers run once: running them empties the list (the interpreter's own exit finds none)
    util.Finalize(None, atexit._run_exitfuncs, exitpriority=-1)


def _exit_when_gone(sentinel: int) -> None:
    from multiprocessing.connection import wait

    wait([sentinel])  # returns at EOF: the launcher's end is closed, so the launcher is gone
    os.kill(os.getpid(), signal.SIGKILL)  # as the parent-death signal would: no cleanup to hang in


_ENV_NAMES = "MUONLAB_LAUNCH_ENV_NAMES"
"""A worker's variable (while it starts) listing the names of the environment launch() gave it."""


def _take_launch_env() -> None:
    """Make this worker's environment the one launch() handed it (see :class:`_RunLogs`): a
    forkserver's worker also holds the variables of the caller's environment when the forkserver
    started, which the caller may since have removed."""
    names = os.environ.pop(_ENV_NAMES, None)
    if names is None:  # not started by launch()
        return
    keep = set(names.split("\n"))
    for key in list(os.environ):
        if key not in keep:
            del os.environ[key]


def _lead_own_process_group() -> None:
    """Make this worker the leader of a process group of its own, so the processes it starts
    (``subprocess.Popen``, a data-prep tool) can be ended with it: the launcher signals the whole
    group when the launch ends (see :func:`_end_process_groups`)."""
    if hasattr(os, "setpgrp"):
        os.setpgrp()


def _status_path(status_dir: str, rank: int, kind: str) -> str:
    return os.path.join(status_dir, f"rank{rank}.{kind}")


def _write_status(status_dir: str, rank: int, kind: str, text: str) -> None:
    with open(_status_path(status_dir, rank, kind), "w") as f:
        f.write(text)


_PEER_POLL_S = 0.01


def _wait_for_peers(status_dir: str, num_procs: int) -> bool:
    """Wait until every rank has returned from its function (True) or one has failed or ended
    without returning (False), as their status files say. No clock of its own: the launcher's run
    clock ends a wait for a hung rank. (The teardown barrier's collective timeout used to end it
    about when the launcher's clock ran out, so the hung rank was reported with or without this one,
    or this one as failed, by chance.)"""
    while True:
        returned = _ranks_in(status_dir, "returned")
        if _ranks_in(status_dir, "failed") or _ranks_in(status_dir, "done") - returned:
            return False
        if len(returned) >= num_procs:
            return True
        time.sleep(_PEER_POLL_S)


@record
def _worker_entry(
    payload: bytes,
    device: str,
    backend: str,
    timeouts: tuple[float, float],
    sys_path: list[str],
    status_dir: str,
    launcher_pid: int,
    run_dir: str,
) -> bytes:
    """What each process of :func:`launch` runs: pickled in, pickled out, errors recorded.

    ``device`` is the launcher's choice for every rank ("cpu" or "cuda": ``cuda:LOCAL_RANK``), and
    ``timeouts`` is (collective timeout, start-up limit). Status files in ``status_dir`` tell the
    launcher this rank's pid, when its process group is up ("ready"), that its function returned
    ("returned"; it then waits for the others by these files, see :func:`_wait_for_peers`), a
    sys.exit ("exit"), the time of a failure ("failed") and that it is finished ("done").
    ``report_progress`` appends to ``<run_dir>/rank<r>/progress.jsonl``; a failure's traceback also
    goes to this rank's stderr log there (elastic records it only in error.json). The worker leads a process group of its
    own, which the launcher ends with the launch (:func:`_lead_own_process_group`).
    """
    _become_worker(launcher_pid)
    rank = int(os.environ["RANK"])
    _write_status(status_dir, rank, "pid", str(os.getpid()))
    _progress._open_stream(os.path.join(_rank_dir(run_dir, rank), _progress.PROGRESS_FILE), rank)

    def mark_returned() -> bool:
        stop_watch()
        _write_status(status_dir, rank, "returned", "")
        return _wait_for_peers(status_dir, int(os.environ["WORLD_SIZE"]))

    def mark_failed() -> None:
        # elastic's error files stamp whole seconds. This finer stamp, taken before the process
        # group is destroyed, puts the root cause before the errors it causes on other ranks.
        if not os.path.exists(os.path.join(status_dir, f"rank{rank}.failed")):
            _write_status(status_dir, rank, "failed", repr(time.time()))

    watch: list[_progress._CollectiveWatch] = []

    def mark_ready() -> None:
        _write_status(status_dir, rank, "ready", "")
        watch.append(_progress._CollectiveWatch(_status_path(status_dir, rank, "collective")).start())

    def stop_watch() -> None:  # before the process group goes: the watch reads its counters
        for w in watch:
            w.stop()

    try:
        # The function and its arguments are unpickled only now, after the caller's import path
        # is in place, so an import problem becomes this rank's recorded traceback.
        for entry in reversed(sys_path):
            if entry not in sys.path:
                sys.path.insert(0, entry)
        fn, args, kwargs = pickle.loads(payload)
        result = _call_in_process_group(
            fn, device, backend, timeouts[0], args, kwargs, on_error=lambda: (stop_watch(), mark_failed()),
            on_ready=mark_ready, startup_timeout_s=timeouts[1], on_return=mark_returned,
        )
        return pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException as e:
        mark_failed()
        report_failure(rank, status_dir, e)
        error = unrecorded_as_error(rank, e)
        if error is not None:
            raise error from e
        raise
    finally:
        stop_watch()
        _progress._close_stream()
        _write_status(status_dir, rank, "done", str(os.getpid()))


def report_failure(rank: int, status_dir: str, err: BaseException) -> None:
    """What a failing worker (cold or warm) leaves before re-raising ``err``: for ``sys.exit`` its
    code in words, in the status folder and on stderr (elastic records no traceback for
    SystemExit); for anything else its traceback on stderr."""
    if isinstance(err, SystemExit):
        code = err.code if isinstance(err.code, int) else 1
        text = f"rank {rank} exited with code {code} (sys.exit({err.code!r}) in the worker, before returning)"
        _write_status(status_dir, rank, "exit", text)
        print(text, file=sys.stderr, flush=True)
    else:
        traceback.print_exc()
        sys.stderr.flush()


def unrecorded_as_error(rank: int, err: BaseException) -> WorkerBaseException | None:
    """The :class:`WorkerBaseException` a failing worker raises from ``err`` where elastic would not
    record ``err`` itself; None where it would (an Exception, SystemExit)."""
    if isinstance(err, (Exception, SystemExit)):
        return None
    return WorkerBaseException(f"{type(err).__name__} raised on rank {rank}" + (f": {err}" if str(err) else ""))


def run_worker(
    fn: Callable[..., Any],
    *args: Any,
    backend: str | None = None,
    device: str | None = None,
    timeout_s: float = 1800,
    **kwargs,
) -> Any:
    """Run ``fn(*args, **kwargs)`` in a process started by torchrun (or any env:// launcher).

    Initialises the default process group from the environment by muonlab's device rule
    (:func:`muonlab.distributed.device.choose_device`: NCCL on ``cuda:LOCAL_RANK`` when CUDA has a
    GPU per local rank, else gloo on the CPU; ``device`` or ``$MUONLAB_DEVICE`` override it, and
    ``backend`` overrides the backend only), calls ``fn`` and destroys the group.
    """
    return record(_call_in_process_group)(fn, device, backend, timeout_s, args, kwargs)


def _resolve(target: str) -> Callable[..., Any]:
    module_name, sep, qualname = target.partition(":")
    if not sep or not module_name or not qualname:
        raise ValueError(f"expected MODULE:FUNCTION (e.g. mypkg.mymod:train), got {target!r}")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{target!r} is not callable")
    return obj


@record
def worker_main(argv: list[str] | None = None) -> Any:
    """Entry point of ``python -m muonlab.distributed.launch MODULE:FUNCTION [ARG ...]``."""
    parser = argparse.ArgumentParser(
        prog="python -m muonlab.distributed.launch",
        description="Run MODULE:FUNCTION(*ARGS) in a process group set up from torchrun's environment.",
    )
    parser.add_argument("--backend", default=None, help="nccl or gloo (default: by the device)")
    parser.add_argument("--device", default=None, choices=DEVICE_CHOICES,
                        help=f"auto (default, or ${DEVICE_ENV}): cuda:LOCAL_RANK with a GPU per rank, else cpu")
    parser.add_argument("--timeout-s", type=float, default=1800, help="collective timeout")
    parser.add_argument("target", help="MODULE:FUNCTION, e.g. mypkg.mymod:train")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="passed to FUNCTION as strings")
    ns = parser.parse_args(argv)
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    fn = _resolve(ns.target)
    return run_worker(fn, *ns.args, backend=ns.backend, device=ns.device, timeout_s=ns.timeout_s)


# --------------------------------------------------------------------------------------------
# In the caller


def _check_importable(fn: Callable[..., Any]) -> None:
    target = fn
    while isinstance(target, functools.partial):
        target = target.func
    target = getattr(target, "__func__", target)  # bound methods
    if not callable(target):
        raise TypeError(f"launch() needs a callable, got {type(fn).__name__}")
    module = getattr(target, "__module__", None) or "?"
    qualname = getattr(target, "__qualname__", None) or getattr(target, "__name__", repr(target))
    name = f"{module}.{qualname}"
    if module == "__main__":
        raise ValueError(
            f"launch() cannot run {qualname!r}: it is defined in __main__ (a notebook cell or the "
            f"script being run), which the worker processes cannot import. Move it into an "
            f"importable .py module (e.g. a file next to the notebook) and import it from there."
        )
    if "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(
            f"launch() cannot run {name!r}: a lambda or a function defined inside another function "
            f"cannot be imported by the worker processes. Define it at the top level of an "
            f"importable .py module and import it from there."
        )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# The launcher-side loggers of torch's elastic agent. launch() reports failures itself, as one
# WorkerError naming the rank; elastic's warnings (a traceback per failed worker, each process it
# terminates, signal handlers it cannot install off the main thread), with pids and timestamps,
# go to the run's launcher.log instead of the notebook.
_ELASTIC_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing.spawn")
LAUNCHER_LOG = "launcher.log"


# Names of elastic's agent threads: a launch's launcher.log takes no line from another launch's agent.
_AGENT_THREAD = "muonlab-launch-agent-"
_STATUS_DIR_ENV = "MUONLAB_LAUNCH_STATUS_DIR"
# What elastic's agent and launch() set in os.environ while a launch runs.
_LAUNCH_ENV = ("TORCHELASTIC_SIGNALS_TO_HANDLE", _STATUS_DIR_ENV)


class _SharedSettings:
    """What a launch changes process-wide while it runs: elastic's launcher-side loggers stop
    propagating (each launch adds a handler writing its own launcher.log), and ``_LAUNCH_ENV``.

    Launches on several threads of one process share these, so the first launch in saves what was
    there and the last one out restores it (each saving and restoring on its own would interleave
    and leave the loggers silenced). Meanwhile $MUONLAB_LAUNCH_STATUS_DIR names the status folder of
    the latest launch still running."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._status_dirs: list[str] = []
        self._saved: tuple[dict[str, str | None], list[bool]] = ({}, [])

    @contextmanager
    def held(self, status_dir: str, handler: logging.Handler) -> Iterator[None]:
        loggers = [logging.getLogger(name) for name in _ELASTIC_LOGGERS]
        with self._lock:
            if not self._status_dirs:
                self._saved = ({key: os.environ.get(key) for key in _LAUNCH_ENV}, [lg.propagate for lg in loggers])
            self._status_dirs.append(status_dir)
            # children inherit it while they bootstrap (re-running the main script), before elastic
            # hands them anything. A forkserver's children inherit the value of the launch that
            # started the forkserver, the first: its children re-run the main script as any later one's.
            os.environ[_STATUS_DIR_ENV] = status_dir
            for logger in loggers:
                logger.addHandler(handler)
                logger.propagate = False
        try:
            yield
        finally:
            with self._lock:
                self._status_dirs.remove(status_dir)
                for logger in loggers:
                    logger.removeHandler(handler)
                if self._status_dirs:
                    os.environ[_STATUS_DIR_ENV] = self._status_dirs[-1]
                else:
                    self._restore(loggers)

    def _restore(self, loggers: list[logging.Logger]) -> None:
        env, propagate = self._saved
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        for logger, flag in zip(loggers, propagate):
            logger.propagate = flag


_SHARED = _SharedSettings()


@contextmanager
def _launch_settings(run_dir: str, status_dir: str, run_id: str) -> Iterator[None]:
    """While the launch runs: elastic's log lines of this launch's agent to ``<run_dir>/launcher.log``,
    and the shared settings of :class:`_SharedSettings`."""
    handler = logging.FileHandler(os.path.join(run_dir, LAUNCHER_LOG))
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    own = _AGENT_THREAD + run_id
    handler.addFilter(lambda record: not record.threadName.startswith(_AGENT_THREAD) or record.threadName == own)
    try:
        with _SHARED.held(status_dir, handler):
            yield
    finally:
        handler.close()


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


def _files_in(folder: str, pattern: str) -> list[str]:
    """The paths in ``folder`` matching the glob ``pattern``; ``folder`` is taken literally (a run's
    name may hold glob characters: "exp[1]" must not match the run "exp1")."""
    return glob.glob(os.path.join(glob.escape(folder), pattern))


def _read_error_files(run_dir: str) -> dict[int, str]:
    """Each rank's recorded error: ``<run_dir>/rank<r>/error.json``."""
    errors: dict[int, tuple[float, str]] = {}
    for path in _files_in(run_dir, os.path.join("rank*", "error.json")):
        try:
            rank = int(os.path.basename(os.path.dirname(path))[len("rank"):])
            with open(path) as f:
                data = json.load(f)
        except (ValueError, OSError):
            continue
        text, stamp = _error_text(data)
        if text:
            errors[rank] = (stamp, text)
    return {rank: text for rank, (_, text) in sorted(errors.items(), key=lambda kv: kv[1][0])}


def _error_text(data: Any) -> tuple[str, float]:
    message = data.get("message", "") if isinstance(data, dict) else ""
    if isinstance(message, dict):
        info = message.get("extraInfo", {})
        text = info.get("py_callstack") or message.get("message", "")
        return text.rstrip(), float(info.get("timestamp", 0) or 0)
    return str(message).rstrip(), float(data.get("timestamp", 0) or 0)


def _failure_times(status_dir: str) -> dict[int, float]:
    times = {}
    for path in _files_in(status_dir, "rank*.failed"):
        try:
            with open(path) as f:
                times[int(os.path.basename(path)[len("rank") : -len(".failed")])] = float(f.read())
        except (ValueError, OSError):
            pass
    return times


def _status_text(status_dir: str, rank: int, kind: str) -> str:
    try:
        with open(os.path.join(status_dir, f"rank{rank}.{kind}")) as f:
            return f.read()
    except OSError:
        return ""


def _failure_texts(err: ChildFailedError, run_dir: str, status_dir: str) -> dict[int, str]:
    """Rank -> error text, the first failure first (elastic's root cause where times tie)."""
    recorded = _read_error_files(run_dir)
    texts: dict[int, str] = {}
    killed = set()
    for rank, failure in err.failures.items():
        text = recorded.get(rank) or _error_text(failure.error_file_data)[0]
        if text == "<NONE>":  # elastic's placeholder when the process left no error file
            text = ""
        text = text or _status_text(status_dir, rank, "exit")
        if not text:
            if failure.exitcode < 0:
                text = f"killed by signal {failure.signal_name()} (no Python traceback)"
                killed.add(rank)
            else:
                text = (
                    f"exited with code {failure.exitcode} without a recorded Python exception "
                    f"(see the worker's stderr)"
                )
        texts[rank] = text
    for rank, text in recorded.items():
        texts.setdefault(rank, text)
    # elastic may report only the first process it saw fail; a sys.exit elsewhere is named too
    for rank in sorted(_ranks_in(status_dir, "exit")):
        texts.setdefault(rank, _status_text(status_dir, rank, "exit"))
    times = _failure_times(status_dir)
    first_seen = {rank: i for i, rank in enumerate(texts)}
    # A rank killed by a signal leaves no timestamp, but it is the likeliest root cause: the others
    # usually failed because its connections broke, so it goes first.
    order = sorted(texts, key=lambda r: (r not in killed, times.get(r, float("inf")), first_seen[r]))
    return {rank: texts[rank] for rank in order}


def _fn_name(fn: Callable[..., Any]) -> str:
    target = fn
    while isinstance(target, functools.partial):
        target = target.func
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', repr(target))}"


def _logs_line(run_dir: str, rank: int | None = None) -> str:
    if rank is None:
        return f"full logs: {run_dir}{os.sep} (rank<r>{os.sep}stdout.log, stderr.log; {LAUNCHER_LOG})"
    return (f"full logs: {os.path.join(_rank_dir(run_dir, rank), 'stderr.log')} "
            f"(every rank's: {run_dir}{os.sep})")


def _worker_error(fn: Callable[..., Any], num_procs: int, texts: dict[int, str], run_dir: str) -> WorkerError:
    first, *others = texts
    head = f"rank {first} of {num_procs} failed in {_fn_name(fn)}"
    if others:
        label = "rank" if len(others) == 1 else "ranks"
        head += f"; {label} {', '.join(map(str, others))} failed after it"
    sections = [f"--- rank {rank} ---\n{text}" for rank, text in texts.items()]
    return WorkerError("\n".join([head, _logs_line(run_dir, first), *sections]), texts, run_dir)


def _timeout_message(fn: Callable[..., Any], num_procs: int, limits: tuple[float, float], timed_out: dict) -> str:
    def ranks(group: list[int]) -> str:
        return ("rank " if len(group) == 1 else "ranks ") + ", ".join(map(str, group))

    running, ready = timed_out["running"], timed_out["ready"]
    head = f"launch of {_fn_name(fn)} on {num_procs} processes"
    if timed_out["phase"] == "startup":
        waiting = [rank for rank in range(num_procs) if rank not in ready]
        what = (f"did not start within startup_timeout_s={limits[1]:g} s: {ranks(waiting)} had not "
                f"initialised the process group (still importing, or stuck connecting)")
    else:
        still = f"{ranks(running)} still running" if running else "no rank still running"
        if timed_out.get("waiting"):
            still += (f", not inside a collective; {ranks(timed_out['waiting'])} waited for "
                      f"{'it' if len(running) == 1 else 'them'} inside one")
        what = (f"timed out after {limits[0]:g} s (timeout_s, counted from when every rank had "
                f"initialised its process group); {still}")
    return f"{head} {what}; all worker processes have been killed"


def _ranks_in(status_dir: str, kind: str) -> set[int]:
    ranks = set()
    for path in _files_in(status_dir, f"rank*.{kind}"):
        try:
            ranks.add(int(os.path.basename(path)[len("rank") : -len(kind) - 1]))
        except ValueError:
            pass
    return ranks


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


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    *args: Any,
    backend: str | None = None,
    device: str | None = None,
    timeout_s: float = 300,
    startup_timeout_s: float = 600,
    name: str | None = None,
    progress: bool | None = None,
    warm: bool | None = None,
    start_method: str | None = None,
    **kwargs: Any,
) -> dict[int, Any]:
    """Run ``fn(*args, **kwargs)`` in ``nprocs`` new local processes; return ``{rank: result}``.

    Each process has the default process group initialised by muonlab's device rule
    (:mod:`muonlab.distributed.device`): ``device=None`` (else ``$MUONLAB_DEVICE``, else "auto")
    puts rank ``r`` on ``cuda:r`` with NCCL when CUDA has at least ``nprocs`` GPUs, else on the CPU
    with gloo; ``device="cpu"`` asks for CPU/gloo workers on any machine, ``device="cuda"`` for GPU
    workers (an error if there are too few GPUs). ``backend`` overrides the backend only. The
    collective timeout is ``timeout_s``; CPU workers use one intra-op thread; nothing is seeded.
    ``backend``, ``device``, the timeouts, ``name`` and ``progress`` are launch's own keywords, not
    passed to ``fn``. ``fn``, the arguments and the return values are pickled. A worker that
    calls ``sys.exit(0)`` (or ``sys.exit()``) counts as returning None; ``sys.exit(n)`` with
    ``n != 0`` is a failure ("rank R exited with code n"). Before returning, the ranks wait for each
    other (until every rank has returned, then a barrier), so a fast rank never closes connections a
    slow one still needs; a worker that destroys the process group itself (as torchrun scripts end)
    skips the barrier. That wait has no clock of its own: ``timeout_s`` ends it, and a rank waiting
    there is not named by the WorkerTimeout.

    Two clocks: the workers have ``startup_timeout_s`` seconds from being started until every rank
    has initialised its process group (start-up imports torch, which can take minutes on a loaded
    machine), and ``timeout_s`` seconds from then on to finish.

    Each launch keeps a run directory, ``runs/<name>/`` under the current directory (or under
    ``$MUONLAB_RUNS_DIR``): ``rank<r>/stdout.log``, ``stderr.log``, ``error.json`` and
    ``progress.jsonl`` per rank, and ``launcher.log`` (torch's elastic agent). ``name`` defaults to
    the function's name and the time (``train_worker-20260101-120000``); a given name is reused,
    its previous logs replaced, but not while another launch (in any process) runs under it: that
    is refused. The launch's own bookkeeping lives in the run directory too (``.status/``, removed
    when the launch ends, ``.lock``), so nothing is left elsewhere if the caller is killed.

    Each worker leads a process group of its own: processes it starts (``subprocess.Popen``) are
    ended with the launch, however it ends (SIGTERM, then SIGKILL after a few seconds). A process
    meant to outlive the launch must start a session of its own (``start_new_session=True``).

    Workers report steps with
    :func:`muonlab.distributed.progress.report_progress`; ``progress`` shows them while the call
    waits: None (default) shows a bar and a live loss plot in a notebook and nothing elsewhere,
    True a text bar on stderr outside a notebook, False nothing. The bar names the phase ("ranks
    up k/N", "connecting", "no step yet", "tearing down") and the step rate the workers' own
    timestamps give; the summary line it leaves says where the time went, and so does
    ``<run dir>/launch.json`` (:func:`last_launch_info`): ``startup_s`` (until every rank had its
    process group), ``first_step_s`` (until every rank had reported a step), ``teardown_s`` (from
    the last rank's return to the call's), ``total_s``, and ``workers`` ("cold", "new warm",
    "reused warm").

    Warm workers (``warm``): None (default) means ``$MUONLAB_WARM_WORKERS`` where it is set ("1"
    warm, "0" cold: for a script or test suite that launches again and again), else warm in a
    notebook kernel and cold elsewhere; True or False asks for either anywhere. A warm launch
    leaves its workers running, their process group connected, and the next warm launch on the
    same ``nprocs``, device, backend and environment (``os.environ``) hands them its function
    instead of starting processes: its first step comes within a fraction of a second instead of
    seconds (see
    benchmarks/results/launch.md). Everything above holds for a warm launch too (its own run
    directory, logs and progress stream, both clocks, the processes its function starts ended with
    it, a WorkerError or WorkerTimeout naming the rank); a warm launch that fails, times out or is
    interrupted ends its workers, so the next one starts fresh. A worker of the idle pool that
    died meanwhile (killed, out of memory) is noticed before the next launch hands out its
    function: that launch ends the pool and starts new workers, with a RuntimeWarning saying so.
    Another ``nprocs``, device, backend or environment, or a change on disk to a module the workers
    imported (e.g. the .py file next to the notebook), ends the idle workers and starts new ones. Between launches each warm worker is
    reset to what a fresh one would see (environment, working directory, default dtype, grad mode,
    intra-op threads, torch's random generators seeded anew); module-level state of the
    function's own modules, and process subgroups it made, live on, as in any long-lived process. The workers end with the interpreter (``atexit``;
    if the kernel is killed, with it) or on :func:`shutdown_workers`. Why not warm everywhere:
    outside a kernel a launch is usually a script's one call, where workers left running buy
    nothing and a caller may count on no process outliving the call; in a kernel, launching again
    and again on the same ranks is the common case and the kernel's life bounds the workers'.
    A launch on another thread while the warm workers are busy runs cold.

    ``start_method``: how the worker processes start. None (default) means "forkserver" where the
    platform has it (Linux) and its socket's path fits in the temporary folder (``TMPDIR``; Linux
    takes 107 bytes), else "spawn". A spawned worker is a fresh interpreter that imports
    torch itself (seconds of CPU per worker, minutes on a loaded machine); a forkserver's worker is
    forked from multiprocessing's forkserver, one per launching process, started at its first
    forkserver launch, which imports torch and torch.distributed once
    (:data:`FORKSERVER_PRELOAD`): its workers are up in about a second. (The forkserver then idles
    for the caller's lifetime, holding its imports' memory, a few hundred MB.) Both kinds import muonlab,
    ``fn``'s module and the caller's main script afresh, from disk, and get the caller's
    ``sys.path``, working directory and ``os.environ`` as they are at the launch; both end when the
    caller dies. (Variables torch reads while it is imported take the values the forkserver
    started with: to change those, launch with "spawn".) A warm pool serves launches of its own
    start method only.

    Raises:
        ValueError: ``fn`` is not importable by the children (defined in ``__main__``, e.g. a
            notebook cell, a lambda, or a nested function), ``nprocs < 1``, ``warm`` not None/True/False
            (or, for None, ``$MUONLAB_WARM_WORKERS`` set to other than "0" or "1"), ``start_method`` not
            None, "forkserver" or "spawn" (or not available here, or "forkserver" whose socket path
            would not fit in the temporary folder), a timeout is not a
            positive number of seconds up to ``MAX_TIMEOUT_S``, ``backend`` is not None, "gloo" or
            "nccl", ``device`` is not "auto"/"cpu"/"cuda", ``device="cuda"`` with fewer GPUs than
            ``nprocs``, ``backend="nccl"`` for CPU workers, or ``name`` is in use by a launch still
            running; nothing started.
        RuntimeError: ``device="cuda"`` without CUDA (nothing started), or called while a spawned
            worker re-runs a script that calls ``launch`` outside ``if __name__ == "__main__":``
            (the parent then raises WorkerError saying so).
        WorkerError: a worker raised, died or exited with a nonzero code; the message names the
            rank(s), the path of the first one's log, and holds the traceback(s). A BaseException
            that is not an Exception (KeyboardInterrupt in a worker) is recorded as a
            :class:`WorkerBaseException` naming its type, and fails the launch as soon.
        WorkerTimeout: a clock ran out; ``phase`` and the message say which ("startup" or "run")
            and name the ranks that hung: still in their function and not inside a collective
            (ranks inside one, waiting for those, are its ``waiting``). All worker processes have
            been ended when either error is raised.
    """
    _refuse_in_spawn_bootstrap()
    _check_importable(fn)
    _check_launch_args(nprocs, backend, {"timeout_s": timeout_s, "startup_timeout_s": startup_timeout_s},
                       name, progress)
    if warm is not None and not isinstance(warm, bool):
        raise ValueError(f"warm must be None (${WARM_ENV}, else warm in a notebook kernel and cold "
                         f"elsewhere), True or False, got {warm!r}")
    warm = _warm_by_default() if warm is None else warm
    start_method = _start_method(start_method)
    # Decided here, once, so a bad choice fails before anything starts and every rank agrees;
    # each worker then takes cuda:LOCAL_RANK (or the CPU) by the same rule.
    chosen = choose_device(device, local_rank=0, local_world_size=nprocs).type
    check_backend(chosen, backend, "0")
    try:
        payload = pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:
        raise TypeError(f"launch() could not pickle {_fn_name(fn)} and its arguments: {e}") from e

    run_dir, lock = _claim_run_dir(fn, name, nprocs)
    try:
        return _launch_in(run_dir, fn, nprocs, payload, (chosen, backend),
                          (float(timeout_s), float(startup_timeout_s)), name or _short_name(fn), progress,
                          warm, start_method)
    finally:
        lock.close()  # the run directory is free for the next launch under its name


WARM_ENV = "MUONLAB_WARM_WORKERS"
"""``launch(warm=None)``'s choice where set: "1" warm workers, "0" cold (see :func:`launch`)."""


def _warm_by_default() -> bool:
    """``warm=None``: ``$MUONLAB_WARM_WORKERS`` where set, else whether this is a notebook kernel."""
    value = os.environ.get(WARM_ENV)
    if value is None:
        return _progress.in_notebook_kernel()
    if value not in ("0", "1"):
        raise ValueError(f'${WARM_ENV} must be "1" (warm workers) or "0" (cold) where set, got {value!r}')
    return value == "1"


MAX_TIMEOUT_S = 365 * 24 * 3600.0
"""The longest ``timeout_s`` or ``startup_timeout_s`` launch() takes, a year: anything longer is a
typo (and past about 2.7 million years, more than the workers' ``timedelta`` can hold)."""
BACKENDS = ("gloo", "nccl")
"""The ``backend`` names launch() takes (None: the device's, by muonlab's device rule)."""


def _check_launch_args(nprocs: int, backend: str | None, timeouts: dict[str, float], name: str | None,
                       progress: bool | None) -> None:
    """launch()'s own keywords, checked before anything starts (``device`` by the device rule)."""
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive int, got {nprocs!r}")
    if nprocs > MAX_PROCS:  # a typo would otherwise make that many run folders, then processes
        raise ValueError(f"nprocs={nprocs} is more processes than launch() starts on one machine "
                         f"(at most {MAX_PROCS}: muonlab.distributed.launch.MAX_PROCS)")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be None (the device's: nccl on GPUs, gloo on the CPU), 'gloo' or "
                         f"'nccl', got {backend!r}")
    for keyword, value in timeouts.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ValueError(f"{keyword} must be a positive number of seconds, got {value!r}")
        if value > MAX_TIMEOUT_S:
            raise ValueError(f"{keyword}={value:g} s is longer than launch() waits (at most "
                             f"{MAX_TIMEOUT_S:g} s, a year: muonlab.distributed.launch.MAX_TIMEOUT_S)")
    if progress is not None and not isinstance(progress, bool):
        raise ValueError(f"progress must be None, True or False, got {progress!r}")
    _check_run_name(name)


def _launch_in(run_dir: str, fn: Callable[..., Any], nprocs: int, payload: bytes, device_backend: tuple,
               limits: tuple[float, float], label: str, progress: bool | None, warm: bool,
               start_method: str) -> dict[int, Any]:
    """launch()'s run in its claimed run directory: run the workers (fresh ones, or the warm pool's),
    wait, hand back their results or the error; whatever happened, end what the workers started,
    record where the time went (``launch.json``) and drop the status files."""
    started_wall = time.time()
    status_dir = os.path.abspath(os.path.join(run_dir, STATUS_DIR))  # made empty by _claim_run_dir
    sys_path = [os.getcwd() if entry == "" else entry for entry in sys.path]
    up_already = [0]  # ranks up before this launch began: all of a reused warm pool's
    monitor = _progress.ProgressMonitor(label, [_rank_dir(run_dir, rank) for rank in range(nprocs)],
                                        lambda: _phase(status_dir, nprocs, up_already[0]), _display_for(progress))
    failed, workers = True, "cold"
    try:
        if warm:
            workers = "warm"  # until _run_warm says which
            outcome, workers = _run_warm(nprocs, payload, device_backend, limits, (run_dir, status_dir),
                                         sys_path, monitor.poll, up_already, start_method)
        else:
            outcome = _run_cold(nprocs, payload, device_backend, limits, (run_dir, status_dir), sys_path,
                                monitor.poll, start_method)
        results = _results(fn, nprocs, limits, outcome, (run_dir, status_dir))
        failed = False
        return results
    finally:
        monitor.read()  # the last steps, for the first step's time
        timings = _timings(status_dir, nprocs, monitor.state, started_wall, workers)
        timings["teardown_s"] = _since(timings.pop("last_return_wall"))
        timings["total_s"] = time.time() - started_wall
        monitor.close(failed, timings)
        _write_launch_info(run_dir, dict(timings, nprocs=nprocs, failed=failed))
        shutil.rmtree(status_dir, ignore_errors=True)


def _run_cold(nprocs: int, payload: bytes, device_backend: tuple, limits: tuple[float, float],
              dirs: tuple[str, str], sys_path: list[str], tick: Callable[[], None],
              start_method: str) -> dict[str, Any]:
    """Fresh workers for this launch alone, through elastic's agent; every process they started
    ended before it returns."""
    run_dir, status_dir = dirs
    config = _launch_config(nprocs, limits[1], run_dir, start_method)
    entry_args = (payload, *device_backend, limits, sys_path, status_dir, os.getpid(), os.path.abspath(run_dir))
    _WORKER_STARTS.watch(config.run_id)
    try:
        with _launch_settings(run_dir, status_dir, config.run_id):
            return _run_agent(config, entry_args, limits, status_dir, tick)
    finally:
        _end_process_groups(_worker_pids(status_dir, config.run_id))
        _WORKER_STARTS.forget(config.run_id)


def _run_warm(nprocs: int, payload: bytes, device_backend: tuple, limits: tuple[float, float],
              dirs: tuple[str, str], sys_path: list[str], tick: Callable[[], None],
              up_already: list[int], start_method: str) -> tuple[dict[str, Any], str]:
    """This launch as a task of the warm pool (:mod:`muonlab.distributed.warm`): the idle pool on
    the same ranks, device, backend and environment, else a new one. Returns the outcome and what
    ran it ("reused warm", "new warm" or, while another thread's launch holds the pool, "cold")."""
    from . import warm as _warm

    run_dir, status_dir = dirs
    key = _warm.pool_key(nprocs, *device_backend, start_method)
    pool, why_new = _warm.take_pool(key)
    if why_new == "busy":  # one pool at a time: a concurrent launch runs as a cold one
        return _run_cold(nprocs, payload, device_backend, limits, dirs, sys_path, tick, start_method), "cold"
    task = _warm.Task(payload, limits, tuple(sys_path), status_dir, os.path.abspath(run_dir), os.getcwd())
    reused = pool is not None
    up_already[0] = nprocs if reused else 0
    if pool is None:
        try:
            pool = _warm.WorkerPool(key, _launch_config(nprocs, limits[1], run_dir, start_method), device_backend)
        finally:
            if pool is None:
                _warm.unreserve()
        _warm.register(pool)
    pool.last_run_dir = run_dir
    try:
        with _launch_settings(run_dir, status_dir, pool.run_id):
            try:
                if reused:
                    pool.send(task)
                else:
                    pool.start(task)
            except BaseException:  # a pool that did not get its task is of no use to the next launch
                pool.kill(status_dir)
                raise
            outcome = _warm.wait_for_task(pool, status_dir, limits, tick)
        if "values" in outcome:
            pool.finished_task(status_dir)
    finally:
        _warm.release(pool)
    return outcome, "reused warm" if reused else "new warm"


def _phase(status_dir: str, nprocs: int, up_already: int = 0) -> _progress.LaunchPhase:
    """How far the ranks are, from their status files: started (pid written; ``up_already`` were
    up before the launch), process group up, returned from the function."""
    up, ready, returned = (len(_ranks_in(status_dir, kind)) for kind in ("pid", "ready", "returned"))
    return _progress.LaunchPhase(max(up, up_already), ready, returned)


def _status_times(status_dir: str, kind: str) -> list[float]:
    """When each rank wrote its ``kind`` status file (wall clock, from the file's mtime)."""
    times = []
    for path in _files_in(status_dir, f"rank*.{kind}"):
        try:
            times.append(os.stat(path).st_mtime)
        except OSError:
            pass
    return times


def _timings(status_dir: str, nprocs: int, state: _progress.ProgressState, started_wall: float,
             workers: str) -> dict[str, Any]:
    """Seconds from the launch's start until every rank had its process group (``startup_s``) and
    had reported a step (``first_step_s``), and the wall time at which the last rank returned."""
    ready, returned = _status_times(status_dir, "ready"), _status_times(status_dir, "returned")
    first_step = state.first_step_time()
    return {
        "workers": workers,
        "startup_s": max(ready) - started_wall if len(ready) >= nprocs else None,
        "first_step_s": first_step - started_wall if first_step is not None else None,
        "last_return_wall": max(returned) if len(returned) >= nprocs else None,
    }


def _since(wall: float | None) -> float | None:
    return None if wall is None else max(0.0, time.time() - wall)


LAUNCH_INFO = "launch.json"
"""A run directory's record of the launch: where its time went (see launch())."""


def _write_launch_info(run_dir: str, info: dict) -> None:
    try:
        with open(os.path.join(run_dir, LAUNCH_INFO), "w") as f:
            json.dump(info, f, indent=1)
    except OSError:  # the record is a convenience: a full disk must not hide the launch's outcome
        pass


def last_launch_info(name: str) -> dict:
    """The ``launch.json`` of the run named ``name`` (under ``$MUONLAB_RUNS_DIR`` or ``runs``):
    ``workers`` ("cold", "new warm", "reused warm"), ``startup_s``, ``first_step_s``,
    ``teardown_s``, ``total_s`` (seconds; None where the launch did not get that far)."""
    _check_run_name(name)
    root = os.environ.get(RUNS_DIR_ENV) or "runs"
    with open(os.path.join(root, name, LAUNCH_INFO)) as f:
        return json.load(f)


def shutdown_workers() -> float | None:
    """End the warm workers launch() keeps between launches (see launch()'s ``warm``); the next
    launch starts fresh ones. Returns the seconds the shutdown took, None if none were running."""
    if "muonlab.distributed.warm" not in sys.modules:  # no warm launch yet: nothing to end
        return None
    from .warm import shutdown_workers as shutdown

    return shutdown()


def _display_for(progress: bool | None) -> str | None:
    if progress is False:
        return None
    if _progress.in_notebook_kernel():
        return "notebook"
    return "text" if progress else None


# --------------------------------------------------------------------------------------------
# The run directory


RUNS_DIR_ENV = "MUONLAB_RUNS_DIR"


def _check_run_name(name: str | None) -> None:
    if name is None:
        return
    if not isinstance(name, str) or not name.strip() or name.startswith(".") or "/" in name or os.sep in name:
        raise ValueError(f"name must be a non-empty directory name (no path separator, not starting with "
                         f"'.'), got {name!r}")


def _short_name(fn: Callable[..., Any]) -> str:
    target = fn
    while isinstance(target, functools.partial):
        target = target.func
    return getattr(target, "__name__", None) or "launch"


def _rank_dir(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, f"rank{rank}")


STATUS_DIR = ".status"
"""A run directory's folder of the workers' status files (see :func:`_worker_entry`), while it runs."""
_LOCK_FILE = ".lock"


def _claim_run_dir(fn: Callable[..., Any], name: str | None, nprocs: int) -> tuple[str, Any]:
    """``<root>/<name>/``, locked for this launch, with an empty ``rank<r>/`` per rank and an empty
    status folder; root is ``$MUONLAB_RUNS_DIR`` or ``runs``. Returns the folder and its lock (an
    open file: closing it frees the folder)."""
    root = os.environ.get(RUNS_DIR_ENV) or "runs"
    os.makedirs(root, exist_ok=True)
    if name is None:
        run_dir = _new_dir(root, f"{_short_name(fn)}-{time.strftime('%Y%m%d-%H%M%S')}")
    else:
        run_dir = os.path.join(root, name)
        os.makedirs(run_dir, exist_ok=True)
    lock = _lock_run_dir(run_dir, name)
    try:
        # a rerun under the same name replaces what launch wrote there before, and nothing else
        for entry in os.listdir(run_dir):
            if re.fullmatch(r"rank\d+", entry) or entry == STATUS_DIR:
                shutil.rmtree(os.path.join(run_dir, entry), ignore_errors=True)
        if os.path.exists(os.path.join(run_dir, LAUNCHER_LOG)):
            os.remove(os.path.join(run_dir, LAUNCHER_LOG))
        for rank in range(nprocs):
            os.makedirs(_rank_dir(run_dir, rank), exist_ok=True)
        os.makedirs(os.path.join(run_dir, STATUS_DIR))
    except BaseException:
        lock.close()
        raise
    return run_dir, lock


def _new_dir(root: str, base: str) -> str:
    """Make and return ``<root>/<base>``, or ``<base>-2``, ``-3``, ... if taken (by a launch on
    another thread too: making the folder is what claims it)."""
    run_dir, suffix = os.path.join(root, base), 1
    while True:
        try:
            os.mkdir(run_dir)
            return run_dir
        except FileExistsError:
            suffix += 1
            run_dir = os.path.join(root, f"{base}-{suffix}")


def _lock_run_dir(run_dir: str, name: str | None) -> Any:
    """An exclusive lock on ``run_dir`` for the launch's lifetime, or a ValueError naming ``name``
    if a launch still running holds it: replacing its logs would leave its errors pointing at
    another run's. The lock dies with its holder, so a killed launch never blocks its name."""
    lock = open(os.path.join(run_dir, _LOCK_FILE), "a")
    if fcntl is None:
        return lock
    try:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise ValueError(f"name {name!r} is in use by a launch still running ({run_dir}): another launch "
                         f"under it would replace that one's logs; pass another name, or wait for it to end") from None
    except OSError:  # a filesystem without locks: the launch runs unguarded
        pass
    return lock


class _RunLogs(LogsSpecs):
    """Each rank's stdout, stderr and error file in ``<run_dir>/rank<r>/``, never on the console:
    a notebook shows launch's own report, not the workers' log lines. And each rank's environment:
    the caller's ``os.environ`` as the workers start (what a spawned worker inherits) under
    elastic's per-rank variables, with the list of its names, by which a forkserver's worker drops
    what it inherited from the forkserver (:func:`_take_launch_env`)."""

    def __init__(self, run_dir: str):
        super().__init__(log_dir=run_dir, redirects=Std.ALL, tee=Std.NONE)
        self.run_dir = os.path.abspath(run_dir)

    @property
    def root_log_dir(self) -> str:
        return self.run_dir

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        dest = LogsDest()
        caller = dict(os.environ)  # elastic calls this on its agent's thread as it starts the workers
        for local_rank in range(len(envs)):
            rank_dir = _rank_dir(self.run_dir, local_rank)  # made by _claim_run_dir
            dest.stdouts[local_rank] = os.path.join(rank_dir, "stdout.log")
            dest.stderrs[local_rank] = os.path.join(rank_dir, "stderr.log")
            dest.error_files[local_rank] = os.path.join(rank_dir, "error.json")
            env = envs[local_rank]  # elastic's own: updated in place, it applies what is here
            env["TORCHELASTIC_ERROR_FILE"] = dest.error_files[local_rank]
            for key, value in caller.items():
                env.setdefault(key, value)
            env[_ENV_NAMES] = "\n".join(env)
        dest.filtered_stdout = os.path.join(self.run_dir, "filtered_stdout.log")
        dest.filtered_stderr = os.path.join(self.run_dir, "filtered_stderr.log")
        return dest


def _results(fn: Callable[..., Any], nprocs: int, limits: tuple[float, float], outcome: dict,
             dirs: tuple[str, str]) -> dict[int, Any]:
    """The ranks' return values, or the error that says why there are none."""
    run_dir, status_dir = dirs
    unguarded = _files_in(status_dir, _UNGUARDED_MAIN + "*")
    if unguarded:
        with open(unguarded[0]) as f:
            text = f.read()
        raise WorkerError(text, {rank: text for rank in range(nprocs)}, run_dir)
    if "vanished" in outcome:
        texts = {rank: f"rank {rank}'s process ended without returning a result or raising (os._exit, or "
                       "killed by something elastic did not report); the other ranks were stopped"
                 for rank in outcome["vanished"]}
        raise _worker_error(fn, nprocs, texts, run_dir)
    if "timed_out" in outcome:
        timed_out = outcome["timed_out"]
        message = _timeout_message(fn, nprocs, limits, timed_out) + "\n" + _logs_line(run_dir)
        raise WorkerTimeout(message, timed_out["running"], timed_out["phase"], run_dir, timed_out.get("waiting"))
    error = outcome.get("error")
    if isinstance(error, ChildFailedError):
        raise _worker_error(fn, nprocs, _failure_texts(error, run_dir, status_dir), run_dir) from None
    if error is not None:
        raise RuntimeError(f"launch of {_fn_name(fn)} failed to run its workers: {error}\n"
                           f"{_logs_line(run_dir)}") from error
    # elastic hands back None for a worker that ended with sys.exit(0) before calling fn
    exited = {rank: _status_text(status_dir, rank, "exit") for rank, blob in outcome["values"].items() if blob is None}
    if exited:
        raise _worker_error(fn, nprocs, exited, run_dir)
    return {rank: pickle.loads(blob) for rank, blob in sorted(outcome["values"].items())}


MAX_PROCS = max(64, 16 * (os.cpu_count() or 1))
"""The most workers one launch() starts: one machine's worth, with room to oversubscribe."""

_UNGUARDED_MAIN = "unguarded_main"


def _refuse_in_spawn_bootstrap() -> None:
    """A worker (spawned or forked by the forkserver) first re-runs the caller's main script: if
    that script calls launch() outside ``if __name__ == "__main__":``, say so instead of starting
    workers recursively."""
    if not getattr(multiprocessing.current_process(), "_inheriting", False):
        return
    script = getattr(sys.modules.get("__mp_main__"), "__file__", None) or "the main script"
    message = (
        f"launch() was called while a worker process was starting: workers re-run the main "
        f"script ({script}), and it calls launch() at its top level. Put the script's top-level code "
        f"under `if __name__ == \"__main__\":` (see the README's Distributed section)."
    )
    status_dir = os.environ.get(_STATUS_DIR_ENV)
    if status_dir and os.path.isdir(status_dir):
        with open(os.path.join(status_dir, f"{_UNGUARDED_MAIN}.{os.getpid()}"), "w") as f:
            f.write(message)
    raise RuntimeError(message)


START_METHODS = ("forkserver", "spawn")
"""The ``start_method`` names launch() takes (None: "forkserver" where the platform has it)."""
FORKSERVER_PRELOAD = ("torch", "torch.distributed", "torch.distributed.tensor")
"""What the forkserver imports once, so each worker forked from it starts with torch imported.
Never muonlab or the caller's modules: each worker imports those itself, as they are on disk now."""


def _start_method(start_method: str | None) -> str:
    """launch()'s ``start_method``, checked (before anything starts) and resolved."""
    available = multiprocessing.get_all_start_methods()
    if start_method is None:
        # Linux only: elsewhere (macOS) forkserver exists, but its workers were never tried here
        usable = "forkserver" in available and sys.platform.startswith("linux") and _forkserver_address() is None
        return "forkserver" if usable else "spawn"
    if start_method not in START_METHODS:
        raise ValueError(f"start_method must be None (forkserver where the platform has it, else spawn), "
                         f"'forkserver' or 'spawn', got {start_method!r}")
    if start_method not in available:
        raise ValueError(f"start_method={start_method!r} is not available on this platform "
                         f"({sys.platform}: {', '.join(available)}); use 'spawn' or None")
    why_not = _forkserver_address() if start_method == "forkserver" else None
    if why_not is not None:
        raise ValueError(f"start_method='forkserver' can't start here: {why_not}; use 'spawn' or None "
                         "(None takes spawn here)")
    return start_method


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


def _launch_config(nprocs: int, startup_timeout_s: float, run_dir: str, start_method: str) -> LaunchConfig:
    """One node, ``nprocs`` workers, a static rendezvous on a free local port; the run id
    is the launch's own (its agent's thread and its workers' start events carry it).

    With "forkserver", multiprocessing's one forkserver of this process is told to preload
    :data:`FORKSERVER_PRELOAD` (which takes effect when it starts: at this process's first
    forkserver launch). Its workers would inherit the forkserver's environment, from when it
    started; :class:`_RunLogs` hands each the caller's as it is now."""
    if start_method == "forkserver":
        multiprocessing.get_context("forkserver").set_forkserver_preload(list(FORKSERVER_PRELOAD))
    return LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nprocs,
        run_id=f"muonlab-{uuid.uuid4().hex[:12]}",
        rdzv_backend="static",
        rdzv_endpoint=f"127.0.0.1:{_free_port()}",
        rdzv_configs={"rank": 0, "timeout": max(60, int(startup_timeout_s))},
        max_restarts=0,
        monitor_interval=0.1,
        start_method=start_method,
        local_addr="127.0.0.1",
        logs_specs=_RunLogs(run_dir),
    )


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


def _wait_for_agent(agent_done: threading.Event, nprocs: int, limits: tuple[float, float],
                    status_dir: str, tick: Callable[[], None]) -> dict[str, Any] | None:
    """None once the agent is done, or what timed out (see :func:`_timeout_report`), or the ranks whose
    process vanished: {"vanished": [...]}. elastic's agent waits for a result from a
    worker that ended with exit code 0 and none (``os._exit(0)``) until the timeout; the launch
    does not.

    ``tick`` (the progress display) runs on this, the caller's, thread between waits."""
    timeout_s, startup_timeout_s = limits
    phase, deadline = "startup", time.monotonic() + startup_timeout_s
    gone_since: dict[int, float] = {}
    # Short waits, so a Ctrl-C is seen promptly however it arrives.
    while not agent_done.wait(min(0.25, max(0.0, deadline - time.monotonic()))):
        tick()
        if phase == "startup" and len(_ranks_in(status_dir, "ready")) == nprocs:
            phase, deadline = "run", time.monotonic() + timeout_s
        vanished = _vanished(status_dir, gone_since)
        if vanished:
            return {"vanished": vanished}
        if time.monotonic() >= deadline:
            return _timeout_report(status_dir, nprocs, phase)
    return None


def _timeout_report(status_dir: str, nprocs: int, phase: str) -> dict[str, Any]:
    """What a launch out of time reports, read before its workers are stopped: {"phase", "ready",
    "running", "waiting"}. "running": the ranks that hung, still in their function and not inside a
    collective when their collective watch last looked (see ``progress.collectives_in_flight``);
    "waiting": those inside one meanwhile. Where every rank still in its function was inside a
    collective (ranks in different collectives), none can be told apart: all are "running"."""
    ready = _ranks_in(status_dir, "ready")
    finished = set().union(*(_ranks_in(status_dir, kind) for kind in ("returned", "failed", "done")))
    running = sorted(set(range(nprocs)) - finished)
    waiting = [rank for rank in running if _status_text(status_dir, rank, "collective") == "1"]
    hung = [rank for rank in running if rank not in waiting]
    if not hung:
        hung, waiting = running, []
    return {"phase": phase, "ready": ready, "running": hung, "waiting": waiting}


def _run_agent(config: LaunchConfig, entry_args: tuple, limits: tuple[float, float], status_dir: str,
               tick: Callable[[], None]) -> dict[str, Any]:
    """Run elastic's agent on a thread and wait for it (see :func:`_wait_for_agent`).

    Returns {"values": {rank: pickled result}}, {"error": exception}, or {"timed_out": ...} once
    the workers of a late launch are stopped. A Ctrl-C stops the workers and propagates. Only this
    launch's workers are stopped (:func:`_worker_pids`): another launch may run on another thread.
    """
    outcome: dict[str, Any] = {}
    # Waiting on an Event, not Thread.join: a join interrupted by Ctrl-C (KeyboardInterrupt)
    # leaves the thread looking finished on Python < 3.13, and the workers would be left behind.
    agent_done = threading.Event()

    def run_agent() -> None:
        try:
            outcome["values"] = elastic_launch(config, _worker_entry)(*entry_args)
        except BaseException as e:  # handed to the caller's thread
            outcome["error"] = e
        finally:
            agent_done.set()

    def pids_of() -> set[int]:
        return _worker_pids(status_dir, config.run_id)

    agent = threading.Thread(target=run_agent, name=_AGENT_THREAD + config.run_id, daemon=True)
    agent.start()
    try:
        timed_out = _wait_for_agent(agent_done, config.nproc_per_node, limits, status_dir, tick)
    except BaseException:  # KeyboardInterrupt in a notebook: take the workers down with us
        _stop_workers(pids_of, agent_done)
        raise
    if timed_out is not None and "vanished" in timed_out:
        _stop_workers(pids_of, agent_done, agent_ends=False)
        return timed_out
    if timed_out is not None:
        _stop_workers(pids_of, agent_done)
        return {"timed_out": timed_out}
    return outcome


if __name__ == "__main__":
    worker_main()
