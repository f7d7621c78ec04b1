"""Update rules: one module each, and ``RULES``, the only registry.

An update rule says what happens between a matrix's orthogonalized update and its parameter
(``muonlab.optim.rules.base.UpdateRule``). A Muon group picks one with ``update_rule``; the
optimizer reads its settings, state and transform from here. A new rule is one module with a
``RULE`` and one entry below.
"""

from . import muon, normuon
from .base import ROW_SPLIT_LAYOUTS, RowsHeld, UpdateRule

RULES: dict[str, UpdateRule] = {m.RULE.name: m.RULE for m in (muon, normuon)}

RULE_SETTINGS: dict[str, object] = {k: v for rule in RULES.values() for k, v in rule.settings.items()}
"""Every rule's group settings with their defaults (each Muon group holds all of them)."""

RULE_STATE_KEYS: tuple[str, ...] = tuple(k for rule in RULES.values() for k in rule.state_keys)


def check_rule_settings(values: dict, where: str) -> None:
    """The group's ``update_rule`` is known, and every rule's settings are in range."""
    name = values.get("update_rule")
    if name not in RULES:
        raise ValueError(f"unknown update_rule {name!r}{where}; choose one of {tuple(RULES)}")
    for rule in RULES.values():
        rule.check_settings(values, where)


__all__ = ["ROW_SPLIT_LAYOUTS", "RULES", "RULE_SETTINGS", "RULE_STATE_KEYS", "RowsHeld", "UpdateRule",
           "check_rule_settings"]
