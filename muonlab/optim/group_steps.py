"""The hot step's writing parts: an AdamW group's update (``adamw_group``) and the Muon batches
(``muon_batches``: momentum, paths, Newton-Schulz, update, through the step program). Both run
after the step's commit decision and write through ``gate`` where it is taken on the device
(muonlab.optim.step_gate); each takes the optimizer's parts it reads."""

from __future__ import annotations

import torch

from ..comm.collectives import CommCounter
from ..comm.engine import execute_plan
from ..comm.specs import local_shard
from . import functional as F
from .rule_step import RuleStage, ensure_rule_state, rule_of
from .saved_state import state_for
from .step_gate import StepGate
from .step_program import StepContext, StepProgram, lr_of


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


def muon_batches(planned, program: StepProgram, param_groups: list[dict], entries: list, state: dict, offload,
                 view_of, tracer, runner, device: torch.device, counter: CommCounter, gate: StepGate | None,
                 observer) -> None:
    """Batch by batch (see muonlab.comm.engine): momentum on the local shards, move,
    orthogonalize (``runner``), move back, update; only the batches in flight hold inputs and
    outputs. The stages are ``program``'s (muonlab.optim.step_program), made once per prepared
    step for ``planned``'s plan. ``observer``: the spectral observer of this step, or None."""
    stage = None
    if any(rule_of(g).transform is not None for g in param_groups if g["algorithm"] == "muon"):

        def rule_state(i: int) -> dict:
            p = entries[i][1]
            entry = state[p]  # a replica's rule state lives on every rank (muonlab.optim.rule_step)
            ensure_rule_state(entry, entries[i][0], p, view_of(p))
            return entry

        stage = RuleStage(entries=entries, specs=planned.specs, groups=planned.groups, state_of=rule_state,
                          counter=counter, apply_update=program.ruled_update, gate=gate)
    program.begin(StepContext(
        state=state, state_for=lambda p, group: state_for(state, p, "muon", offload, group, view_of),
        offload=offload, tracer=tracer, gate=gate, observer=observer, stage=stage))
    execute_plan(planned.plan, planned.groups, prepare=program.prepare, apply=program.apply,
                 orthogonalize=runner, tracer=tracer, counter=counter, device=device,
                 contexts=program.contexts)  # wire: each batch's
    if stage is not None:
        stage.flush()  # the last batch whose rule's sums travelled
