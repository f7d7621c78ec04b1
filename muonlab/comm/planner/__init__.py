"""The planner: which matrices go together, on which path, with which owners, at what cost.

``plan_batches`` (search.py) tries each owner rule (rule.py, one ``RulePlanner`` per plan) and
keeps the best; ``reference_plan`` builds two peers' strategies for comparison (reference.py).
"""

from .reference import REFERENCE_STRATEGIES, reference_plan
from .rule import ROW_RULES, RulePlanner
from .search import REMAINDER_PATHS, ROW_ASSIGNMENTS, STRATEGIES, plan_batches

__all__ = ["REFERENCE_STRATEGIES", "REMAINDER_PATHS", "ROW_ASSIGNMENTS", "ROW_RULES", "STRATEGIES", "RulePlanner",
           "plan_batches", "reference_plan"]
