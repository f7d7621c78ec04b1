"""What every benchmark writes about the machine it ran on."""

from __future__ import annotations

import os
import platform
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
