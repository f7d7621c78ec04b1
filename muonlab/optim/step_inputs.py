"""What a Muon step takes, checked when a prepared step is made: the parameters with gradients per
group (``collect``), the groups' settings (``check_settings``), and the step described for the
ranks' agreement (``step_description``). Each function takes the optimizer's parts it reads: its
``param_groups``, ``state`` and parameter names and views (``NamedParams``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm.collectives import rank_or_zero
from ..comm.specs import DTensor, local_shard
from .agreement import digest
from .prepared import PreparedStep
from .saved_state import rule_shapes
from .validation import SETTINGS, check_hyperparameters, fmt_shape, grad_layout_mismatch, state_mismatch


def check_settings(param_groups: list[dict], named) -> None:
    """Every group's settings in range, and a tensor lr on its parameters' device (read there by
    the step) or on the CPU; the lr first: reading a tensor lr on the wrong device fails."""
    for gi, group in enumerate(param_groups):
        lr = group["lr"]
        if isinstance(lr, torch.Tensor) and lr.device.type != "cpu":
            for p in group["params"]:
                if local_shard(p).device != lr.device:
                    raise ValueError(f"parameter group {gi}'s tensor lr is on {lr.device} and its parameter "
                                     f"{named.label(p)} on {local_shard(p).device}: put lr on the parameters' device")
        check_hyperparameters(group, group["algorithm"], "", f" in parameter group {gi}")


def collect(param_groups: list[dict], state: dict, named) -> dict[str, list]:
    """Parameters with grads, per group; every grad, and the shape of each one's state, is
    checked before anything is modified (when a prepared step is made: torch itself refuses a
    grad of another shape, dtype or device than its parameter's)."""
    work: dict[str, list] = {"muon": [], "adamw": []}
    for group in param_groups:
        params = []
        for p in group["params"]:
            g = p.grad
            if g is None:
                continue
            if g.is_sparse:
                raise ValueError(f"parameter {named.label(p)} has a sparse gradient; Muon needs dense gradients")
            if torch.is_complex(g):
                raise ValueError(f"parameter {named.label(p)} has a complex gradient")
            if not g.is_floating_point():
                raise TypeError(f"parameter {named.label(p)} has a gradient of dtype {g.dtype}; "
                                "gradients must be floating point")
            if g.shape != p.shape:
                raise ValueError(f"parameter {named.label(p)} has a gradient of shape {fmt_shape(g.shape)}")
            layout = grad_layout_mismatch(p, g)
            if layout:
                raise ValueError(f"parameter {named.label(p)} has {layout}")
            mismatch = state_mismatch(p, state[p], rule_shapes(group, p, named.view_of(p))) if p in state else None
            if mismatch:
                raise ValueError(
                    f"parameter {named.label(p)} has state {mismatch}: it changed shape after its state "
                    "was made (e.g. resize_token_embeddings); drop its state (del opt.state[p]) or "
                    "rebuild the optimizer")
            params.append(p)
        if params:
            work[group["algorithm"]].append((group, params))
    return work


def muon_indices(work: list[tuple[dict, list[torch.Tensor]]], entries: list) -> tuple[int, ...]:
    """The Muon entry index of each parameter of ``work`` (the Muon part of ``collect``'s)."""
    position = {id(p): i for i, (_, p) in enumerate(entries)}
    return tuple(position[id(p)] for _, params in work for p in params)


def plan_names(checked: tuple, indices: tuple, params: tuple, names: dict) -> list[str]:
    """Names of Muon parameters as the plan gives them (an unnamed one: "param<entry index>");
    ``checked``/``indices``: the prepared step's parameters and their Muon entry indices."""
    index = {id(p): i for p, i in zip(checked, indices)}
    return [names.get(p, f"param{index[id(p)]}") for p in params]


def step_description(work: dict[str, list], param_groups: list[dict], names: dict, ns_config_of, options,
                     budget_bytes: int | None, momentum_offload: str | None, settings: bool = True) -> list[tuple]:
    """What this rank is about to do, for muonlab.optim.agreement: each parameter with a
    gradient (its name, or its place for an unnamed one; global shape, dtype; its group's
    Newton-Schulz config, ``ns_config_of(group)``, and, with ``settings``, its settings), then the
    step's options (``budget_bytes``: the Newton-Schulz workspace budget, None without Muon
    parameters; ``momentum_offload``: where momentum is offloaded, or None)."""
    place: dict[int, str] = {}  # of unnamed parameters, made only if one has a gradient

    def name_of(p: torch.Tensor) -> str:
        if p in names:
            return names[p]
        if not place:
            place.update((id(q), f"#{k} of group {gi}")
                         for gi, g in enumerate(param_groups) for k, q in enumerate(g["params"]))
        return place[id(p)]

    items = []
    for kind in ("muon", "adamw"):
        for group, params in work[kind]:
            fields = ()
            if settings:
                # a tensor setting read here, where ranks already disagree (the digest holds its kind only)
                fields = tuple((k, f"tensor {float(group[k]):g} ({group[k].dtype} on {group[k].device.type})"
                                if torch.is_tensor(group[k]) else group[k]) for k in SETTINGS[kind])
            if kind == "muon":
                fields += (("newton_schulz", repr(ns_config_of(group))),)
            for p in params:
                items.append((kind, name_of(p), (("shape", tuple(p.shape)), ("dtype", str(p.dtype))) + fields))
    items.append(("options", "", (("nonfinite", options.nonfinite),
                                  ("nonfinite_decision", options.nonfinite_decision),
                                  ("comm_dtype", str(options.comm_dtype)),
                                  ("workspace budget (workspace_bytes)", budget_bytes),
                                  ("strategy", options.strategy), ("remainder_path", options.remainder_path),
                                  ("momentum offload", momentum_offload or "none"))))
    return items


def new_prepared_step(key: tuple, work: dict[str, list], entries: list, group, describe, clock) -> PreparedStep:
    """A prepared step of ``work`` (``collect``'s) under ``key``; ``group``: the one whose ranks take
    the step together (a group of one rank has nothing to agree on); ``describe(work)``: the step's
    description without its per-step settings (``step_description``), digested only where other
    ranks take the step; ``clock``: the tracer's device (``clock_device``)."""
    together = group is not None and dist.get_world_size(group) > 1
    checked = tuple(p for kind in ("muon", "adamw") for _, ps in work[kind] for p in ps)
    return PreparedStep(
        key=key, work=work, indices=muon_indices(work["muon"], entries), checked=checked,
        static_digest=digest(describe(work)) if together else 0, check_group=group if together else None,
        clock=clock, plain=DTensor is None or not any(isinstance(p, DTensor) for p in checked), rank=rank_or_zero())


def graph_key(prepared: PreparedStep, settings: tuple) -> tuple:
    """What a captured step depends on: the prepared step, the groups' ``settings`` (a tensor lr by
    identity), and where every parameter and gradient it reads lies (muonlab.optim.step_graph)."""
    places = tuple((local_shard(p).data_ptr(), local_shard(p.grad).data_ptr()) for p in prepared.checked)
    return prepared.key, settings, places
