"""muonlab: a JupyterLab-first research toolkit for the Muon optimizer at scale."""

import importlib

from . import runs  # run records: muonlab.runs.list(), load(name)
from .calibration import calibrate  # a HardwareProfile measured here: muonlab.calibrate()
from .kernels import PRESETS, NSConfig, newton_schulz, ns_flops
from .optim import Muon, RoutingWarning, attention_blocks, muon_param_groups
from .train import History, compare_optimizers, make_optimizer, train

# Reachable as muonlab.<name> after a plain `import muonlab` (as the README writes them), but
# imported on first use: torch.distributed.checkpoint and the launcher are slow to import.
_LAZY_MODULES = ("checkpoint", "distributed", "launcher", "simulate", "viz", "experiments")


def __getattr__(name):
    if name in _LAZY_MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name == "launch":  # muonlab.launch(fn, nprocs, ...) is muonlab.launcher.launch
        return importlib.import_module(f"{__name__}.launcher").launch
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "PRESETS",
    "History",
    "NSConfig",
    "Muon",
    "RoutingWarning",
    "attention_blocks",
    "calibrate",
    "compare_optimizers",
    "launch",
    "make_optimizer",
    "muon_param_groups",
    "newton_schulz",
    "ns_flops",
    "runs",
    "train",
    *_LAZY_MODULES,
]
