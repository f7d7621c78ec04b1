"""Matplotlib and ipywidgets views; they only read what training, trace/ and plan record."""

from .compare import ComparePanel, compare_panel, plot_comparison
from .curves import plot_loss_curves, plot_singular_values
from .planner import PlannerPanel, planner_panel, plot_plan_per_rank, plot_strategy_sweep, simulate_views
from .timeline import PATH_COLORS, PHASE_COLORS, plot_bytes_by_path, plot_plan, plot_timeline

__all__ = [
    "ComparePanel", "compare_panel", "plot_comparison",
    "PATH_COLORS", "PHASE_COLORS", "PlannerPanel", "planner_panel", "plot_bytes_by_path", "plot_loss_curves",
    "plot_plan", "plot_plan_per_rank", "plot_singular_values", "plot_strategy_sweep", "plot_timeline",
    "simulate_views",
]
