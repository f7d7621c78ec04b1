"""Matplotlib and ipywidgets views; they only read what training, trace/ and plan record."""

from .curves import plot_loss_curves, plot_singular_values
from .timeline import PATH_COLORS, PHASE_COLORS, plot_bytes_by_path, plot_plan, plot_timeline

__all__ = ["PATH_COLORS", "PHASE_COLORS", "plot_bytes_by_path", "plot_loss_curves", "plot_plan",
           "plot_singular_values", "plot_timeline"]
