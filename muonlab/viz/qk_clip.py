"""Attention logits over training (QK-clip, muonlab.optim.qk_clip) and a panel that trains one
optimizer variant at a chosen tau and draws its loss and max logits beside the runs before it.

Both read ``History.max_logit`` (``train(..., qk_clip=tau)``; ``qk_clip=math.inf`` records without
clipping), a (layers, heads) tensor per step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import matplotlib.pyplot as plt

from ..train import History
from .busy import say_when_busy
from .caption import add_caption, caption_runs
from .curves import integer_steps, plot_loss_curves
from .panel_output import check_choice, check_range, show_figure

__all__ = ["VariantPanel", "max_logit_per_layer", "plot_max_logits", "variant_panel"]

LAYER_STYLES = ("-", "--", ":", "-.")


def max_logit_per_layer(history: History) -> list[list[float]]:
    """Per layer, the max over heads of each step's max logit (before the clip): [layer][step]."""
    if not history.max_logit:
        raise ValueError("the run recorded no max logits: train it with qk_clip=tau (math.inf records without "
                         "clipping)")
    layers = history.max_logit[0].shape[0]
    return [[float(step[layer].nan_to_num(nan=-math.inf).max()) for step in history.max_logit]
            for layer in range(layers)]


def _tau_label(tau: float, run: str | None) -> str:
    """The threshold line's legend entry: "tau 30", "tau 30 (MuonClip)", or, for a run whose label
    already gives its tau ("MuonClip (tau 5.01)"), "tau of MuonClip (tau 5.01)"."""
    if run is None:
        return f"tau {tau:.3g}"
    return f"tau of {run}" if "tau" in run else f"tau {tau:.3g} ({run})"


def plot_max_logits(runs: Mapping[str, History], *, tau: float | Mapping[str, float] | None = None, ax=None,
                    title: str = "max attention logit per layer", legend: bool = True):
    """Each run's max attention logit per layer and step (a colour per run, a line style per
    layer), on a log axis; ``tau`` draws the threshold (one number, or {run label: tau} for the
    runs that clipped) as a dotted line in the run's colour. Returns the axis."""
    if not isinstance(runs, Mapping) or not runs:
        raise ValueError("runs must be a non-empty mapping {label: History}")
    if ax is None:
        _, ax = plt.subplots(figsize=(7.5, 3.5), layout="constrained")
    for i, (label, h) in enumerate(runs.items()):
        per_layer = max_logit_per_layer(h)
        steps = h.steps[:len(per_layer[0])] or list(range(1, len(per_layer[0]) + 1))
        for layer, values in enumerate(per_layer):
            ax.plot(steps, values, LAYER_STYLES[layer % len(LAYER_STYLES)], color=f"C{i}", lw=1.3,
                    label=f"{label}, layer {layer}")
        run_tau = tau.get(label) if isinstance(tau, Mapping) else tau
        if run_tau is not None and math.isfinite(run_tau):
            ax.axhline(run_tau, color=f"C{i}" if isinstance(tau, Mapping) else "black", ls=":", lw=1,
                       label=_tau_label(run_tau, label if isinstance(tau, Mapping) else None))
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("max logit (before the clip)")
    ax.set_title(title)
    integer_steps(ax)
    if legend:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    add_caption(ax.figure, caption_runs(runs))
    return ax


class VariantPanel:
    """A variant dropdown, a tau slider and a train button; each run is drawn (loss, max logit per
    layer) beside the last ``keep`` runs.

    ``run_fn(variant, tau) -> History`` trains one run (recording max logits: ``train(...,
    qk_clip=...)``). ``update(variant=, tau=)`` sets the controls when given and trains: the button's
    callback, to call directly in a cell without a frontend. ``clipping``: the variants that use
    tau (their label carries it).
    """

    def __init__(self, run_fn: Callable[[str, float], History], variants: Sequence[str], *, variant: str | None = None,
                 tau: float = 100.0, tau_range: tuple[float, float] = (1.0, 1000.0),
                 clipping: Sequence[str] = ("MuonClip",), keep: int = 4):
        import ipywidgets as w

        variants = list(variants)
        if not variants:
            raise ValueError("variants must name at least one variant")
        variant = variants[0] if variant is None else variant
        check_choice("variant", variant, variants)
        if not 0 < tau_range[0] < tau_range[1]:
            raise ValueError(f"tau_range must be (low, high) with 0 < low < high, got {tau_range}")
        check_range("tau", tau, *tau_range, what="tau_range")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an integer >= 1, got {keep!r}")
        self.run_fn, self.keep, self.clipping, self.tau_range = run_fn, keep, tuple(clipping), tuple(tau_range)
        self.runs: dict[str, History] = {}
        self.taus: dict[str, float] = {}
        style = {"description_width": "70px"}
        self.variant = w.Dropdown(options=variants, value=variant, description="variant", style=style)
        self.tau = w.FloatLogSlider(value=tau, base=10, min=math.log10(tau_range[0]), max=math.log10(tau_range[1]),
                                    step=0.05, description="tau", readout_format=".3g", style=style)
        self.button = w.Button(description="train", button_style="primary", icon="play")
        self.status = w.Label("")
        self.output = w.Output()
        self.button.on_click(lambda _: self.update())
        say_when_busy(self.button)
        self.widget = w.VBox([w.HBox([self.variant, self.tau, self.button]), self.status, self.output])

    def label(self, variant: str, tau: float) -> str:
        return f"{variant} (tau {tau:.3g})" if variant in self.clipping else variant

    def update(self, variant: str | None = None, tau: float | None = None):
        """Set the controls (when given), train one run, redraw; returns the figure."""
        if variant is not None:
            check_choice("variant", variant, self.variant.options)
        if tau is not None:
            check_range("tau", tau, *self.tau_range, what="tau_range")
            self.tau.value = tau
        if variant is not None:
            self.variant.value = variant
        v, t = self.variant.value, float(self.tau.value)
        label = self.label(v, t)
        self.status.value = f"training: {label} ..."
        try:
            history = self.run_fn(v, t)
        except BaseException as e:
            self.status.value = f"failed: {label}: {type(e).__name__}: {e}"
            raise
        self.runs.pop(label, None)
        self.runs[label] = history
        if v in self.clipping:
            self.taus[label] = t
        while len(self.runs) > self.keep:
            oldest = next(iter(self.runs))
            del self.runs[oldest]
            self.taus.pop(oldest, None)
        fig = self.figure()
        show_figure(self.output, fig, "loss and max logits")
        peak = max(max(layer) for layer in max_logit_per_layer(history))
        self.status.value = f"done: {label}, final loss {history.train_loss[-1]:.3f}, max logit {peak:.3g}"
        return fig

    def figure(self):
        """The kept runs' loss (left) and max logit per layer (right), not displayed."""
        fig, (left, right) = plt.subplots(1, 2, figsize=(13, 3.8))
        try:
            plot_loss_curves(self.runs, ax=left, title="loss (thin: train, markers: validation)", legend="none",
                             ylabel="cross-entropy (nats/byte)")
            plot_max_logits(self.runs, tau={k: t for k, t in self.taus.items() if k in self.runs}, ax=right)
            fig.tight_layout()
        except BaseException:
            plt.close(fig)
            raise
        return fig

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)


def variant_panel(run_fn: Callable[[str, float], History], variants: Sequence[str], **kwargs) -> VariantPanel:
    """A :class:`VariantPanel`; display it as the last expression of a cell."""
    return VariantPanel(run_fn, variants, **kwargs)
