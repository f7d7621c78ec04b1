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
from .curves import integer_steps, ns_choice_short, robust_ylim
from .panel_output import show_figure

__all__ = ["BLOCK_STYLES", "LABELS", "SpectralPanel", "plot_spectral", "plot_spectral_layers", "plot_spectral_runs",
           "spectral_panel"]

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
    """A matrix's kind: its name without the indices of repeated blocks, which are followed by a
    module's name ("blocks.0.mlp.fc.weight" -> "blocks.mlp.fc.weight": one kind per layer of a
    block); an index followed by the parameter's own name is a layer of its own and stays
    ("0.weight", "2.weight" of an nn.Sequential, "blocks.1.0.weight" -> "blocks.0.weight")."""
    parts = name.split(".")
    return ".".join(p for i, p in enumerate(parts) if not p.isdigit() or i == len(parts) - 2)


def _block(name: str) -> str:
    """The repeated block a matrix is in, its name up to the last index ``_kind`` removes
    ("blocks.1.mlp.fc.weight" -> "blocks.1"); "" for none."""
    parts = name.split(".")
    cut = [i for i, p in enumerate(parts) if p.isdigit() and i != len(parts) - 2]
    return ".".join(parts[:cut[-1] + 1]) if cut else ""


BLOCK_STYLES = ("-", "--", ":", "-.")
"""Line styles of the first blocks, in order: one colour per kind, one style per block."""


def _block_styles(names: Sequence[str]) -> dict[str, object]:
    """{block: line style}: BLOCK_STYLES for 2 up to as many blocks; else {} and solid lines (one
    block needs no key; past 4 the colour says the kind only)."""
    blocks = [b for b in dict.fromkeys(_block(n) for n in names) if b]
    if not 2 <= len(blocks) <= len(BLOCK_STYLES):
        return {}
    return dict(zip(blocks, BLOCK_STYLES))


def _ns_label(run) -> str:
    """The Newton-Schulz choice a History recorded ("bf16, plain, torch"), "" for records alone."""
    return ns_choice_short(getattr(run, "ns_choices", None))


def _kind_colors(names: Sequence[str]) -> dict[str, str]:
    """{kind: colour}, in the order the kinds first appear in ``names``. Callers pass every matrix
    a run recorded, not the ones they draw: a figure of the hidden matrices and a panel of all of
    them then give a kind one colour (numbered over the drawn kinds, notebook 06's panel and its
    static figures disagreed)."""
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


def plot_spectral(runs: Mapping, name: str, metric: str, *, ax=None, title: str | None = None, legend: bool = True):
    """``metric`` of matrix ``name`` over training, one line per run (``{label: History or records}``).
    Runs that have no value of it (the orthogonality error of an AdamW-updated matrix) are named
    in the title instead of drawn. A History that says what Newton-Schulz ran labels its line with
    it; a diverged run is marked and leaves the y-axis to the others. ``legend=False`` leaves the
    legend out (to place one for several axes: ``fig.legend(*ax.get_legend_handles_labels())``)."""
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
        ns = _ns_label(run)
        ax.plot(steps, values, "o-", ms=3, color=f"C{i}", label=f"{label} ({ns})" if ns else label)
    ax.set_xlabel("step")
    ax.set_ylabel(LABELS[metric])
    note = f"\n(none for {', '.join(missing)})" if missing else ""
    ax.set_title((title or f"{name}: {LABELS[metric]}") + note, fontsize=11)
    integer_steps(ax)
    robust_ylim(ax)
    if ax.lines and legend:
        ax.legend(fontsize=8, loc="best")
    ax.grid(alpha=0.3)
    return ax


def plot_spectral_layers(run, metric: str, *, ax=None, title: str = "", names: Sequence[str] | None = None,
                         legend: bool = True, colors: Mapping[str, str] | None = None,
                         styles: Mapping[str, object] | None = None):
    """``metric`` of every recorded matrix of one run (or of ``names``), one line each: one colour
    per matrix kind (the name without its block's index, ``_kind``; the layers of an nn.Sequential
    keep their full names, each a kind of its own) and one line style per block (``BLOCK_STYLES``,
    up to 4 blocks: "blocks.0" solid, "blocks.1" dashed), so every matrix is told apart. Colours
    come from ``colors`` ({kind: colour}, to match other axes), styles from ``styles`` ({block:
    style}), else from this run. A History that says what Newton-Schulz ran puts it under the
    title; a diverged matrix is marked and leaves the y-axis to the others. The legend (right of
    the axis; ``legend=False`` for none) names the kinds, then the blocks."""
    _check_metric(metric)
    series = records_by_name(_records(run), metric)
    series_names = list(series)  # every matrix the run recorded: the colours follow all of them
    if names is not None:
        series = {n: series[n] for n in names if n in series}
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.5))
    drawn = [n for n, (_, values) in series.items() if not all(math.isnan(v) for v in values)]
    colors = _kind_colors([*series_names, *drawn]) if colors is None else colors
    styles = _block_styles(drawn) if styles is None else styles
    labelled: set[str] = set()
    for n in drawn:
        steps, values = series[n]
        kind = _kind(n)
        ax.plot(steps, values, color=colors[kind], ls=styles.get(_block(n), "-"), lw=1.2, alpha=0.85,
                label=None if kind in labelled else kind)
        labelled.add(kind)
    for block in dict.fromkeys(_block(n) for n in drawn):  # the key to the styles, in grey
        if block in styles:
            ax.plot([], [], color="0.35", ls=styles[block], lw=1.2, label=block)
    ax.set_xlabel("step")
    ax.set_ylabel(LABELS[metric])
    ns = _ns_label(run)
    ax.set_title((title or LABELS[metric]) + (f"\nNewton-Schulz: {ns}" if ns else ""), fontsize=11)
    integer_steps(ax)
    if not drawn:  # e.g. ortho_error of an AdamW run: say so rather than leave a blank axis
        ax.text(0.5, 0.5, "no values for this metric", transform=ax.transAxes, ha="center", va="center",
                color="0.4")
    else:
        robust_ylim(ax)
        if legend:  # right of the axis, clear of the curves
            ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.grid(alpha=0.3)
    return ax


def plot_spectral_runs(runs: Mapping, metric: str, *, names: Sequence[str] | None = None, title: str = ""):
    """``plot_spectral_layers`` of each run side by side (``{label: History or records}``, each axis
    titled by its label, ``title`` above all), on one y-range that a diverged run does not set (it
    is marked), with one colour per kind and one style per block across the runs and one legend
    under the panels; returns the figure."""
    _check_runs(runs)
    _check_metric(metric)
    fig, axes = plt.subplots(1, len(runs), figsize=(4.4 * len(runs), 3.9), squeeze=False, sharex=True)
    known = matrix_names(runs) if names is None else list(names)
    # one colour per kind and one style per block across the runs, which may record different
    # matrices: one legend serves all
    colors, styles = _kind_colors([*matrix_names(runs), *known]), _block_styles(known)
    handles: dict = {}
    for ax, (label, run) in zip(axes[0], runs.items()):
        plot_spectral_layers(run, metric, ax=ax, title=str(label), names=names, legend=False, colors=colors,
                             styles=styles)
        handles.update({line.get_label(): line for line in ax.lines if not line.get_label().startswith("_")})
    robust_ylim(axes[0])
    if title:
        fig.suptitle(title, fontsize=12)
    if not handles:  # no run has a value of this metric: each axis says so, no legend to place
        fig.tight_layout()
        return fig
    # one legend for all panels, under them: inside an axis it would hide curves
    columns = min(len(handles), 5)
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=columns, fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0.07 * (1 + (len(handles) - 1) // columns), 1, 1))
    return fig


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
            return plot_spectral_runs(self.runs, metric)
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
