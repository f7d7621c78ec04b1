"""The optimizer: class Muon, its functional core, parameter routing, a slow reference."""

from .heads import attention_blocks
from .muon import Muon
from .routing import ParamGroups, Route, RoutingWarning, muon_param_groups

__all__ = ["Muon", "ParamGroups", "Route", "RoutingWarning", "attention_blocks", "muon_param_groups"]
