"""Matplotlib and ipywidgets views; they only read what training, trace/ and plan record."""

from .curves import plot_loss_curves, plot_singular_values

__all__ = ["plot_loss_curves", "plot_singular_values"]
