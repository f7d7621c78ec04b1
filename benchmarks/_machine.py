"""What every benchmark writes about the machine it ran on."""

from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path

import torch


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine() -> str:
    """CPU, cores, torch and its threads, Python: one line."""
    return (f"{cpu_name()}, {os.cpu_count()} logical cores, torch {torch.__version__}, "
            f"torch threads {torch.get_num_threads()}, Python {platform.python_version()}")


def load() -> str:
    """The load average (the machine may be shared while a benchmark runs)."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


class MatmulProbe:
    """Times one n x n x n torch.matmul per dtype whenever ``probe()`` is called (once per round).

    Measured inside the rounds, next to the configurations, so the reference rate sees the same
    load as they do; ``rate(dtype)`` is the GFLOP/s of the median time.
    """

    def __init__(self, n: int):
        gen = torch.Generator().manual_seed(0)
        self.n = n
        self.mats = {d: (torch.randn(n, n, generator=gen).to(dt), torch.randn(n, n, generator=gen).to(dt))
                     for d, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
        self.times: dict[str, list[float]] = {d: [] for d in self.mats}
        for a, b in self.mats.values():
            a @ b  # warm-up

    def probe(self, record: bool = True) -> None:
        for d, (a, b) in self.mats.items():
            t0 = time.perf_counter()
            a @ b
            if record:
                self.times[d].append(time.perf_counter() - t0)

    def rate(self, d: str) -> float:
        return 2 * self.n**3 / statistics.median(self.times[d]) / 1e9
