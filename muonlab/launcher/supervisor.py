"""The caller's side of a launch: :func:`launch` checks its arguments, claims the run directory,
runs elastic's agent on a thread (fresh workers) or hands the warm pool its task, watches both
clocks and the workers' status files, shows progress, and turns what happened into the ranks'
results or one :class:`~muonlab.launcher.errors.WorkerError`. See :mod:`muonlab.launcher`."""

from __future__ import annotations

import functools
import logging
import multiprocessing
import os
import pickle
import shutil
import socket
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from ..distributed.device import check_backend, choose_device
from . import progress as _progress
from .errors import WorkerError, WorkerTimeout
from .process_tools import (
    _AGENT_THREAD,
    _ELASTIC_LOGGERS,
    _WORKER_STARTS,
    _end_process_groups,
    _forkserver_address,
    _stop_workers,
    _vanished,
    _worker_pids,
)
from .run_dir import (
    _LAUNCH_ENV,
    _STATUS_DIR_ENV,
    LAUNCHER_LOG,
    STATUS_DIR,
    _check_run_name,
    _claim_run_dir,
    _error_text,
    _failure_times,
    _files_in,
    _rank_dir,
    _ranks_in,
    _read_error_files,
    _short_name,
    _status_text,
    _status_times,
    _timeout_report,
    _write_launch_info,
)
from .worker import _ENV_NAMES, _worker_entry

__all__ = ["BACKENDS", "MAX_PROCS", "MAX_TIMEOUT_S", "START_METHODS", "WARM_ENV", "launch", "shutdown_workers"]



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
    :func:`muonlab.launcher.progress.report_progress`; ``progress`` shows them while the call
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
                         f"(at most {MAX_PROCS}: muonlab.launcher.MAX_PROCS)")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be None (the device's: nccl on GPUs, gloo on the CPU), 'gloo' or "
                         f"'nccl', got {backend!r}")
    for keyword, value in timeouts.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ValueError(f"{keyword} must be a positive number of seconds, got {value!r}")
        if value > MAX_TIMEOUT_S:
            raise ValueError(f"{keyword}={value:g} s is longer than launch() waits (at most "
                             f"{MAX_TIMEOUT_S:g} s, a year: muonlab.launcher.MAX_TIMEOUT_S)")
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
    """This launch as a task of the warm pool (:mod:`muonlab.launcher.warm`): the idle pool on
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


def shutdown_workers() -> float | None:
    """End the warm workers launch() keeps between launches (see launch()'s ``warm``); the next
    launch starts fresh ones. Returns the seconds the shutdown took, None if none were running."""
    if "muonlab.launcher.warm" not in sys.modules:  # no warm launch yet: nothing to end
        return None
    from .warm import shutdown_workers as shutdown

    return shutdown()


def _display_for(progress: bool | None) -> str | None:
    if progress is False:
        return None
    if _progress.in_notebook_kernel():
        return "notebook"
    return "text" if progress else None


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
