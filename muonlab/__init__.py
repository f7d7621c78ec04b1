"""muonlab: a JupyterLab-first research toolkit for the Muon optimizer at scale."""

from .kernels import PRESETS, NSConfig, newton_schulz, ns_flops
from .optim import Muon, muon_param_groups
from .train import History, compare_optimizers, make_optimizer, train

__all__ = [
    "PRESETS",
    "History",
    "NSConfig",
    "Muon",
    "compare_optimizers",
    "make_optimizer",
    "muon_param_groups",
    "newton_schulz",
    "ns_flops",
    "train",
]
