"""The run directory of a launch, ``runs/<name>/`` (or under ``$MUONLAB_RUNS_DIR``): claiming and
locking it, each rank's folder, ``launch.json``, and the status files by which workers tell the
launcher how far they are (``.status/rank<r>.<kind>``). Read and written by both sides (the worker
and the supervisor), so it imports neither."""

from __future__ import annotations

import functools
import glob
import json
import os
import re
import shutil
import time
from typing import Any, Callable

try:
    import fcntl
except ImportError:  # not on Windows: there a run directory is not locked
    fcntl = None


def _status_path(status_dir: str, rank: int, kind: str) -> str:
    return os.path.join(status_dir, f"rank{rank}.{kind}")


def _write_status(status_dir: str, rank: int, kind: str, text: str) -> None:
    with open(_status_path(status_dir, rank, kind), "w") as f:
        f.write(text)


LAUNCHER_LOG = "launcher.log"


_STATUS_DIR_ENV = "MUONLAB_LAUNCH_STATUS_DIR"


# What elastic's agent and launch() set in os.environ while a launch runs.
_LAUNCH_ENV = ("TORCHELASTIC_SIGNALS_TO_HANDLE", _STATUS_DIR_ENV)


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


def _ranks_in(status_dir: str, kind: str) -> set[int]:
    ranks = set()
    for path in _files_in(status_dir, f"rank*.{kind}"):
        try:
            ranks.add(int(os.path.basename(path)[len("rank") : -len(kind) - 1]))
        except ValueError:
            pass
    return ranks


def _status_times(status_dir: str, kind: str) -> list[float]:
    """When each rank wrote its ``kind`` status file (wall clock, from the file's mtime)."""
    times = []
    for path in _files_in(status_dir, f"rank*.{kind}"):
        try:
            times.append(os.stat(path).st_mtime)
        except OSError:
            pass
    return times


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
