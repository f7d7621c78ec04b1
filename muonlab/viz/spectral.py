"""Spectral records over training (muonlab.trace.spectral): per-matrix curves, runs side by side,
and a panel to pick the matrix and the metric.

    from muonlab.viz.spectral import spectral_panel
    panel = spectral_panel(histories)   # display it; panel.update(name=..., metric=...) draws directly
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt

from ..trace.spectral import DERIVED, METRICS, SpectralRecord, records_by_name
from .panel_output import show_figure

__all__ = ["LABELS", "SpectralPanel", "plot_spectral", "plot_spectral_layers", "spectral_panel"]

LABELS = {
    "weight_sigma": "weight spectral norm",
    "update_sigma": "update spectral norm",
    "update_rms": "update RMS",
    "ortho_error": "Newton-Schulz orthogonality error",
    "update_flatness": "update flatness (stable rank / rank)",
}
"""Axis labels of the measured and derived metrics."""

ALL = "all matrices"


def _records(run) -> list[SpectralRecord]:
    """A History's spectral records, or a list of records as it is."""
    records = getattr(run, "spectral", run)
    if not isinstance(records, Sequence):
        raise TypeError(f"expected a History or a list of SpectralRecord, got {type(run).__name__}")
    return list(records)


def _check_runs(runs) -> None:
    """Refuse one run where a mapping of runs is wanted, naming what to pass."""
    if not isinstance(runs, Mapping):
        raise TypeError(f"expected a mapping {{label: History or list of SpectralRecord}}, e.g. "
                        f"{{'muon': history}}, got {type(runs).__name__}")


def _kind(name: str) -> str:
    """A matrix's kind: its name without layer indices."""
    return ".".join(part for part in name.split(".") if not part.isdigit())


def _kind_colors(names: Sequence[str]) -> dict[str, str]:
    """{kind: colour}, in the order the kinds first appear in ``names``."""
    kinds = dict.fromkeys(_kind(n) for n in names)
    return {kind: f"C{i}" for i, kind in enumerate(kinds)}


def _check_metric(metric: str) -> None:
    if metric not in METRICS + DERIVED:
        raise ValueError(f"unknown spectral metric {metric!r}; choose one of {METRICS + DERIVED}")


def matrix_names(runs: Mapping) -> list[str]:
    """Every matrix recorded in any run, in the order first recorded."""
    _check_runs(runs)
    names: dict[str, None] = {}
    for run in runs.values():
        names.update(dict.fromkeys(r.name for r in _records(run)))
    return list(names)


def plot_spectral(runs: Mapping, name: str, metric: str, *, ax=None, title: str | None = None):
    """``metric`` of matrix ``name`` over training, one line per run (``{label: History or records}``).
    Runs that have no value of it (the orthogonality error of an AdamW-updated matrix) are named
    in the title instead of drawn."""
    _check_runs(runs)
    _check_metric(metric)
    known = matrix_names(runs)
    if name not in known:
        raise ValueError(f"no spectral records of matrix {name!r}; recorded: {known}")
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.5))
    missing = []
    for i, (label, run) in enumerate(runs.items()):
        steps, values = records_by_name(_records(run), metric).get(name, ([], []))
        if not steps or all(math.isnan(v) for v in values):
            missing.append(label)
            continue
        ax.plot(steps, values, "o-", ms=3, color=f"C{i}", label=label)
    ax.set_xlabel("step")
    ax.set_ylabel(LABELS[metric])
    note = f"\n(none for {', '.join(missing)})" if missing else ""
    ax.set_title((title or f"{name}: {LABELS[metric]}") + note, fontsize=11)
    if ax.lines:
        ax.legend(fontsize=9, loc="best")
    ax.grid(alpha=0.3)
    return ax


def plot_spectral_layers(run, metric: str, *, ax=None, title: str = "", names: Sequence[str] | None = None,
                         legend: bool = True, colors: Mapping[str, str] | None = None):
    """``metric`` of every recorded matrix of one run (or of ``names``), one line each, one colour
    per matrix kind (the name without its layer index): from ``colors`` ({kind: colour} for every
    kind drawn, to match other axes), else in the order this run shows the kinds."""
    _check_metric(metric)
    series = records_by_name(_records(run), metric)
    if names is not None:
        series = {n: series[n] for n in names if n in series}
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.5))
    drawn = [n for n, (_, values) in series.items() if not all(math.isnan(v) for v in values)]
    if colors is None:
        colors = _kind_colors(drawn)
    labelled: set[str] = set()
    for n in drawn:
        steps, values = series[n]
        kind = _kind(n)
        ax.plot(steps, values, color=colors[kind], lw=1.2, alpha=0.85, label=None if kind in labelled else kind)
        labelled.add(kind)
    ax.set_xlabel("step")
    ax.set_ylabel(LABELS[metric])
    ax.set_title(title or LABELS[metric], fontsize=11)
    if not ax.lines:  # e.g. ortho_error of an AdamW run: say so rather than leave a blank axis
        ax.text(0.5, 0.5, "no values for this metric", transform=ax.transAxes, ha="center", va="center",
                color="0.4")
    elif legend:
        ax.legend(fontsize=8, loc="best")
    ax.grid(alpha=0.3)
    return ax


class SpectralPanel:
    """Two dropdowns, matrix and metric; every change redraws the runs' curves in the panel.

    ``update(name=, metric=)`` sets the dropdowns (when given) and draws; call it directly in a cell
    to draw without a frontend. "all matrices" draws every matrix of each run, one axis per run.
    """

    def __init__(self, runs: Mapping, *, name: str | None = None, metric: str = "weight_sigma"):
        _check_runs(runs)
        import ipywidgets as w

        _check_metric(metric)
        names = matrix_names(runs)
        if not names:
            raise ValueError("the runs hold no spectral records (train with spectral_every=k)")
        if name is not None and name not in (ALL, *names):
            raise ValueError(f"no spectral records of matrix {name!r}; choose {ALL!r} or one of {names}")
        self.runs = dict(runs)
        style = {"description_width": "70px"}
        self.name = w.Dropdown(options=[ALL, *names], value=name or names[0], description="matrix", style=style,
                               layout=w.Layout(width="420px"))
        self.metric = w.Dropdown(options=[(LABELS[m], m) for m in METRICS + DERIVED], value=metric,
                                 description="metric", style=style, layout=w.Layout(width="420px"))
        self.output = w.Output()
        self._drawing = False  # update() is setting the dropdowns itself
        self.name.observe(lambda _: self.update(), names="value")
        self.metric.observe(lambda _: self.update(), names="value")
        self.widget = w.VBox([w.HBox([self.name, self.metric]), self.output])
        self.update()

    def figure(self, name: str, metric: str):
        """The figure for these choices (not displayed)."""
        if name == ALL:
            fig, axes = plt.subplots(1, len(self.runs), figsize=(4.2 * len(self.runs), 3.6), sharey=True,
                                     squeeze=False)
            handles: dict = {}
            # one colour per kind across the runs, which may record different matrices: one legend serves all
            colors = _kind_colors(matrix_names(self.runs))
            for ax, (label, run) in zip(axes[0], self.runs.items()):
                plot_spectral_layers(run, metric, ax=ax, title=label, legend=False, colors=colors)
                handles.update({line.get_label(): line for line in ax.lines if not line.get_label().startswith("_")})
            if not handles:  # no run has a value of this metric: each axis says so, no legend to place
                fig.tight_layout()
                return fig
            # one legend for all panels, under them: inside an axis it would hide curves
            fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=min(len(handles), 4), fontsize=9)
            fig.tight_layout(rect=(0, 0.06 * (1 + (len(handles) - 1) // 4), 1, 1))
            return fig
        fig, ax = plt.subplots(figsize=(7, 3.6))
        plot_spectral(self.runs, name, metric, ax=ax)
        fig.tight_layout()
        return fig

    def update(self, name: str | None = None, metric: str | None = None):
        """Draw (after setting the dropdowns to ``name``/``metric`` when given); returns the figure."""
        if metric is not None:
            _check_metric(metric)
        if name is not None and name not in self.name.options:
            raise ValueError(f"no spectral records of matrix {name!r}; choose one of {list(self.name.options)}")
        # setting a dropdown fires its observer, which draws: draw once, after both are set
        if self._drawing:
            return None
        self._drawing = True
        try:
            if name is not None:
                self.name.value = name
            if metric is not None:
                self.metric.value = metric
        finally:
            self._drawing = False
        fig = self.figure(self.name.value, self.metric.value)
        show_figure(self.output, fig, "spectral figure")
        return fig

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)


def spectral_panel(runs: Mapping, **kwargs) -> SpectralPanel:
    """A ``SpectralPanel`` over ``{label: History or list of SpectralRecord}``; display it as the
    last expression of a cell."""
    return SpectralPanel(runs, **kwargs)
