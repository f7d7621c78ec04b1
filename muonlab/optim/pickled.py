"""A Muon's attributes as copies and pickles carry them (``copied_state``), and brought up to date
when loaded (``brought_up_to_date``): earlier muonlab versions pickled some parts as Muon's own
attributes (the options one by one, the parameter names, the step record, the momentum homes)."""

from __future__ import annotations

import dataclasses

import torch

from .agreement import Agreement
from .momentum_homes import MomentumHomes
from .offload import StateStores
from .options import MuonOptions
from .param_groups import NamedParams
from .state_table import StateTable
from .step_stats import record_of


def copied_state(obj) -> dict:
    """``obj``'s attributes a copy or a pickle keeps: torch's copies drop hooks too; the plan cache,
    the prepared step and the captured step hold live process groups and are rebuilt. An instance
    attribute over a method is a wrapper someone installed (an LR scheduler wraps step, holding a
    reference to THIS optimizer): a copy keeps its own method."""
    return {k: v for k, v in vars(obj).items() if k not in ("_plans", "_prepared", "_step_graph")
            and not k.startswith("_optimizer_") and not callable(getattr(type(obj), k, None))}


def brought_up_to_date(attrs: dict) -> None:
    """A Muon's ``attrs`` (its ``__dict__`` after torch's ``__setstate__``, which torch's
    load_state_dict also calls with the state and groups only) made whole, in place: the state a
    ``StateTable``, the caches empty, and each part an earlier version pickled otherwise made as
    this version keeps it."""
    if not isinstance(attrs["state"], StateTable):  # a loaded state dict's defaultdict
        attrs["state"] = StateTable(attrs["state"])
    attrs.setdefault("_plans", {})
    attrs["_prepared"] = None  # made again at the next step (it holds live process groups)
    attrs.setdefault("_settings_checked", None)
    if "_homes" not in attrs:  # pickled with the homes as a dict of Muon's (or before them)
        attrs["_homes"] = MomentumHomes(attrs.pop("_replica_home", {}))
    attrs.setdefault("_agreement", Agreement())  # pickled before the per-step agreement
    if "_params" not in attrs:  # pickled when names, views and defaults were Muon's attributes
        attrs["_params"] = named = NamedParams(
            dict(muon=attrs.pop("_muon_defaults"), adamw=attrs.pop("_adamw_defaults")), attrs.pop("fused_banks"))
        named.names, named.views = attrs.pop("_names"), attrs.pop("_views", {})
    if "_record" not in attrs:  # pickled when the step's record was attributes of Muon's own
        attrs["_record"] = record_of(attrs)
    if "_offload" not in attrs:  # pickled before state offload existed
        attrs["_offload"] = StateStores(None, None, False, [], {}, 0)
    if "options" not in attrs:  # pickled when each option was an attribute of its own
        legacy = {f.name: attrs.pop(f.name) for f in dataclasses.fields(MuonOptions) if f.name in attrs}
        if "momentum_dtype" not in legacy:  # pickled before the memory options: momentum was fp32
            legacy.update(momentum_dtype=torch.float32, workspace_bytes=None, ns_graphs=False)
            attrs["_runner"] = None
            for store in attrs["_offload"].stores():
                store.momentum_dtype = torch.float32
        attrs["options"] = MuonOptions(**legacy)  # nonfinite_decision: "host", as before the device's
    elif "capture_after" in attrs:  # pickled when capture_after was an attribute beside the record
        attrs["options"] = dataclasses.replace(attrs["options"], capture_after=attrs.pop("capture_after"))
