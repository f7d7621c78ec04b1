"""Session-wide test settings.

Without CUDA, Triton kernels can only run under its interpreter, which must be chosen before the
kernel module is imported; setting it here, first, keeps every test module's import order safe.
muonlab never picks the interpreter by itself (backend="auto" needs CUDA for Triton).
"""

import contextlib
import json
import os
import resource
import time

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# after the interpreter is chosen: importing muonlab imports its kernel module
from muonlab.processes import proc_stat  # noqa: E402

from ._proc import descendants  # noqa: E402


def _share_the_cores_among_xdist_workers() -> None:
    """On xdist workers (`make test` runs TEST_WORKERS of them) each worker, and the notebook kernels
    and processes it starts, gets its share of the cores as torch threads. Left at torch's default,
    every worker takes every core and their OpenMP threads spin against each other: on 2 cores, 2
    workers spent 1.8x the CPU time of one process for the same suite."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


_share_the_cores_among_xdist_workers()


@pytest.fixture
def cuda_sync_errors():
    """A context manager under which any CUDA call that waits for the GPU raises
    (``torch.cuda.set_sync_debug_mode("error")``), with the device idle before and after."""

    @contextlib.contextmanager
    def errors():
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()

    return errors


LONGEST_FIRST = (
    "tests/browser/",
    "tests/test_notebooks_at_default_size.py::TestAtDefaultSize_08",
    "tests/test_notebooks_at_default_size.py::TestAtDefaultSize_01",
    "tests/test_notebooks_at_default_size.py::TestAtDefaultSize_06",
    "tests/test_notebooks_at_default_size.py::TestAtDefaultSize_07",
    "tests/test_notebooks_at_default_size.py",
)
"""The scopes that take longest (JupyterLab in Chromium, 150 CPU-s; each notebook at its default
size, 40-130 CPU-s; from a fresh clone's MUONLAB_TEST_CPU_LOG), in that order."""


def pytest_collection_modifyitems(session, config, items):
    """Run the longest scopes first: xdist hands scopes to its workers in collection order, and a
    long one handed out last ran alone on one worker for minutes at the end of `make test` while
    the other sat idle. Sorting is stable and the same on every worker, as xdist requires."""
    def rank(item) -> int:
        return next((i for i, prefix in enumerate(LONGEST_FIRST) if item.nodeid.startswith(prefix)),
                    len(LONGEST_FIRST))

    items.sort(key=rank)


def pytest_terminal_summary(terminalreporter):
    """Say why the browser tests did not run (a missing Chromium): among the suite's other skips
    (no GPU, no Triton, ...) a quiet run would not show it, and `make test` would look complete."""
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if r.nodeid.startswith("tests/browser/")]
    if not skipped:
        return
    reasons = sorted({r.longrepr[2].removeprefix("Skipped: ") for r in skipped if isinstance(r.longrepr, tuple)})
    terminalreporter.write_sep("-", "browser tests not run")
    terminalreporter.write_line(f"{len(skipped)} test(s) in tests/browser skipped: {'; '.join(reasons)}")


CPU_LOG_ENV = "MUONLAB_TEST_CPU_LOG"
"""A file path: each test's CPU seconds (this process and every process under it) and wall
seconds are appended to it as JSON lines, one per test, from every xdist worker. What `make test`'s
time is spent on; processes that outlive their test (a warm pool) count as they run."""


class _ProcessTreeCPU:
    """CPU seconds of this process and of every process under it, each counted by its own time.

    The children's rusage counts only children this process waited for, and launch()'s workers are
    children of a forkserver (a notebook's, of a kernel's forkserver) that this process never waits
    for. So the processes under this one are read from /proc every ``EVERY_S`` and each keeps the
    last CPU time seen (keyed by pid and start time: pids are reused); what a process spends in
    its last ``EVERY_S``, or a process that lives less than that, is missed (a fraction of a second
    per process)."""

    EVERY_S = 0.2

    def __init__(self) -> None:
        import threading

        self.tick = os.sysconf("SC_CLK_TCK")
        self.last: dict[tuple[int, str], float] = {}
        self.lock = threading.Lock()
        threading.Thread(target=self._run, daemon=True, name="test-cpu-sampler").start()

    def sample(self) -> None:
        seen = {}
        for pid in descendants(os.getpid()):
            fields = proc_stat(pid)
            if fields is None:
                continue
            # utime, stime (the process's own, not its waited children's: those are counted themselves)
            seen[(pid, fields[19])] = (int(fields[11]) + int(fields[12])) / self.tick
        with self.lock:
            self.last.update(seen)

    def _run(self) -> None:
        while True:
            time.sleep(self.EVERY_S)
            self.sample()

    def seconds(self) -> float:
        self.sample()
        own = resource.getrusage(resource.RUSAGE_SELF)
        with self.lock:
            return own.ru_utime + own.ru_stime + sum(self.last.values())


_TREE: _ProcessTreeCPU | None = None


def _cpu_seconds() -> float:
    global _TREE
    if _TREE is None:
        _TREE = _ProcessTreeCPU()
    return _TREE.seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    log = os.environ.get(CPU_LOG_ENV)
    if not log:
        yield
        return
    cpu, wall = _cpu_seconds(), time.monotonic()
    yield
    line = json.dumps({"test": item.nodeid, "cpu_s": round(_cpu_seconds() - cpu, 2),
                       "wall_s": round(time.monotonic() - wall, 2)})
    with open(log, "a") as f:  # one short line per write: appends from several workers do not interleave
        f.write(line + "\n")
