"""The tests' one reader of Linux's process table (/proc): children, descendants, a command line,
whether a process is alive (stat fields through muonlab.processes.proc_stat, the launcher's reader).
Used by the CPU log (tests/conftest.py), the browser test's clean-up and the launcher tests' worker
sampling, which must see processes they never wait for (launch()'s workers are a forkserver's
children; Jupyter kernels start process groups of their own)."""

from __future__ import annotations

import os

from muonlab.processes import proc_stat


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


def cmdline(pid: int) -> bytes:
    """The command line of ``pid`` (NUL-separated), b"" once it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and runs (a zombie, an ended child nobody waited for yet, does not)."""
    fields = proc_stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")
