"""Muon's own update rule: the orthogonalized matrix is the update (Jordan et al. 2024)."""

from .base import UpdateRule

RULE = UpdateRule(
    name="muon",
    summary="the orthogonalized momentum, as it is",
    source="K. Jordan et al., Muon: An optimizer for hidden layers in neural networks (2024)",
)
