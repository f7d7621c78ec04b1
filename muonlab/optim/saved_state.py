"""Loading a saved state dict into Muon: every saved group and state tensor checked against this
optimizer before anything changes, then torch's loader, then state tensors restored in the dtypes
they are kept in.

``SavedState`` is a mixin of ``muonlab.optim.Muon``: it reads the optimizer's ``param_groups``,
``state``, ``_offload`` (the state stores), ``_replica_home``, ``_label()`` and ``_rule_shapes()``.
"""

from __future__ import annotations

import math

import torch

from .rules import RULE_STATE_KEYS, RULES
from .validation import check_hyperparameters, is_number, state_mismatch

STATE_KEYS = {"muon": ("momentum_buffer",), "adamw": ("step", "exp_avg", "exp_avg_sq")}
"""The state each parameter of an algorithm holds once it has stepped (made by ``Muon._state_for``;
an update rule adds its own, ``muonlab.optim.rules``)."""


class SavedState:
    """``load_state_dict`` of Muon (see the module doc)."""

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loader, checked first, then state tensors restored in their saved dtype.

        Every saved state tensor must have its parameter's shape (a checkpoint of another model
        would otherwise load and fail at the next step, after AdamW's step counters moved), and a
        step count may be a Python number (torch accepts it; it becomes a tensor). Each state
        tensor is kept in its own dtype (momentum: ``momentum_dtype``; AdamW moments: fp32), not
        the parameter's dtype torch's loader casts floating state to, which would break exact
        resume of fp32 state for bf16 parameters.

        A replicated (DDP) matrix's momentum lives on one rank, so one rank's state_dict holds only
        the momentum that rank was home to: load each rank's own, or call consolidate_state() on
        every rank before state_dict() (muonlab.checkpoint does) to load one everywhere.
        """
        pairs = self._saved_pairs(state_dict)  # these two raise before anything changes
        state_dict = dict(state_dict, param_groups=self._saved_groups(state_dict))
        offloaded = {k for k, store in self._offload.by_key.items() if store.place is not None}
        if offloaded and isinstance(state_dict.get("state"), dict):
            # offloaded tensors go straight to their store, never through the parameter's device
            state_dict = dict(state_dict, state={
                pid: {k: v for k, v in s.items() if k not in offloaded} for pid, s in state_dict["state"].items()})
        self.drop_captured_step()  # new state tensors: a captured step reads the old ones
        super().load_state_dict(state_dict)
        self._replica_home.clear()  # where the loaded momentum lies: asked at the next step
        for saved, p in pairs:
            for key, value in saved.items():
                if key in offloaded and torch.is_tensor(value):
                    self.state[p][key] = self._offload.adopt(p, key, value)
                elif key == "step" and not torch.is_tensor(value):
                    self.state[p][key] = torch.tensor(float(value))
                elif key in RULE_STATE_KEYS and torch.is_tensor(value):  # fp32 where torch cast it to p's dtype
                    self.state[p][key] = value.to(device=p.device, dtype=torch.float32, copy=True)
                elif torch.is_tensor(value) and key in self._offload.by_key \
                        and self.state[p][key].dtype != self._offload.dtype(p, key):
                    self.state[p][key] = value.to(device=p.device, dtype=self._offload.dtype(p, key), copy=True)

    def _saved_pairs(self, state_dict: dict) -> list[tuple[dict, torch.Tensor]]:
        """(saved state, parameter) in torch's order, each checked against its parameter."""
        if not isinstance(state_dict, dict) or not isinstance(state_dict.get("param_groups"), list) \
                or "state" not in state_dict:
            raise TypeError("state_dict must be a dict with 'state' and 'param_groups', as state_dict() returns")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
                not isinstance(a, dict) or len(a.get("params", ())) != len(b["params"])
                for a, b in zip(saved_groups, self.param_groups)):
            return []  # _saved_groups or torch's loader raise their own error for groups that don't line up
        saved_state = state_dict["state"]
        if not isinstance(saved_state, dict):
            raise TypeError(f"state_dict['state'] must be a dict {{param id: state}}, got {type(saved_state).__name__}")
        saved_ids = [i for g in saved_groups for i in g["params"]]
        # the saved groups' settings replace these (their update rule decides the state kept)
        settings = [{**g, **(s if isinstance(s, dict) else {})} for g, s in zip(self.param_groups, saved_groups)]
        params = [(g["algorithm"], p, group) for g, group in zip(self.param_groups, settings) for p in g["params"]]
        pairs = [(saved_state.get(pid, {}), p) for pid, (_, p, _) in zip(saved_ids, params)]
        for (saved, p), (algorithm, _, group) in zip(pairs, params):
            if not isinstance(saved, dict):
                raise TypeError(f"parameter {self._label(p)} has saved state of type {type(saved).__name__}, "
                                "not a dict")
            shapes = self._rule_shapes(group, p) if group.get("update_rule") in RULES else {}
            wanted = STATE_KEYS[algorithm] + tuple(shapes)
            # a replica's momentum lives on one rank, its rule state on all (muonlab.optim.rule_step)
            if saved and set(saved) != set(wanted) and not (shapes and set(saved) == set(shapes)):
                raise ValueError(f"parameter {self._label(p)} ({algorithm}) has saved state keys {sorted(saved)}; "
                                 f"expected {sorted(wanted)}")
            for key in wanted:
                if key in saved and key != "step" and not torch.is_tensor(saved[key]):
                    raise TypeError(f"parameter {self._label(p)} has saved {key} of type "
                                    f"{type(saved[key]).__name__}, not a tensor")
            mismatch = state_mismatch(p, saved, shapes)
            if mismatch:
                raise ValueError(f"parameter {self._label(p)} does not match the saved state: {mismatch} "
                                 "(the state dict comes from a model of another shape)")
            step = saved.get("step", 0)
            if not (is_number(step) or torch.is_tensor(step) and step.numel() == 1):
                raise TypeError(f"parameter {self._label(p)} has a saved AdamW step of {step!r}; "
                                "expected a number or a one-element tensor")
            if not 0 <= float(step) < math.inf:
                raise ValueError(f"parameter {self._label(p)} has a saved AdamW step of {float(step)}; "
                                 "expected a count >= 0")
        return pairs

    def _saved_groups(self, state_dict: dict) -> list:
        """The saved parameter groups, which replace this optimizer's settings, checked as groups
        given to the constructor are: the same algorithm as the group each replaces, settings in
        range. A setting the saved group lacks (saved before it existed) keeps this group's value."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            return saved_groups  # torch's loader raises its own error for groups that don't line up
        filled = []
        for gi, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
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
