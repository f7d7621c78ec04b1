"""The prepared step: what a Muon step depends on that rarely changes, made once and reused.

A step has a part that depends on the layout, the settings and which parameters have gradients
(validating them, describing the step for the ranks' agreement, the plan, the Newton-Schulz
configs) and a part that repeats (momentum, paths, Newton-Schulz, update, AdamW). Muon makes a
``PreparedStep`` on the first step and again only when its ``key`` changes; the key is built at
every step from Python attributes alone (no device read), so a steady-state step pays a tuple
comparison for it. Settings that a scheduler may change at every step (lr, momentum, weight decay,
betas) are not in the key: they are read by the hot step, checked when they change
(``settings_values``), and enter the step's agreement digest through ``step_digest``. A tensor lr is
the exception: its value stays on the device (``TensorSetting``), checked when the tensor is new.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from ..comm.specs import DTensor
from .agreement import digest
from .validation import SETTINGS

PLAN_SETTINGS = {"muon": ("ns_steps", "ns_coefficients", "eps", "update_rule", "adjust_lr"), "adamw": ()}
"""The group settings a prepared step is made from (the Newton-Schulz config, which the plan's
batches carry; the update rule, which may refuse a layout; adjust_lr, whose lr ratios the step
program holds): a change of one makes a new prepared step. The other settings are read per step."""


class TensorSetting:
    """A tensor setting (a tensor lr) as the per-step check sees it, without reading its value (on a
    GPU a read would synchronise): equal while it is the same tensor with the same dtype, device and
    shape, so a new tensor is checked once, and a fill in place (a scheduler's) is read where the step
    uses it, on the device. Its repr, which the ranks' agreement digest reads, holds no identity."""

    __slots__ = ("ident", "meta")

    def __init__(self, tensor: torch.Tensor):
        self.ident = id(tensor)
        self.meta = (str(tensor.dtype), tensor.device.type, tuple(tensor.shape))

    def __eq__(self, other) -> bool:
        return isinstance(other, TensorSetting) and (self.ident, self.meta) == (other.ident, other.meta)

    def __hash__(self) -> int:
        return hash((self.ident, self.meta))

    def __repr__(self) -> str:
        return f"tensor{self.meta}"


def frozen(value: Any) -> Any:
    """``value`` as an immutable, comparable value: lists as tuples (a list changed in place would
    otherwise compare equal to the key holding it), tensors (a tensor lr) as a ``TensorSetting``."""
    if isinstance(value, (list, tuple)):
        return tuple(frozen(v) for v in value)
    if isinstance(value, torch.Tensor):
        return TensorSetting(value)
    return value


def group_key(group: dict) -> tuple:
    """One parameter group's part of the prepared step's key: the group itself (the hot step reads
    its settings from that dict), its algorithm, plan settings, and per parameter its identity,
    global shape, dtype, device, placements (a DTensor's) and whether (as which type) it has a
    gradient."""
    algorithm = group["algorithm"]
    # made at every step: one comprehension, no call per parameter (placements read off the spec)
    return (id(group), algorithm, frozen(tuple([group.get(k) for k in PLAN_SETTINGS.get(algorithm, ())])),
            tuple([(id(p), p.shape, p.dtype, p.device,
                    p._spec.placements if DTensor is not None and isinstance(p, DTensor) else None,
                    None if p.grad is None else type(p.grad)) for p in group["params"]]))


def settings_values(groups: list[dict]) -> tuple:
    """Every group's settings (``SETTINGS`` of its algorithm, and a "momentum" a scheduler cycles
    into an AdamW group), frozen: compared at every step, checked when they change. The group's
    number of keys too: a key written in later (another algorithm's setting, refused by the check)
    changes no value read here."""
    # read at every step: comprehensions, and ``frozen`` only for values that need it
    return tuple([tuple([v if type(v) in _PLAIN else frozen(v)
                         for v in [g.get(k) for k in SETTINGS.get(g.get("algorithm"), ())] + [g.get("momentum"), len(g)]])
                  for g in groups])


_PLAIN = frozenset((float, int, bool, str, type(None)))
"""Setting types ``frozen`` leaves as they are."""


@dataclass(frozen=True)
class PreparedStep:
    """What a step reuses while its key holds."""

    key: tuple
    """Each group's ``group_key`` and the optimizer's ``MuonOptions`` (muonlab.optim.options)."""
    work: dict[str, list[tuple[dict, list[torch.Tensor]]]]
    """Per algorithm ("muon", "adamw"): (group, its parameters with a gradient), in the optimizer's
    order; a parameter's grad is read at each step."""
    indices: tuple[int, ...]
    """The Muon entry index of each Muon parameter with a gradient: what the plan covers."""
    checked: tuple[torch.Tensor, ...]
    """Every parameter with a gradient (Muon's, then AdamW's): the non-finite check reads their grads."""
    static_digest: int
    """Digest of the step's description without the per-step settings (``step_digest`` adds them);
    0 where no other rank takes the step."""
    check_group: Any
    """The process group whose ranks take the step together (None: this process alone, or a group
    of one rank: nothing to exchange)."""
    clock: Any = None
    """Where the step's work runs, for the tracer's clock (muonlab.optim.step_stats.clock_device)."""
    plain: bool = True
    """No parameter in ``checked`` is a DTensor: their grads are their own local shards."""
    rank: int = 0
    """This process's global rank (0 when not distributed)."""
    planned: Any = None
    """The plan with what it needs (Muon's ``_Planned``), once made and checked across ranks."""
    program: Any = None
    """(the plan, its ``StepProgram``), made by the first step that runs the kept plan."""

    @cached_property
    def replicas(self) -> tuple[torch.Tensor, ...]:
        """The Muon parameters with a gradient that the plan takes as replicas (plain tensors under
        a multi-rank group: layout "replicated", see muonlab.comm.specs), whose gradients each step
        compares across ranks (muonlab.optim.replicas.fingerprints). DTensors are not: FSDP2's
        shards differ by design, and a Replicate DTensor's gradient is kept equal by DTensor."""
        if self.check_group is None:
            return ()
        return tuple(p for p in self.checked[:len(self.indices)] if DTensor is None or not isinstance(p, DTensor))


def step_digest(prepared: PreparedStep, settings: tuple) -> int:
    """The digest the ranks compare at this step: the prepared step's and the current settings."""
    return digest([prepared.static_digest, settings])
