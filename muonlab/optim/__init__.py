"""The optimizer: class Muon, its functional core, parameter routing, a slow reference."""

from .muon import Muon
from .routing import ParamGroups, Route, RoutingWarning, muon_param_groups

__all__ = ["Muon", "ParamGroups", "Route", "RoutingWarning", "muon_param_groups"]
