"""The hot step's AdamW part: one group's update (``adamw_group``), after the step's commit
decision, written through ``gate`` where it is taken on the device (muonlab.optim.step_gate). The
Muon batches are the step program's (muonlab.optim.step_program.StepProgram.run)."""

from __future__ import annotations

import torch

from ..comm.specs import local_shard
from . import functional as F
from .saved_state import state_for
from .step_gate import StepGate
from .step_program import lr_of


def adamw_group(group: dict, params: list[torch.Tensor], state: dict, offload, gate: StepGate | None,
                on_device: bool) -> None:
    """One AdamW group's update of ``params`` (those with a gradient), its moments kept in
    ``offload``'s stores. ``on_device``: no host read (muonlab.optim.functional.adamw_): the step
    count lives with the parameter (a device decision, a tensor lr, a captured step)."""
    items = [(p, p, state_for(state, p, "adamw", offload)) for p in params]
    on_device = on_device or isinstance(group["lr"], torch.Tensor)
    if on_device:
        for p in params:
            step = state[p]["step"]
            if step.device != local_shard(p).device:
                state[p]["step"] = step.to(local_shard(p).device)
    beta1, beta2 = group["betas"]
    beta1 = group.get("momentum", beta1)  # a scheduler cycling momentum: see Muon's docstring
    # one parameter at a time (adamw_ is a loop over its lists, so this is the same arithmetic):
    # only the state being updated is on the device
    for p, (exp_avg, exp_avg_sq) in offload.each(items, ("exp_avg", "exp_avg_sq")):
        F.adamw_(
            [local_shard(p)], [local_shard(p.grad)], [exp_avg], [exp_avg_sq], [state[p]["step"]],
            lr=lr_of(group),
            betas=(beta1, beta2),
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            gate=gate,
            on_device=on_device,
        )
