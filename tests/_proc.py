"""The tests' one reader of Linux's process table (/proc): children, descendants, a process's
stat fields, whether it is alive. Used by the CPU log (tests/conftest.py), the browser test's
clean-up and the launcher tests' worker sampling, which must see processes they never wait for
(launch()'s workers are a forkserver's children; Jupyter kernels start process groups of their own)."""

from __future__ import annotations

import os


def children(pid: int) -> list[int]:
    """The direct children of ``pid`` (every thread's: a child belongs to the thread that forked
    it); [] once ``pid`` has ended."""
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out.extend(map(int, f.read().split()))
    except OSError:  # ended meanwhile
        pass
    return out


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, parents before their children."""
    found, todo = [], children(pid)
    while todo:
        child = todo.pop(0)
        found.append(child)
        todo.extend(children(child))
    return found


def stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state first: field 3 of proc(5) is
    index 0 here), or None once the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def cmdline(pid: int) -> bytes:
    """The command line of ``pid`` (NUL-separated), b"" once it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (an ended child nobody waited for yet)."""
    fields = stat_fields(pid)
    return fields is not None and fields[0] != "Z"
