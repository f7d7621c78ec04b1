"""Matplotlib and ipywidgets views; they only read what training, trace/ and plan record.

Every plot and panel is exported here: loss curves (any model's History or plain losses), singular
values, spectral records, comparisons across seeds, the timeline, step-time and plan views, the
planner, training and comparison panels.
"""

from .compare import ComparePanel, compare_panel, plot_comparison
from .curves import integer_steps, ns_choice_short, plot_loss_curves, plot_singular_values, robust_ylim
from .qk_clip import VariantPanel, max_logit_per_layer, plot_max_logits, variant_panel
from .planner import PlannerPanel, planner_panel, plot_plan_per_rank, plot_strategy_sweep, simulate_views
from .spectral import SpectralPanel, plot_spectral, plot_spectral_layers, plot_spectral_runs, spectral_panel
from .timeline import (PATH_COLORS, PHASE_COLORS, ns_choice_label, plot_bytes_by_path, plot_plan,
                       plot_rank_distribution, plot_step_time, plot_timeline)
from .widgets import TrainingPanel, muon_trainer, plot_val_loss_vs_time, training_panel

__all__ = [
    "ComparePanel", "PATH_COLORS", "PHASE_COLORS", "PlannerPanel", "SpectralPanel", "TrainingPanel", "VariantPanel",
    "compare_panel", "integer_steps", "max_logit_per_layer", "muon_trainer", "ns_choice_label", "ns_choice_short", "planner_panel",
    "plot_bytes_by_path", "plot_comparison", "plot_loss_curves", "plot_max_logits", "plot_plan", "plot_plan_per_rank",
    "plot_rank_distribution", "plot_singular_values", "plot_spectral", "plot_spectral_layers", "plot_spectral_runs",
    "plot_step_time", "plot_strategy_sweep", "plot_timeline", "plot_val_loss_vs_time", "robust_ylim",
    "simulate_views", "spectral_panel", "training_panel", "variant_panel",
]
