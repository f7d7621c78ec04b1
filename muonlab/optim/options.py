"""Muon's optimizer-wide options: one frozen, checked record (``MuonOptions``).

The per-group hyperparameters (lr, momentum, weight decay, Newton-Schulz steps, ...) live in the
parameter groups, where torch's schedulers change them. The options here apply to the whole
optimizer: how Newton-Schulz runs, what crosses the wire, how batches are planned, what a
non-finite gradient does. Each is checked when a ``MuonOptions`` is made, and each error names its
option. A change is a new record: ``Muon``'s attributes of the same names read from its
``options`` and, set, make a checked new one (``OptionAttribute``), which the next step's prepared
key sees (muonlab.optim.prepared).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..comm.cost import HardwareProfile, get_profile
from ..comm.planner import REMAINDER_PATHS, STRATEGIES
from ..kernels.newton_schulz import NSConfig, resolve_form
from .step_gate import NONFINITE_DECISIONS
from .validation import check_comm_dtype, check_memory_options

NONFINITE_POLICIES = ("skip", "raise", "ignore")


@dataclass(frozen=True, kw_only=True)
class MuonOptions:
    """Muon's optimizer-wide options (their meanings: ``Muon``'s docstring), checked when made.

    ``hardware_profile=None`` becomes the profile of this machine's kind ("h100_node" where CUDA is
    available, else "cpu_gloo"); a name becomes its ``HardwareProfile``.
    """

    ns_dtype: torch.dtype | str | None = "auto"
    ns_form: str = "auto"
    ns_backend: str = "auto"
    momentum_dtype: torch.dtype | None = None
    workspace_bytes: int | None = None
    ns_graphs: bool = False
    process_group: Any = None
    comm_dtype: torch.dtype = torch.bfloat16
    remainder_path: str = "auto"
    strategy: str = "muonlab"
    hardware_profile: HardwareProfile | str | None = None
    nonfinite: str = "skip"
    nonfinite_decision: str = "host"

    def __post_init__(self) -> None:
        NSConfig(dtype=self.ns_dtype, **resolve_form(self.ns_form), backend=self.ns_backend)  # a bad ns_*
        check_memory_options(self.momentum_dtype, self.workspace_bytes, self.ns_graphs)
        pg = self.process_group
        if pg is not None and not (dist.is_available() and isinstance(pg, dist.ProcessGroup)):
            raise TypeError(f"process_group must be a torch.distributed ProcessGroup or None, got "
                            f"{type(pg).__name__} (for a DeviceMesh axis pass mesh.get_group(axis))")
        check_comm_dtype(self.comm_dtype)
        choices_of = (("remainder_path", self.remainder_path, REMAINDER_PATHS),
                      ("strategy", self.strategy, STRATEGIES),
                      ("nonfinite policy", self.nonfinite, NONFINITE_POLICIES),
                      ("nonfinite_decision", self.nonfinite_decision, NONFINITE_DECISIONS))
        for option, value, choices in choices_of:
            if not isinstance(value, str) or value not in choices:
                raise ValueError(f"unknown {option} {value!r}; choose one of {choices}")
        if self.nonfinite_decision == "device" and self.nonfinite != "skip":
            raise ValueError(f'nonfinite_decision="device" decides a skip on the device and needs nonfinite="skip", '
                             f'got nonfinite={self.nonfinite!r} ("raise" reads the flag on the host to raise)')
        profile = self.hardware_profile
        if profile is None:
            profile = "h100_node" if torch.cuda.is_available() else "cpu_gloo"
        if not isinstance(profile, (str, HardwareProfile)):
            raise TypeError(f"hardware_profile must be a profile name or a HardwareProfile, got {profile!r}")
        object.__setattr__(self, "hardware_profile", get_profile(profile))  # frozen: resolved once, here


class OptionAttribute:
    """A ``Muon`` attribute that reads its ``options``' field of the same name; set, it replaces
    ``options`` by a checked copy with the new value (a refused value changes nothing)."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, obj, owner=None):
        return self if obj is None else getattr(obj.options, self.name)

    def __set__(self, obj, value) -> None:
        obj.options = dataclasses.replace(obj.options, **{self.name: value})
