"""What Linux's /proc says of a process: read by the launcher (is a worker gone, whose child is it,
which process group) and by the offload lock (which process holds it, told apart from a later one
that reuses its pid)."""

from __future__ import annotations


def proc_stat(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` from the state on (state, ppid, pgrp, ...; field 3 of
    proc(5) is index 0), or None if there is no such process or no /proc. Split after the last ")":
    the process name before it may hold spaces and parentheses."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_time(pid: int) -> str:
    """When process ``pid`` started (field 22 of /proc/<pid>/stat, in clock ticks since boot), ""
    where unknown: with the pid it names one process, as pids are reused."""
    fields = proc_stat(pid)
    return fields[19] if fields is not None and len(fields) > 19 else ""
