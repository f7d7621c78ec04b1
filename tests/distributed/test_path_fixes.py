"""Path fixes across gloo ranks (the audit of the communication paths)."""

import pytest

from muonlab.launcher import launch

from . import _workers_path_fixes as W


@pytest.mark.timeout(300)
def test_matrices_the_rebalance_path_keeps_in_place_match_one_process():
    """bf16 on the wire rounds the matrices that travel; those that never leave their rank keep the
    Newton-Schulz output's precision. Stacked in the first result's dtype, a rank whose first matrix
    had moved rounded all of its kept ones to bf16 too."""
    out = launch(W.rebalanced_banks_against_one_process, 4, timeout_s=240)[0]
    assert "rebalance" in out["paths"], out["paths"]
    assert any(out["moved"].values()), out["moved"]
    for name, differ in out["differ"].items():
        assert set(differ) <= set(out["moved"][name]), (name, differ, out["moved"][name])
