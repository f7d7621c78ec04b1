"""Muon's parameters as the user gives them: groups, names and matrix views, checked at
construction (and by ``add_param_group``) before torch's Optimizer stores any of them.

``NamedParams`` owns ``names`` (parameter -> the name given with it: from ``named_parameters``,
``muon_param_groups`` or torch's ``param_names``), ``views`` (name -> declared matrix view),
``fused_banks`` and the per-algorithm group defaults; the optimizer's ``param_groups`` and options
are passed to the checks that read them. Every error names the group and the parameter (by name
where it has one, else by shape).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..comm.specs import check_view, matrix_spec
from ..kernels.newton_schulz import possible_backends
from .routing import check_not_flat
from .step_graph import check_capture_place
from .validation import (ADAMW_DEFAULTS, MUON_DEFAULTS, check_foreign_settings, check_hyperparameters,
                         checked_fused_banks, fmt_shape)

ALGORITHMS = ("muon", "adamw")


class NamedParams:
    """Parameter groups, names and views of Muon (see the module doc)."""

    def __init__(self, defaults: dict[str, dict], fused_banks: dict[str, int]):
        self.defaults = defaults
        """Per algorithm ("muon", "adamw"): the settings a group without them takes."""
        self.fused_banks = fused_banks
        self.names: dict[torch.Tensor, str] = {}
        self.views: dict[str, str] = {}

    @classmethod
    def from_arguments(cls, arguments: dict, fused_banks) -> NamedParams:
        """The groups' defaults from Muon's constructor ``arguments`` (its keywords by name): each
        setting of ``MUON_DEFAULTS`` (one without a keyword, a new rule's, takes its table default)
        and of ``ADAMW_DEFAULTS`` (prefixed ``adamw_``), checked here: a bad adamw_lr must not wait
        for the first AdamW group added later."""
        defaults = dict(muon={k: arguments.get(k, v) for k, v in MUON_DEFAULTS.items()},
                        adamw={k: arguments[f"adamw_{k}"] for k in ADAMW_DEFAULTS})
        check_hyperparameters(defaults["muon"], "muon", "", "")
        check_hyperparameters(defaults["adamw"], "adamw", "adamw_", "")
        defaults["adamw"]["betas"] = tuple(defaults["adamw"]["betas"])
        return cls(defaults, checked_fused_banks(fused_banks))

    def normalise(self, params: Iterable) -> list[dict]:
        if isinstance(params, torch.Tensor):
            raise TypeError("params must be an iterable of tensors, (name, tensor) pairs or dicts, not a Tensor")
        self.names.update(getattr(params, "names", {}))  # from muon_param_groups
        self.views.update(getattr(params, "views", {}))
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
            self.split_names(group, gi)
            self.check_unique(group["params"], gi, group_of)
        return groups

    def check_unique(self, params: list[torch.Tensor], gi: int, group_of: dict[torch.Tensor, int]) -> None:
        """Refuse a parameter met before (``group_of``: parameter -> its group index, filled here)."""
        for p in params:
            if p in group_of:
                if group_of[p] == gi:
                    raise ValueError(f"parameter {self.label(p)} is listed twice in group {gi}")
                raise ValueError(f"parameter {self.label(p)} appears in more than one parameter group "
                                 f"(group {group_of[p]} and group {gi})")
            group_of[p] = gi

    def split_names(self, group: dict, gi: int) -> None:
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
        taken = {n: q for q, n in self.names.items() if q not in named}
        for q, name in named.items():
            if taken.get(name, q) is not q:
                raise ValueError(f"parameter group {gi}: the name {name!r} is given to two different tensors")
            taken[name] = q
        self.names.update(named)
        group["params"] = tensors

    def check_declared(self, matrix_views: dict[str, str] | None, param_groups: list[dict]) -> None:
        """What the constructor's arguments declare by name, once the groups are stored: every
        ``fused_banks`` name a parameter whose shape stacks its matrices, and ``matrix_views``
        (``check_views``)."""
        unknown = sorted(set(self.fused_banks) - set(self.names.values()))
        if unknown:
            raise ValueError(f"fused_banks names {unknown} are not parameters of this optimizer "
                             "(pass named parameters or muon_param_groups(model))")
        for p, name in self.names.items():
            if name in self.fused_banks:
                matrix_spec(-1, name, p, None, self.fused_banks[name])  # validates the shape
        self.check_views(matrix_views or {}, param_groups)

    def check_views(self, declared: dict[str, str], param_groups: list[dict]) -> None:
        """Declared views override the groups' ones; each must name a Muon parameter of
        ``param_groups`` and be able to read its shape, or construction fails here, before any step."""
        if not isinstance(declared, dict):
            raise TypeError(f"matrix_views must be a dict {{parameter name: view}}, got {type(declared).__name__}")
        self.views.update(declared)
        muon = {self.names.get(p): p for g in param_groups if g["algorithm"] == "muon" for p in g["params"]}
        adamw = {self.names.get(p) for g in param_groups if g["algorithm"] == "adamw" for p in g["params"]}
        for name in declared:
            if name in adamw:
                raise ValueError(f"matrix_views names '{name}', which is in an AdamW group: views are for Muon")
            if name not in muon:
                raise ValueError(f"matrix_views names '{name}', which is not a parameter of this optimizer "
                                 "(pass named parameters or muon_param_groups(model))")
        for name, p in muon.items():
            if name in self.views:
                check_view(name, tuple(p.shape), self.views[name], self.fused_banks.get(name, 1))

    def view_of(self, p: torch.Tensor) -> str:
        """The declared matrix view of ``p``, or "" for its shape's default."""
        return self.views.get(self.names.get(p), "")

    def label(self, p: torch.Tensor) -> str:
        name = self.names.get(p)
        shape = fmt_shape(p.shape)
        return f"'{name}' of shape {shape}" if name else f"of shape {shape}"

    def new_group(self, param_group: dict[str, Any], param_groups: list[dict], options, offload) -> dict:
        """``param_group`` validated and filled with its algorithm's defaults, to be appended to
        ``param_groups`` (names stay outside the group); a refused group leaves no names behind.
        ``offload``: the state stores (None while the optimizer is being constructed)."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        if offload is not None and offload.place == "disk":
            # the state file's slots are laid out at construction, for the parameters known then
            raise ValueError('add_param_group is not supported with state_offload="disk": build the optimizer '
                             "with every parameter group")
        names_before = dict(self.names)
        try:
            return self._checked_group(dict(param_group), param_groups, options)
        except (ValueError, TypeError):
            self.names = names_before
            raise

    def _checked_group(self, group: dict, param_groups: list[dict], options) -> dict:
        gi = len(param_groups)
        self.split_names(group, gi)  # every item a tensor (or a (name, tensor) pair), the list not empty
        algorithm = group.setdefault("algorithm", "muon")
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {algorithm!r} in a parameter group; choose one of {ALGORITHMS}")
        defaults = self.defaults[algorithm]
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
            self.check_param(p, algorithm, options)
        self.check_unique(group["params"], gi, {p: i for i, g in enumerate(param_groups) for p in g["params"]})
        return group

    def check_options_placed(self, options, param_groups: list[dict], offload_place: str | None) -> None:
        """A new options record against the parameters of ``param_groups`` and the state's home."""
        check_capture_place(options.capture_after, offload_place, (), None)
        self.check_placed_options(options, [(p, g["algorithm"]) for g in param_groups for p in g["params"]])

    def check_placed_options(self, options, params: list[tuple[torch.Tensor, str]]) -> None:
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
                        raise ValueError(f"ns_backend='triton' can't run on parameter {self.label(p)}: {err}") from None
        check_capture_place(options.capture_after, None, [p for p, _ in params], self.label)

    def check_param(self, p: torch.Tensor, algorithm: str, options) -> None:
        """``p`` fit for ``algorithm`` under ``options`` (a ``MuonOptions``)."""
        check_not_flat(p, self.names.get(p, "?"))
        if not (p.is_leaf or p.retains_grad):
            raise ValueError(f"can't optimize a non-leaf tensor {self.label(p)}")
        if torch.is_complex(p):
            raise ValueError(f"parameter {self.label(p)} is complex; Muon supports real tensors only")
        if not p.is_floating_point():
            raise TypeError(f"parameter {self.label(p)} has dtype {p.dtype}; Muon and AdamW update "
                            "floating-point tensors only")
        if algorithm == "muon" and p.ndim < 2:
            raise ValueError(
                f"Muon needs parameters with at least 2 dims, got {self.label(p)}; "
                "route it to AdamW with {'algorithm': 'adamw'} (see muon_param_groups)"
            )
        if algorithm == "muon" and p.numel() == 0:
            raise ValueError(f"parameter {self.label(p)} is empty: Muon has no matrix to orthogonalize; "
                             "leave it out or route it to AdamW")
        self.check_placed_options(options, [(p, algorithm)])
