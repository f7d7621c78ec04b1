"""Start distributed worker processes from a notebook or a script, or under torchrun.

One machine, from a notebook or a script::

    from muonlab.distributed import launch
    from mywork import train          # a function in an importable .py module

    results = launch(train, 4, steps=100)      # {rank: return value of train on that rank}

``launch`` starts ``nprocs`` processes through torch.distributed's own elastic launcher
(``elastic_launch``, start method "spawn", a static rendezvous on a free port of 127.0.0.1),
initialises the default process group in each (NCCL when CUDA has a GPU per process, else gloo),
calls ``fn(*args, **kwargs)`` and hands back each rank's return value. A worker that raises gives a
:class:`WorkerError` carrying the worker's traceback (a notebook never shows the children's stderr);
a launch that runs past ``timeout_s`` seconds is stopped, its processes killed, and gives a
:class:`WorkerTimeout`. The worker function must live in a module the children can import: a
function defined in a notebook cell (module ``__main__``), a lambda or a nested function is refused
before anything starts. The children get the caller's ``sys.path``, so a ``.py`` file next to the
notebook is found.

Several nodes (GPUs), with the same worker functions, under torchrun::

    torchrun --nnodes=N --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT \\
        -m muonlab.distributed.launch mypkg.mymod:train [ARG ...]

Here ``python -m muonlab.distributed.launch MODULE:FUNCTION [ARG ...]`` (:func:`worker_main`) runs in
every process torchrun starts: it initialises the default process group from torchrun's environment
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; NCCL with ``device_id=LOCAL_RANK`` when
CUDA is available, else gloo), calls ``FUNCTION(*ARGS)`` with the remaining command-line words as
strings, and destroys the group. ``--backend`` and ``--timeout-s`` may come before
``MODULE:FUNCTION``. From Python, :func:`run_worker` does the same for a function object. Errors are
recorded with torch.distributed.elastic's ``record``, so torchrun's summary shows the traceback.
"""

from __future__ import annotations

import argparse
import functools
import gc
import glob
import importlib
import json
import logging
import multiprocessing
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

__all__ = ["WorkerError", "WorkerTimeout", "launch", "run_worker", "worker_main"]

# Seconds a signalled worker gets to exit (and elastic's agent to notice) before the next step.
_TERM_GRACE_S = 5.0
_AGENT_JOIN_S = 30.0


class WorkerError(RuntimeError):
    """One or more worker processes of :func:`launch` failed.

    ``failures`` maps each failed rank to its error text (the worker's traceback where Python
    recorded one); ``ranks`` lists those ranks, the first observed failure first.
    """

    def __init__(self, message: str, failures: dict[int, str] | None = None):
        super().__init__(message)
        self.failures = dict(failures or {})
        self.ranks = list(self.failures)


class WorkerTimeout(WorkerError):
    """:func:`launch` ran past its ``timeout_s``; ``ranks`` are the ranks still running then."""

    def __init__(self, message: str, ranks: list[int]):
        super().__init__(message, {rank: "still running at the timeout" for rank in ranks})


# --------------------------------------------------------------------------------------------
# Inside a worker


def _default_backend(num_procs: int) -> str:
    if torch.cuda.is_available() and num_procs <= torch.cuda.device_count():
        return "nccl"
    return "gloo"


def _init_process_group(backend: str, timeout_s: float) -> None:
    timeout = timedelta(seconds=timeout_s)
    if "nccl" in backend:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group(backend, timeout=timeout, device_id=device)
    else:
        torch.set_num_threads(1)
        dist.init_process_group(backend, timeout=timeout)


def _call_in_process_group(
    fn: Callable[..., Any],
    backend: str,
    timeout_s: float,
    args: tuple,
    kwargs: dict,
    on_error: Callable[[], None] | None = None,
) -> Any:
    _init_process_group(backend, timeout_s)
    try:
        return fn(*args, **kwargs)
    except BaseException:
        if on_error is not None:
            on_error()
        raise
    finally:
        # Objects of fn's that hold a process group (a DDP Reducer, in a reference cycle) must die
        # while the group lives: collected after destroy_process_group, gloo's destructor joins a
        # thread that never returns (seen as a worker hanging while pickling its result).
        gc.collect()
        dist.destroy_process_group()


def _die_with_parent() -> None:
    # If the launching process is killed outright (a notebook kernel restart), its workers
    # would otherwise live on; Linux can kill them with it.
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    except Exception:
        pass


def _write_status(status_dir: str, rank: int, kind: str, text: str) -> None:
    with open(os.path.join(status_dir, f"rank{rank}.{kind}"), "w") as f:
        f.write(text)


@record
def _worker_entry(
    payload: bytes, backend: str, timeout_s: float, sys_path: list[str], status_dir: str
) -> bytes:
    """What each process of :func:`launch` runs: pickled in, pickled out, errors recorded."""
    _die_with_parent()
    rank = int(os.environ["RANK"])
    _write_status(status_dir, rank, "pid", str(os.getpid()))

    def mark_failed() -> None:
        # elastic's error files stamp whole seconds. This finer stamp, taken before the process
        # group is destroyed, puts the root cause before the errors it causes on other ranks.
        if not os.path.exists(os.path.join(status_dir, f"rank{rank}.failed")):
            _write_status(status_dir, rank, "failed", repr(time.time()))

    try:
        # The function and its arguments are unpickled only now, after the caller's import path
        # is in place, so an import problem becomes this rank's recorded traceback.
        for entry in reversed(sys_path):
            if entry not in sys.path:
                sys.path.insert(0, entry)
        fn, args, kwargs = pickle.loads(payload)
        result = _call_in_process_group(
            fn, backend, timeout_s, args, kwargs, on_error=mark_failed
        )
        return pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException:
        mark_failed()
        raise
    finally:
        _write_status(status_dir, rank, "done", str(os.getpid()))


def run_worker(
    fn: Callable[..., Any], *args: Any, backend: str | None = None, timeout_s: float = 1800, **kwargs
) -> Any:
    """Run ``fn(*args, **kwargs)`` in a process started by torchrun (or any env:// launcher).

    Initialises the default process group from the environment (``backend=None``: NCCL on
    ``cuda:LOCAL_RANK`` when CUDA is available, else gloo), calls ``fn`` and destroys the group.
    """
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    return record(_call_in_process_group)(fn, backend, timeout_s, args, kwargs)


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
    parser.add_argument("--backend", default=None, help="nccl or gloo (default: nccl with CUDA)")
    parser.add_argument("--timeout-s", type=float, default=1800, help="collective timeout")
    parser.add_argument("target", help="MODULE:FUNCTION, e.g. mypkg.mymod:train")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="passed to FUNCTION as strings")
    ns = parser.parse_args(argv)
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    fn = _resolve(ns.target)
    return run_worker(fn, *ns.args, backend=ns.backend, timeout_s=ns.timeout_s)


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


class _QuietElastic(logging.Filter):
    """Drops elastic's own reports of what launch() reports better.

    elastic warns that it cannot install signal handlers off the main thread (launch() runs the
    agent on a thread on purpose, so the caller's handlers stay, and kills workers itself), and logs
    each failed worker's traceback and each process it terminates: launch() raises those as one
    WorkerError naming the rank, so in a notebook they would be dozens of red lines with pids and
    timestamps before the real message.
    """

    LOGGERS = ("torch.distributed.elastic.multiprocessing.api", "torch.multiprocessing.spawn")
    DROPPED = ("running on a child thread", "failed (exitcode", "Terminating process")

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(text in message for text in self.DROPPED)


def _read_error_files(log_dir: str) -> dict[int, str]:
    """Each rank's recorded error: ``<log_dir>/<run>/attempt_0/<local_rank>/error.json``."""
    errors: dict[int, tuple[float, str]] = {}
    for path in glob.glob(os.path.join(log_dir, "*", "attempt_*", "*", "error.json")):
        try:
            rank = int(os.path.basename(os.path.dirname(path)))
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
    for path in glob.glob(os.path.join(status_dir, "rank*.failed")):
        try:
            with open(path) as f:
                times[int(os.path.basename(path)[len("rank") : -len(".failed")])] = float(f.read())
        except (ValueError, OSError):
            pass
    return times


def _failure_texts(err: ChildFailedError, log_dir: str, status_dir: str) -> dict[int, str]:
    """Rank -> error text, the first failure first (elastic's root cause where times tie)."""
    recorded = _read_error_files(log_dir)
    texts: dict[int, str] = {}
    killed = set()
    for rank, failure in err.failures.items():
        text = recorded.get(rank) or _error_text(failure.error_file_data)[0]
        if text == "<NONE>":  # elastic's placeholder when the process left no error file
            text = ""
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


def _worker_error(fn: Callable[..., Any], num_procs: int, texts: dict[int, str]) -> WorkerError:
    first, *others = texts
    head = f"rank {first} of {num_procs} failed in {_fn_name(fn)}"
    if others:
        label = "rank" if len(others) == 1 else "ranks"
        head += f"; {label} {', '.join(map(str, others))} failed after it"
    sections = [f"--- rank {rank} ---\n{text}" for rank, text in texts.items()]
    return WorkerError(head + "\n" + "\n".join(sections), texts)


def _timeout_message(
    fn: Callable[..., Any], num_procs: int, timeout_s: float, running: list[int], started: set[int]
) -> str:
    def ranks(group: list[int]) -> str:
        return ("rank " if len(group) == 1 else "ranks ") + ", ".join(map(str, group))

    in_fn = [rank for rank in running if rank in started]
    starting = [rank for rank in running if rank not in started]
    parts = []
    if in_fn:
        parts.append(f"{ranks(in_fn)} still running")
    if starting:
        parts.append(f"{ranks(starting)} still starting up (before calling the function)")
    return (
        f"launch of {_fn_name(fn)} on {num_procs} processes timed out after {timeout_s:g} s; "
        f"{'; '.join(parts) or 'no rank still running'}; all worker processes have been killed"
    )


def _ranks_in(status_dir: str, kind: str) -> set[int]:
    ranks = set()
    for path in glob.glob(os.path.join(status_dir, f"rank*.{kind}")):
        try:
            ranks.add(int(os.path.basename(path)[len("rank") : -len(kind) - 1]))
        except ValueError:
            pass
    return ranks


def _stop_workers(children_before: set, agent_done: threading.Event) -> None:
    """SIGTERM, then SIGKILL, every worker of this launch, and wait for elastic's agent to end.

    The workers are the multiprocessing children started since the launch began (listed, not
    yet reaped, so their pids cannot have been reused). elastic's agent notices them die, joins
    them and returns, so no worker outlives the launch, not even as a zombie.
    """
    for sig in (signal.SIGTERM, signal.SIGKILL):
        # Re-listed each round: the agent may still have been starting processes.
        for proc in multiprocessing.active_children():
            if proc in children_before or proc.pid is None:
                continue
            try:
                os.kill(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        if agent_done.wait(_TERM_GRACE_S):
            return
    agent_done.wait(_AGENT_JOIN_S)


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    *args: Any,
    backend: str | None = None,
    timeout_s: float = 300,
    **kwargs: Any,
) -> dict[int, Any]:
    """Run ``fn(*args, **kwargs)`` in ``nprocs`` new local processes; return ``{rank: result}``.

    Each process has the default process group initialised (``backend=None``: NCCL when CUDA has
    at least ``nprocs`` devices, else gloo; the collective timeout is ``timeout_s``), CPU workers
    use one intra-op thread, and nothing is seeded. ``fn``, the arguments and the return values
    are pickled. The whole launch (start-up included) is stopped after ``timeout_s`` seconds.

    Raises:
        ValueError: ``fn`` is not importable by the children (defined in ``__main__``, e.g. a
            notebook cell, a lambda, or a nested function), or ``nprocs < 1``; nothing started.
        WorkerError: a worker raised or died; the message names the rank(s) and holds the
            traceback(s).
        WorkerTimeout: the launch ran past ``timeout_s``; the message names the ranks still
            running. All worker processes have been ended when either error is raised.
    """
    _check_importable(fn)
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive int, got {nprocs!r}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
    if backend is None:
        backend = _default_backend(nprocs)
    try:
        payload = pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:
        raise TypeError(f"launch() could not pickle {_fn_name(fn)} and its arguments: {e}") from e

    work_dir = tempfile.mkdtemp(prefix="muonlab_launch_")
    log_dir = os.path.join(work_dir, "logs")
    status_dir = os.path.join(work_dir, "status")
    os.makedirs(log_dir)
    os.makedirs(status_dir)
    sys_path = [os.getcwd() if entry == "" else entry for entry in sys.path]
    try:
        outcome = _run_agent(_launch_config(nprocs, timeout_s, log_dir),
                             (payload, backend, float(timeout_s), sys_path, status_dir), timeout_s, status_dir)
        if "timed_out" in outcome:
            started, running = outcome["timed_out"]
            raise WorkerTimeout(_timeout_message(fn, nprocs, timeout_s, running, started), running)
        error = outcome.get("error")
        if isinstance(error, ChildFailedError):
            raise _worker_error(fn, nprocs, _failure_texts(error, log_dir, status_dir)) from None
        if error is not None:
            raise RuntimeError(f"launch of {_fn_name(fn)} failed to run its workers: {error}") from error
        return {rank: pickle.loads(blob) for rank, blob in sorted(outcome["values"].items())}
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


def _launch_config(nprocs: int, timeout_s: float, log_dir: str) -> LaunchConfig:
    """One node, ``nprocs`` spawned workers, a static rendezvous on a free local port."""
    return LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nprocs,
        run_id=f"muonlab-{uuid.uuid4().hex[:12]}",
        rdzv_backend="static",
        rdzv_endpoint=f"127.0.0.1:{_free_port()}",
        rdzv_configs={"rank": 0, "timeout": max(60, int(timeout_s))},
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
        local_addr="127.0.0.1",
        logs_specs=DefaultLogsSpecs(log_dir=log_dir),
    )


def _run_agent(config: LaunchConfig, entry_args: tuple, timeout_s: float, status_dir: str) -> dict[str, Any]:
    """Run elastic's agent on a thread and wait for it at most ``timeout_s``.

    Returns {"values": {rank: pickled result}}, {"error": exception}, or {"timed_out": (ranks that
    started, ranks still running)} once the workers of a late launch are stopped. A Ctrl-C stops
    the workers and propagates.
    """
    nprocs = config.nproc_per_node
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

    children_before = set(multiprocessing.active_children())
    quiet = _QuietElastic()
    for name in quiet.LOGGERS:
        logging.getLogger(name).addFilter(quiet)
    saved_signals_env = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE")
    agent = threading.Thread(target=run_agent, name="muonlab-launch-agent", daemon=True)
    deadline = time.monotonic() + timeout_s
    try:
        agent.start()
        try:
            # Short waits, so a Ctrl-C is seen promptly however it arrives.
            while not agent_done.wait(min(0.25, max(0.0, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    break
        except BaseException:  # KeyboardInterrupt in a notebook: take the workers down with us
            _stop_workers(children_before, agent_done)
            raise
        if not agent_done.is_set():
            started = _ranks_in(status_dir, "pid")
            running = sorted(set(range(nprocs)) - _ranks_in(status_dir, "done"))
            _stop_workers(children_before, agent_done)
            return {"timed_out": (started, running)}
        return outcome
    finally:
        for name in quiet.LOGGERS:
            logging.getLogger(name).removeFilter(quiet)
        if saved_signals_env is None:
            os.environ.pop("TORCHELASTIC_SIGNALS_TO_HANDLE", None)
        else:
            os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = saved_signals_env


if __name__ == "__main__":
    worker_main()
