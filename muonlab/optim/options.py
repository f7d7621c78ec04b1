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
import difflib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..comm.cost import HardwareProfile, get_profile
from ..comm.planner import REMAINDER_PATHS, STRATEGIES
from ..kernels.config import NSConfig
from ..kernels.newton_schulz import resolve_form
from .step_gate import NONFINITE_DECISIONS
from .step_graph import check_capture
from .validation import ADAMW_DEFAULTS, MUON_DEFAULTS, check_comm_dtype, check_memory_options

NONFINITE_POLICIES = ("skip", "raise", "ignore")


def check_memory_budget(value) -> None:
    """``memory_budget``: bytes per rank (an int >= 0), None (no limit) or "auto" (on CUDA the
    device's free memory when a plan is made; no limit elsewhere)."""
    if value is None or value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f'memory_budget must be an int (bytes per rank), None or "auto", got {value!r}')
    if value < 0:
        raise ValueError(f"memory_budget must be >= 0 bytes per rank, got {value}")


@dataclass(frozen=True, kw_only=True)
class MuonOptions:
    """Muon's optimizer-wide options (their meanings: ``Muon``'s docstring), checked when made.

    ``memory_budget``: bytes per rank the optimizer step's buffers and Newton-Schulz workspace may
    take (muonlab.comm.memory); a step whose new plan needs more raises a ValueError naming the
    batch and a ``workspace_bytes`` that fits, before it changes anything. "auto": on CUDA the
    device's free memory when the plan is made (the least over the ranks), no limit elsewhere;
    None: no limit.

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
    comm_dtype: torch.dtype | str = "auto"
    remainder_path: str = "auto"
    strategy: str = "muonlab"
    hardware_profile: HardwareProfile | str | None = None
    nonfinite: str = "skip"
    nonfinite_decision: str = "host"
    capture_after: int | None = None
    memory_budget: int | str | None = "auto"

    def __post_init__(self) -> None:
        NSConfig(dtype=self.ns_dtype, **resolve_form(self.ns_form), backend=self.ns_backend)  # a bad ns_*
        check_memory_options(self.momentum_dtype, self.workspace_bytes, self.ns_graphs)
        pg = self.process_group
        if pg is not None and not (dist.is_available() and isinstance(pg, dist.ProcessGroup)):
            raise TypeError(f"process_group must be a torch.distributed ProcessGroup or None, got "
                            f"{type(pg).__name__} (for a DeviceMesh axis pass mesh.get_group(axis))")
        check_comm_dtype(self.comm_dtype)
        check_memory_budget(self.memory_budget)
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
        check_capture(self)  # what needs the parameters (CUDA, no state offload): Muon checks it
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


OPTION_NAMES = tuple(f.name for f in dataclasses.fields(MuonOptions))

CONSTRUCTOR_ONLY = ("fused_banks", "matrix_views", "state_offload", "offload_dir", "keep_muon_momentum_in_memory")
"""Muon's arguments read once, at construction: the parameters' matrix views and the state's home
(its stores and their files) are built from them, so a later change could not be applied soundly."""

GROUP_SETTINGS = {**{key: ("Muon", key) for key in MUON_DEFAULTS},
                  **{f"adamw_{key}": ("AdamW", key) for key in ADAMW_DEFAULTS}}
"""Muon's arguments that are parameter-group defaults -> (the groups' algorithm, the group key):
a step reads them from ``param_groups``, never from the optimizer."""


def check_options(value) -> None:
    """What may be assigned to ``Muon.options``: a ``MuonOptions``, whose fields are checked."""
    if not isinstance(value, MuonOptions):
        raise TypeError(f"options must be a MuonOptions (muonlab.optim.options), got {type(value).__name__}; "
                        "set one option by its attribute (opt.ns_form = \"plain\") or assign "
                        "dataclasses.replace(opt.options, ...)")


def check_attribute(name: str, known) -> None:
    """Refuse setting the public attribute ``name`` of a constructed Muon where the value would be
    silently ignored: an argument read only at construction, a parameter-group default, or a name
    close to an option or to one of ``known`` (the public attributes it has) that is none of them
    (a typo, which would otherwise make an attribute nothing reads). Other names pass."""
    if name in CONSTRUCTOR_ONLY:
        raise AttributeError(f"{name} can't be changed after construction (the parameters' views and the state's "
                             f"home are built from it): pass it to the constructor")
    if name in GROUP_SETTINGS:
        algorithm, key = GROUP_SETTINGS[name]
        raise AttributeError(f"{name} is a parameter-group setting, read from opt.param_groups: set "
                             f"group[{key!r}] in each {algorithm} group (for g in opt.param_groups: ...)")
    if name in known or name in OPTION_NAMES:
        return
    # 0.75: one edit (a swap, a letter missing or wrong) in a name of five letters or more
    close = difflib.get_close_matches(name, [*OPTION_NAMES, *CONSTRUCTOR_ONLY, *GROUP_SETTINGS, *known], n=1,
                                      cutoff=0.75)
    if close:
        raise AttributeError(f"Muon has no option or attribute {name!r}: did you mean {close[0]!r}? (an attribute "
                             "of another name would be stored and never read)")
