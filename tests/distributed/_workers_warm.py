"""Worker functions for tests/distributed/test_launch_warm.py (warm workers): importable, as
launch() runs them in its worker processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from muonlab.launcher import report_progress


def pid_and_steps(steps: int, tag: str) -> dict:
    """Report ``steps`` steps (loss = step), print ``tag`` to this rank's stdout and stderr, check
    the group with an all_reduce; return this process's pid and what a fresh worker would see."""
    print(f"stdout {tag} rank {dist.get_rank()}", flush=True)
    print(f"stderr {tag} rank {dist.get_rank()}", file=sys.stderr, flush=True)
    for step in range(1, steps + 1):
        report_progress(step=step, loss=float(step), total=steps)
    total = torch.tensor([1.0])
    dist.all_reduce(total)
    return {"pid": os.getpid(), "world": int(total.item()), "cwd": os.getcwd(),
            "leak": os.environ.get("MUONLAB_TEST_LEAK"), "dtype": str(torch.get_default_dtype()),
            "grad": torch.is_grad_enabled(), "time": time.time(), "seed": torch.initial_seed()}


def change_process_state() -> int:
    """What a task may do to its process that the next task must not see."""
    os.environ["MUONLAB_TEST_LEAK"] = "leaked"
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    os.chdir("/")
    torch.manual_seed(dist.get_rank())  # ranks seeded apart, as data per rank is
    return dist.get_rank()


def start_child(out_dir: str) -> int:
    """Start a long-lived process (as a data tool would), note its pid, return."""
    child = subprocess.Popen(["sleep", "600"])
    with open(os.path.join(out_dir, f"child{dist.get_rank()}.pid"), "w") as f:
        f.write(str(child.pid))
    return child.pid


def fail_on_rank(rank: int) -> int:
    if dist.get_rank() == rank:
        raise ValueError(f"deliberate failure in a warm task on rank {rank}")
    dist.barrier()  # the other rank waits in a collective, as real code would
    return dist.get_rank()


def hang_on_rank(rank: int) -> int:
    if dist.get_rank() == rank:
        while True:
            time.sleep(1)
    return dist.get_rank()


def exit_on_rank(rank: int, code: int) -> int:
    """``sys.exit(code)`` on one rank; the other waits in a collective."""
    if dist.get_rank() == rank:
        sys.exit(code)
    dist.barrier()
    return dist.get_rank()


def interrupt_on_rank(rank: int, out_dir: str) -> int:
    """KeyboardInterrupt on ``rank`` (its wall time written to ``out_dir/raised`` first); the other
    ranks sleep up to a minute outside any collective, so only the failing rank's own report can
    end the launch before then."""
    if dist.get_rank() == rank:
        with open(os.path.join(out_dir, "raised"), "w") as f:
            f.write(repr(time.time()))
        raise KeyboardInterrupt("deliberate interrupt in a warm task")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.1)
    return dist.get_rank()
