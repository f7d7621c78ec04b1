"""What runs inside a worker process: the process group around the function, the status files that
tell the launcher how far this rank is, the teardown, and the torchrun entry point
(``python -m muonlab.launcher MODULE:FUNCTION [ARG ...]``, :func:`worker_main`)."""

from __future__ import annotations

import argparse
import atexit
import gc
import importlib
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from ..distributed.device import DEVICE_CHOICES, DEVICE_ENV, init_process_group
from . import progress as _progress
from .errors import WorkerBaseException
from .run_dir import _rank_dir, _ranks_in, _status_path, _write_status

__all__ = ["report_failure", "run_worker", "unrecorded_as_error", "worker_main"]


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
    """Entry point of ``python -m muonlab.launcher MODULE:FUNCTION [ARG ...]``."""
    parser = argparse.ArgumentParser(
        prog="python -m muonlab.launcher",
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
