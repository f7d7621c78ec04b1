"""Muon's parameters as the user gives them: groups, names and matrix views, checked at
construction (and by ``add_param_group``) before torch's Optimizer stores any of them.

``NamedParams`` is a mixin of ``muonlab.optim.Muon``. It keeps ``_names`` (parameter -> the name
given with it: from ``named_parameters``, ``muon_param_groups`` or torch's ``param_names``) and
``_views`` (name -> declared matrix view), and reads the optimizer's ``param_groups``,
``fused_banks``, ``_offload`` and the per-algorithm defaults ``_muon_defaults`` and
``_adamw_defaults``. Every error names the group and the parameter (by name where it has one,
else by shape).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..comm.specs import check_view
from ..kernels.newton_schulz import possible_backends
from .routing import check_not_flat
from .step_graph import check_capture_place
from .validation import check_foreign_settings, check_hyperparameters, checked_fused_banks, fmt_shape

ALGORITHMS = ("muon", "adamw")


class NamedParams:
    """Parameter groups, names and views of Muon (see the module doc)."""

    def _normalise_params(self, params: Iterable) -> list[dict]:
        if isinstance(params, torch.Tensor):
            raise TypeError("params must be an iterable of tensors, (name, tensor) pairs or dicts, not a Tensor")
        self._names.update(getattr(params, "names", {}))  # from muon_param_groups
        self._views.update(getattr(params, "views", {}))
        # the blocks muon_param_groups(split_heads=...) declared; the fused_banks argument wins by name
        self.fused_banks = {**checked_fused_banks(getattr(params, "fused_banks", None)), **self.fused_banks}
        items = list(params)
        if not items:
            raise ValueError("Muon got an empty parameter list")
        if all(isinstance(it, dict) for it in items):
            groups = [dict(g) for g in items]
        elif any(isinstance(it, dict) for it in items):
            raise TypeError("params mixes parameter-group dicts with tensors; pass one kind")
        else:
            groups = [{"params": items}]
        group_of: dict[torch.Tensor, int] = {}
        for gi, group in enumerate(groups):
            self._split_names(group, gi)
            self._check_unique(group["params"], gi, group_of)
        return groups

    def _check_unique(self, params: list[torch.Tensor], gi: int, group_of: dict[torch.Tensor, int]) -> None:
        """Refuse a parameter met before (``group_of``: parameter -> its group index, filled here)."""
        for p in params:
            if p in group_of:
                if group_of[p] == gi:
                    raise ValueError(f"parameter {self._label(p)} is listed twice in group {gi}")
                raise ValueError(f"parameter {self._label(p)} appears in more than one parameter group "
                                 f"(group {group_of[p]} and group {gi})")
            group_of[p] = gi

    def _split_names(self, group: dict, gi: int) -> None:
        if "params" not in group:
            raise ValueError(f"parameter group {gi} has no 'params' entry")
        raw = group["params"]
        raw = [raw] if isinstance(raw, torch.Tensor) else list(raw)
        if not raw:
            raise ValueError(f"parameter group {gi} has an empty parameter list")
        names = group.pop("param_names", None)  # torch's named form: names beside the tensors
        if names is not None and (isinstance(names, str) or not all(isinstance(n, str) for n in names)
                                  or len(names) != len(raw)):
            raise ValueError(f"parameter group {gi}: param_names must be a list of {len(raw)} str, one per "
                             f"parameter, got {names!r}")
        named: dict[torch.Tensor, str] = {}
        tensors = []
        for k, item in enumerate(raw):
            name = None if names is None else names[k]
            if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
                name, p = item
            else:
                p = item
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"parameter group {gi} holds a {type(p).__name__}, not a Tensor")
            if name is not None:
                named[p] = name
            tensors.append(p)
        # one name, one tensor: matrix_views and fused_banks find parameters by name
        taken = {n: q for q, n in self._names.items() if q not in named}
        for q, name in named.items():
            if taken.get(name, q) is not q:
                raise ValueError(f"parameter group {gi}: the name {name!r} is given to two different tensors")
            taken[name] = q
        self._names.update(named)
        group["params"] = tensors

    def _check_views(self, declared: dict[str, str]) -> None:
        """Declared views override the groups' ones; each must name a Muon parameter and be able to
        read its shape, or construction fails here, before any step."""
        if not isinstance(declared, dict):
            raise TypeError(f"matrix_views must be a dict {{parameter name: view}}, got {type(declared).__name__}")
        self._views.update(declared)
        muon = {self._names.get(p): p for g in self.param_groups if g["algorithm"] == "muon" for p in g["params"]}
        adamw = {self._names.get(p) for g in self.param_groups if g["algorithm"] == "adamw" for p in g["params"]}
        for name in declared:
            if name in adamw:
                raise ValueError(f"matrix_views names '{name}', which is in an AdamW group: views are for Muon")
            if name not in muon:
                raise ValueError(f"matrix_views names '{name}', which is not a parameter of this optimizer "
                                 "(pass named parameters or muon_param_groups(model))")
        for name, p in muon.items():
            if name in self._views:
                check_view(name, tuple(p.shape), self._views[name], self.fused_banks.get(name, 1))

    def _view_of(self, p: torch.Tensor) -> str:
        """The declared matrix view of ``p``, or "" for its shape's default."""
        return self._views.get(self._names.get(p), "")

    def param_name(self, p: torch.Tensor) -> str | None:
        """The name given at construction (from named_parameters), or None."""
        return self._names.get(p)

    def _label(self, p: torch.Tensor) -> str:
        name = self._names.get(p)
        shape = fmt_shape(p.shape)
        return f"'{name}' of shape {shape}" if name else f"of shape {shape}"

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Validate, fill per-algorithm defaults, then register (names stay outside the group)."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        if getattr(self, "_offload", None) is not None and self._offload.place == "disk":
            # the state file's slots are laid out at construction, for the parameters known then
            raise ValueError('add_param_group is not supported with state_offload="disk": build the optimizer '
                             "with every parameter group")
        names_before = dict(self._names)
        try:
            group = self._checked_group(dict(param_group), len(self.param_groups))
        except (ValueError, TypeError):
            self._names = names_before  # a refused group leaves no names behind
            raise
        self.param_groups.append(group)

    def _checked_group(self, group: dict, gi: int) -> dict:
        self._split_names(group, gi)  # every item a tensor (or a (name, tensor) pair), the list not empty
        algorithm = group.setdefault("algorithm", "muon")
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {algorithm!r} in a parameter group; choose one of {ALGORITHMS}")
        defaults = self._muon_defaults if algorithm == "muon" else self._adamw_defaults
        for key, value in defaults.items():
            group.setdefault(key, value)
        # Keys of the other algorithm would be silently ignored: reject them instead, by name.
        check_foreign_settings(group, algorithm, f" in parameter group {gi}")
        allowed = {"params", "algorithm", "initial_lr"} | set(defaults)
        unknown = sorted(set(group) - allowed)
        if unknown:
            raise ValueError(f"unknown option(s) {unknown} for a {algorithm} parameter group")
        check_hyperparameters(group, algorithm, "", f" in parameter group {gi}")
        for p in group["params"]:
            self._check_param(p, algorithm)
        self._check_unique(group["params"], gi, {p: i for i, g in enumerate(self.param_groups) for p in g["params"]})
        return group

    def _check_placed_options(self, options, params: list[tuple[torch.Tensor, str]]) -> None:
        """The options' checks that need the parameters (a ``MuonOptions`` is made without them), on
        ``params`` ((parameter, its algorithm) pairs): ns_backend="triton" where Triton can run
        each Muon parameter's device, capture_after's CUDA parameters."""
        if options.ns_backend == "triton":
            devices = set()
            for p, algorithm in params:
                if algorithm == "muon" and p.device not in devices:
                    devices.add(p.device)
                    try:
                        possible_backends("triton", p.device)
                    except ValueError as err:
                        raise ValueError(f"ns_backend='triton' can't run on parameter {self._label(p)}: {err}") from None
        check_capture_place(options.capture_after, None, [p for p, _ in params], self._label)

    def _check_param(self, p: torch.Tensor, algorithm: str) -> None:
        check_not_flat(p, self._names.get(p, "?"))
        if not (p.is_leaf or p.retains_grad):
            raise ValueError(f"can't optimize a non-leaf tensor {self._label(p)}")
        if torch.is_complex(p):
            raise ValueError(f"parameter {self._label(p)} is complex; Muon supports real tensors only")
        if not p.is_floating_point():
            raise TypeError(f"parameter {self._label(p)} has dtype {p.dtype}; Muon and AdamW update "
                            "floating-point tensors only")
        if algorithm == "muon" and p.ndim < 2:
            raise ValueError(
                f"Muon needs parameters with at least 2 dims, got {self._label(p)}; "
                "route it to AdamW with {'algorithm': 'adamw'} (see muon_param_groups)"
            )
        if algorithm == "muon" and p.numel() == 0:
            raise ValueError(f"parameter {self._label(p)} is empty: Muon has no matrix to orthogonalize; "
                             "leave it out or route it to AdamW")
        self._check_placed_options(self.options, [(p, algorithm)])
