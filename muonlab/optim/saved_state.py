"""Muon's state as saved and loaded: the state keys each algorithm keeps, a parameter's state made
when missing (``state_for``), and loading a saved state dict as functions over the optimizer's
``param_groups``, ``state`` and state stores: every saved group and state tensor checked before
anything changes (``checked_state_dict``), then torch's loader, then state tensors restored in the
dtypes they are kept in (``restore_kept_dtypes``).
"""

from __future__ import annotations

import math

import torch

from ..comm.specs import local_shard
from .rule_step import ensure_rule_state, state_shapes
from .rules import RULE_STATE_KEYS, RULES
from .validation import check_hyperparameters, is_number, state_mismatch

STATE_KEYS = {"muon": ("momentum_buffer",), "adamw": ("step", "exp_avg", "exp_avg_sq")}
"""The state each parameter of an algorithm holds once it has stepped (made by ``state_for``;
an update rule adds its own, ``muonlab.optim.rules``)."""



def state_for(state: dict, p: torch.Tensor, algorithm: str, offload, group: dict | None = None,
              view_of=None) -> dict:
    """p's entry of ``state`` (an optimizer's), its missing keys made: zeros where ``offload`` (the
    state stores) keeps them (device, host or the state file), never all on the device; with a
    Muon ``group``, its update rule's state too (``view_of(p)``: p's declared matrix view)."""
    entry = state[p]
    keys = STATE_KEYS[algorithm]
    if keys[-1] not in entry:  # new, or a replica's momentum dropped (muonlab.optim.momentum_homes)
        for key in keys:
            if key not in entry:
                entry[key] = torch.tensor(0.0) if key == "step" else offload.new(p, key)
    if group is not None and RULES[group["update_rule"]].state_keys:
        ensure_rule_state(entry, group, p, view_of(p))
    return entry


def rule_shapes(group: dict, p: torch.Tensor, view: str) -> dict[str, tuple[int, ...]]:
    """The shapes of the state a Muon group's update rule keeps for ``p`` of matrix view ``view``
    (none for AdamW)."""
    return state_shapes(group, p, view) if group.get("algorithm") == "muon" else {}


def checked_state_dict(state_dict: dict, param_groups: list[dict], offload, label, view_of) -> tuple[dict, list, set]:
    """``state_dict`` checked against the optimizer's ``param_groups`` before anything changes
    (``label(p)``: p's name for errors, ``view_of(p)``: its matrix view), as torch's loader is to
    take it: its groups with the settings they lack filled, its offloaded tensors left out (they go
    straight to their store, never through the parameter's device). Returns it, the (saved state,
    parameter) pairs and the offloaded keys, for ``restore_kept_dtypes``."""
    pairs = _saved_pairs(state_dict, param_groups, label, view_of)  # these two raise before anything changes
    state_dict = dict(state_dict, param_groups=_saved_groups(state_dict, param_groups))
    offloaded = {k for k, store in offload.by_key.items() if store.place is not None}
    if offloaded and isinstance(state_dict.get("state"), dict):
        state_dict = dict(state_dict, state={
            pid: {k: v for k, v in s.items() if k not in offloaded} for pid, s in state_dict["state"].items()})
    return state_dict, pairs, offloaded


def restore_kept_dtypes(pairs: list, state: dict, offload, offloaded: set) -> None:
    """After torch's loader: each saved state tensor of ``pairs`` kept in its own dtype (momentum:
    ``momentum_dtype``; AdamW moments and rule state: fp32), not the parameter's dtype torch's
    loader casts floating state to; offloaded ones adopted by their store; a step count that was a
    Python number made a tensor."""
    for saved, p in pairs:
        for key, value in saved.items():
            if key in offloaded and torch.is_tensor(value):
                state[p][key] = offload.adopt(p, key, value)
            elif key == "step" and not torch.is_tensor(value):
                state[p][key] = torch.tensor(float(value))
            elif key in RULE_STATE_KEYS and torch.is_tensor(value):  # fp32 where torch cast it to p's dtype
                state[p][key] = value.to(device=p.device, dtype=torch.float32, copy=True)
            elif torch.is_tensor(value) and key in offload.by_key \
                    and state[p][key].dtype != offload.dtype(p, key):
                state[p][key] = value.to(device=p.device, dtype=offload.dtype(p, key), copy=True)


def _saved_pairs(state_dict: dict, param_groups: list[dict], label, view_of) -> list[tuple[dict, torch.Tensor]]:
    """(saved state, parameter) in torch's order, each checked against its parameter."""
    if not isinstance(state_dict, dict) or not isinstance(state_dict.get("param_groups"), list) \
            or "state" not in state_dict:
        raise TypeError("state_dict must be a dict with 'state' and 'param_groups', as state_dict() returns")
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(param_groups) or any(
            not isinstance(a, dict) or len(a.get("params", ())) != len(b["params"])
            for a, b in zip(saved_groups, param_groups)):
        return []  # _saved_groups or torch's loader raise their own error for groups that don't line up
    saved_state = state_dict["state"]
    if not isinstance(saved_state, dict):
        raise TypeError(f"state_dict['state'] must be a dict {{param id: state}}, got {type(saved_state).__name__}")
    saved_ids = [i for g in saved_groups for i in g["params"]]
    # the saved groups' settings replace these (their update rule decides the state kept)
    settings = [{**g, **(s if isinstance(s, dict) else {})} for g, s in zip(param_groups, saved_groups)]
    params = [(g["algorithm"], p, group) for g, group in zip(param_groups, settings) for p in g["params"]]
    pairs = [(saved_state.get(pid, {}), p) for pid, (_, p, _) in zip(saved_ids, params)]
    for (saved, p), (algorithm, _, group) in zip(pairs, params):
        if not isinstance(saved, dict):
            raise TypeError(f"parameter {label(p)} has saved state of type {type(saved).__name__}, "
                            "not a dict")
        shapes = rule_shapes(group, p, view_of(p)) if group.get("update_rule") in RULES else {}
        wanted = STATE_KEYS[algorithm] + tuple(shapes)
        # a replica's momentum lives on one rank, its rule state on all (muonlab.optim.rule_step)
        if saved and set(saved) != set(wanted) and not (shapes and set(saved) == set(shapes)):
            raise ValueError(f"parameter {label(p)} ({algorithm}) has saved state keys {sorted(saved)}; "
                             f"expected {sorted(wanted)}")
        for key in wanted:
            if key in saved and key != "step" and not torch.is_tensor(saved[key]):
                raise TypeError(f"parameter {label(p)} has saved {key} of type "
                                f"{type(saved[key]).__name__}, not a tensor")
        mismatch = state_mismatch(p, saved, shapes)
        if mismatch:
            raise ValueError(f"parameter {label(p)} does not match the saved state: {mismatch} "
                             "(the state dict comes from a model of another shape)")
        step = saved.get("step", 0)
        if not (is_number(step) or torch.is_tensor(step) and step.numel() == 1):
            raise TypeError(f"parameter {label(p)} has a saved AdamW step of {step!r}; "
                            "expected a number or a one-element tensor")
        if not 0 <= float(step) < math.inf:
            raise ValueError(f"parameter {label(p)} has a saved AdamW step of {float(step)}; "
                             "expected a count >= 0")
    return pairs


def _saved_groups(state_dict: dict, param_groups: list[dict]) -> list:
    """The saved parameter groups, which replace this optimizer's settings, checked as groups
    given to the constructor are: the same algorithm as the group each replaces, settings in
    range. A setting the saved group lacks (saved before it existed) keeps this group's value."""
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(param_groups):
        return saved_groups  # torch's loader raises its own error for groups that don't line up
    filled = []
    for gi, (saved, group) in enumerate(zip(saved_groups, param_groups)):
        if not isinstance(saved, dict):
            raise TypeError(f"saved parameter group {gi} is a {type(saved).__name__}, not a dict")
        algorithm, theirs = group["algorithm"], saved.get("algorithm", "muon")
        if theirs != algorithm:
            raise ValueError(f"saved parameter group {gi} is a {theirs!r} group; this optimizer's group {gi} "
                             f"is {algorithm!r}")
        saved = {**{k: v for k, v in group.items() if k != "params"}, **saved}
        check_hyperparameters(saved, algorithm, "", f" in saved parameter group {gi}")
        filled.append(saved)
    return filled


def residency(state: dict, offload) -> dict[str, int]:
    """Muon.state_residency: bytes of the state kept by ``offload``'s stores on the parameters'
    device and offloaded, and the fetch window's peak."""
    out = dict(device_bytes=0, offloaded_bytes=0, peak_window_bytes=offload.peak_window_bytes())
    for entry in state.values():
        for key, value in entry.items():
            if key in offload.by_key and torch.is_tensor(value):
                local = local_shard(value)
                where = "offloaded_bytes" if offload.by_key[key].holds(local) else "device_bytes"
                out[where] += local.numel() * local.element_size()
    return out


def init_states(param_groups: list[dict], state: dict, offload, view_of) -> None:
    """Muon.init_state: every parameter's state made now where missing (``state_for``)."""
    for group in param_groups:
        for p in group["params"]:
            state_for(state, p, group["algorithm"], offload, group if group["algorithm"] == "muon" else None, view_of)
