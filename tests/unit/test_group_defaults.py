"""Muon's group defaults come from one table (muonlab.optim.validation.MUON_DEFAULTS / ADAMW_DEFAULTS):
the constructor's keywords default to the table's values, and a setting the table gains (a new update
rule's) reaches every Muon group without a keyword of its own."""

import inspect

import torch

from muonlab import Muon
from muonlab.optim import validation


def _params():
    return [("w", torch.nn.Parameter(torch.randn(6, 4)))]


def test_the_constructor_defaults_are_the_tables():
    sig = inspect.signature(Muon.__init__).parameters
    for key, value in validation.MUON_DEFAULTS.items():
        assert sig[key].default == value, key
    for key, value in validation.ADAMW_DEFAULTS.items():
        assert sig[f"adamw_{key}"].default == value, key
    opt = Muon(_params())
    assert opt.defaults == dict(algorithm="muon", **validation.MUON_DEFAULTS)


def test_a_setting_the_table_gains_reaches_the_groups_without_a_keyword(monkeypatch):
    monkeypatch.setitem(validation.MUON_DEFAULTS, "rule_extra", 0.25)
    opt = Muon(_params(), lr=0.01)
    assert opt.param_groups[0]["rule_extra"] == 0.25 and opt.param_groups[0]["lr"] == 0.01
    assert opt.defaults["rule_extra"] == 0.25
