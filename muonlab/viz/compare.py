"""A comparison over seeds drawn (curves with bands, final losses with intervals) and the panel that
runs one: pick configurations, seeds and steps, click run, read the table and the figure.

Both only read the ``Comparison`` that ``muonlab.experiments.compare.compare`` returns::

    from muonlab.viz.compare import compare_panel, plot_comparison
    plot_comparison(result)                                  # a figure of a finished comparison
    panel = compare_panel(configs, model=cfg, steps=60)      # display it; panel.update() runs it
"""

from __future__ import annotations

import html
import math
import textwrap
from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from ..experiments.compare import Comparison, compare, describe_test, verdict_text
from ..runs import RunRecord, as_comparison
from .busy import say_when_busy
from .caption import add_caption, caption_runs
from .panel_output import check_range, show_figure

__all__ = ["ComparePanel", "compare_panel", "comparison_html", "plot_comparison"]

DIVERGED_COLOR = "black"  # not one of the C0..C9 colours the configurations take


def _limits(values: Sequence[float]) -> tuple[float, float]:
    """y limits around the finite ``values`` with a margin: the runs that count set the axis, so a
    diverged one cannot flatten them."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return 0.0, 1.0
    lo, hi = min(finite), max(finite)
    pad = 0.06 * (hi - lo) if hi > lo else 0.05 * max(abs(hi), 1.0)
    return lo - pad, hi + pad


def _mark_diverged(ax, steps: Sequence[int], losses: Sequence[float], color, top: float) -> None:
    """A diverged run: dashed, clipped at the axis top, with an x where it leaves the axis (or ends)."""
    clipped = [x if math.isfinite(x) else math.nan for x in losses]
    ax.plot(steps, clipped, color=color, lw=1, ls="--", alpha=0.8)
    leave = next((i for i, x in enumerate(losses) if not math.isfinite(x) or x > top), len(losses) - 1)
    y = losses[leave] if math.isfinite(losses[leave]) and losses[leave] <= top else top
    ax.plot([steps[leave]], [y], marker="x", color=DIVERGED_COLOR, ms=9, mew=2, clip_on=False, zorder=5)


def _curves(ax, result: Comparison) -> None:
    kept = [r for c in result.configs.values() for r in c.kept]
    # The axis spans the kept runs from their lowest loss up to where they started: a run that
    # spikes above its start (or diverges) is clipped there, not allowed to flatten the others.
    lo, hi = _limits([min(r.train_loss) for r in kept] + [r.train_loss[0] for r in kept] + [result.target])
    for i, c in enumerate(result.configs.values()):
        color = f"C{i}"
        for r in c.kept:  # each seed, thin: with three seeds the runs say more than a band alone
            ax.plot(c.steps, r.train_loss, color=color, lw=0.7, alpha=0.35)
        if len(c.kept) > 1:
            ax.fill_between(c.steps, c.low, c.high, color=color, alpha=0.18, lw=0)
        if c.kept:
            ax.plot(c.steps, c.mean, color=color, lw=2)
        for r in c.runs:
            if r.diverged:
                _mark_diverged(ax, c.steps, r.train_loss, color, hi)
    if math.isfinite(result.target):
        ax.axhline(result.target, color="0.35", lw=0.9, ls=":")
    if any(x > hi for r in kept for x in r.train_loss):
        ax.text(0.99, 0.98, "clipped: losses above the starting loss", transform=ax.transAxes, ha="right",
                va="top", fontsize=7, color="0.3")
    ax.set_ylim(lo, hi)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("training cross-entropy (nats/byte)")
    pct = f"{100 * result.confidence:g}%"
    ax.set_title(f"training loss: mean over seeds, {pct} band", fontsize=11)
    ax.grid(alpha=0.3)


def _finals(ax, result: Comparison) -> None:
    names = list(result.configs)
    kept = [r.final_val_loss for c in result.configs.values() for r in c.kept]
    bands = [v for c in result.configs.values() for v in (c.final_val_loss.low, c.final_val_loss.high)]
    lo, hi = _limits(kept + bands)
    for i, c in enumerate(result.configs.values()):
        color = f"C{i}"
        n = len(c.runs)
        for k, r in enumerate(c.runs):
            x = i + 0.22 * (k - (n - 1) / 2) / max(n - 1, 1)  # the seeds side by side
            if r.diverged:  # at the top edge, inside: its loss is off the axis or not a number
                ax.plot([x], [hi], marker="x", color=DIVERGED_COLOR, ms=8, mew=2, clip_on=False, zorder=5)
            else:
                ax.plot([x], [r.final_val_loss], "o", color=color, ms=4, alpha=0.6)
        if c.diverged_seeds:
            ax.annotate(f"diverged: seed{'s' if len(c.diverged_seeds) > 1 else ''} "
                        f"{', '.join(map(str, c.diverged_seeds))}", (i, hi), xytext=(0, -12),
                        textcoords="offset points", ha="center", va="top", fontsize=7, color=DIVERGED_COLOR)
        e = c.final_val_loss
        if e.n > 1:
            ax.errorbar([i + 0.3], [e.mean], yerr=[[e.mean - e.low], [e.high - e.mean]], fmt="D", color=color,
                        ms=6, capsize=4, lw=1.6)
        elif e.n == 1:
            ax.plot([i + 0.3], [e.mean], "D", color=color, ms=6)
    ax.set_ylim(lo, hi)
    ax.set_xlim(-0.5, len(names) - 0.5)
    ax.set_xticks(range(len(names)), names, fontsize=9)
    ax.set_ylabel("final validation loss")
    finals = [(a, b, t) for a, b, metric, t in result.tests if metric == "final_val_loss"]
    title = "final validation loss per seed, mean and interval"
    if len(finals) == 1 and not math.isnan(finals[0][2].difference):
        a, b, t = finals[0]
        title += f"\n{a} - {b}: {t.difference:+.3f}, {t.test}\n" + textwrap.fill(verdict_text(t), 56)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)


def plot_comparison(result: Comparison, axes=None, *, title: str | None = None):
    """Left: the training loss per step of each configuration, the mean over the seeds that did not
    diverge, its t interval as a band and each seed as a thin line; a diverged seed dashed and
    marked with a red x where it leaves the axis (whose range the other runs set); the target as a
    dotted line. Right: each seed's final validation loss and the mean with its interval (diverged
    seeds as a red x at the top), the difference and its verdict in the title when there is one.
    The legend (each configuration with the Newton-Schulz form, dtype and backend that ran) sits
    below the axes. ``result``: a Comparison or a saved one (``muonlab.runs.load``). ``axes``: None
    (a new figure) or a pair. Returns the pair. The figure's caption says what produced it
    (:mod:`muonlab.viz.caption`)."""
    given, result = result, as_comparison(result)
    if not isinstance(result, Comparison):
        raise TypeError(f"result must be the Comparison that compare() returns or a saved one (a RunRecord), got "
                        f"{type(result).__name__}")
    if axes is None:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.6), gridspec_kw=dict(width_ratios=(1.6, 1)))
    ax_curves, ax_finals = axes
    fig = ax_curves.figure
    _curves(ax_curves, result)
    _finals(ax_finals, result)
    handles = [Line2D([], [], color=f"C{i}", lw=2, label=c.label) for i, c in enumerate(result.configs.values())]
    handles.append(Patch(color="0.5", alpha=0.3, label=f"{100 * result.confidence:g}% interval over seeds"))
    if math.isfinite(result.target):
        handles.append(Line2D([], [], color="0.35", lw=0.9, ls=":", label=f"target {result.target:.3f}"))
    if any(c.diverged_seeds for c in result.configs.values()):
        handles.append(Line2D([], [], color=DIVERGED_COLOR, marker="x", ls="none", mew=2, label="diverged seed"))
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 3), fontsize=8, frameon=False)
    rows = math.ceil(len(handles) / 3)
    seeds = len(result.seeds)
    fig.suptitle(title or f"{len(result.configs)} configurations x {seeds} seeds, {result.steps} steps", fontsize=12)
    fig.subplots_adjust(left=0.07, right=0.98, top=0.80, bottom=0.15 + 0.045 * rows, wspace=0.22)
    add_caption(fig, caption_runs(given))
    return ax_curves, ax_finals


def comparison_html(result: Comparison | RunRecord) -> str:
    """The summary table as HTML (the panel's), with the tests below it."""
    result = as_comparison(result)
    pct = f"{100 * result.confidence:g}%"
    head = (f"<tr><th>configuration</th><th>Newton-Schulz (form, dtype, backend)</th>"
            f"<th>final val loss ({pct} CI)</th><th>steps to {result.target:.3f} ({pct} CI)</th>"
            f"<th>diverged</th></tr>")

    def cell(e, digits):
        if e.n == 0:
            return "-"
        return f"{e.mean:.{digits}f}" + (f" [{e.low:.{digits}f}, {e.high:.{digits}f}]" if e.n > 1 else "")

    body = "".join(
        f"<tr><td>{html.escape(c.name)}</td><td>{html.escape(c.choices)}</td><td>{cell(c.final_val_loss, 3)}</td>"
        f"<td>{cell(c.steps_to_target, 1)}</td><td>{', '.join(map(str, c.diverged_seeds)) or '-'}</td></tr>"
        for c in result.configs.values())
    tests = "".join(f"<li>{html.escape(describe_test(a, b, m, t))}</li>" for a, b, m, t in result.tests)
    return (f"<table class='muonlab-compare' style='font-size:12px'>{head}{body}</table>"
            + (f"<ul style='font-size:12px'>{tests}</ul>" if tests else ""))


MAX_SEEDS = 8


class ComparePanel:
    """Configurations (a multiple choice), the number of seeds (0..n-1), steps and a run button;
    below, the table of the last comparison and its figure.

    ``callback(configs=, seeds=, steps=)`` runs ``compare`` on the named configurations (a plain
    function: call it in a cell to run without a frontend); ``update()`` runs it with the widgets'
    values and redraws (the button's click). ``last`` is the last ``Comparison``.
    """

    def __init__(self, configs: Mapping[str, Mapping], *, model, seeds: int = 3, steps: int = 60,
                 chosen: Sequence[str] | None = None, max_steps: int = 500, **compare_kwargs):
        import ipywidgets as w

        if not isinstance(configs, Mapping) or not configs:
            raise ValueError("configs must be a non-empty dict {name: settings}")
        chosen = list(configs) if chosen is None else list(chosen)
        unknown = [c for c in chosen if c not in configs]
        if unknown or not chosen:
            raise ValueError(f"chosen must name some of the configurations {list(configs)}, got {chosen}")
        check_range("seeds", seeds, 1, MAX_SEEDS, integer=True)
        check_range("steps", steps, 1, max_steps, integer=True, what="the steps slider (1 to max_steps)")
        self.configs = {name: dict(settings) for name, settings in configs.items()}
        self.model = model
        self.compare_kwargs = compare_kwargs
        self.last: Comparison | None = None
        style = {"description_width": "100px"}
        self.choice = w.SelectMultiple(options=list(configs), value=tuple(chosen), description="configurations",
                                       rows=min(len(configs), 6), style=style)
        self.seeds = w.IntSlider(value=seeds, min=1, max=MAX_SEEDS, description="seeds", style=style)
        self.steps = w.IntSlider(value=steps, min=1, max=max_steps, description="steps", style=style)
        self.button = w.Button(description="run", button_style="primary", icon="play")
        self.status = w.Label("")
        self.table = w.HTML("")
        self.output = w.Output()  # the figure (show_figure)
        self.progress_area = w.Output()  # the runs' bar, apart from the figure (see TrainingPanel)
        self.button.on_click(self.update)
        say_when_busy(self.button)
        controls = w.VBox([self.choice, self.seeds, self.steps, w.HBox([self.button, self.status])])
        self.widget = w.VBox([controls, self.progress_area, self.table, self.output])

    def callback(self, *, configs: Sequence[str], seeds: Sequence[int], steps: int) -> Comparison:
        """Compare the named configurations over ``seeds`` for ``steps`` steps."""
        unknown = [c for c in configs if c not in self.configs]
        if unknown or not configs:
            raise ValueError(f"configs must name some of {list(self.configs)}, got {list(configs)}")
        return compare({name: self.configs[name] for name in configs}, model=self.model, seeds=seeds,
                       steps=steps, **self.compare_kwargs)

    def values(self) -> dict:
        """The callback's keyword arguments as the widgets hold them now."""
        return dict(configs=list(self.choice.value), seeds=list(range(int(self.seeds.value))),
                    steps=int(self.steps.value))

    def update(self, _button=None) -> Comparison | None:
        """Run with the widgets' values, then show the table and the figure. An error shows in the
        status line and clears the previous table and figure (nothing stale stays next to it)."""
        v = self.values()
        what = f"{len(v['configs'])} configurations x {len(v['seeds'])} seeds, {v['steps']} steps"
        self.status.value = f"running {what} ..."
        try:
            self.progress_area.clear_output(wait=True)
            with self.progress_area:
                result = self.callback(**v)
            fig = plt.figure(figsize=(12, 4.6))
            try:
                plot_comparison(result, fig.subplots(1, 2, gridspec_kw=dict(width_ratios=(1.6, 1))))
            except BaseException:
                plt.close(fig)
                raise
        except BaseException as e:  # a Ctrl-C too: the status must not say "running" any more
            self.output.outputs = ()
            self.table.value = ""
            self.last = None
            state = "interrupted" if isinstance(e, KeyboardInterrupt) else "failed"
            self.status.value = f"{state}: {what}: {type(e).__name__}: {e}"
            if isinstance(e, Exception):
                return None
            raise
        show_figure(self.output, fig, "comparison figure")
        self.table.value = comparison_html(result)
        self.last = result
        finals = [(a, b, t) for a, b, m, t in result.tests if m == "final_val_loss"]
        verdict = ""
        if finals and not math.isnan(finals[0][2].difference):
            a, b, t = finals[0]
            verdict = f"; {a} - {b} final val loss {t.difference:+.3f}, {verdict_text(t)}"
        self.status.value = f"done: {what}{verdict}"
        return result

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)


def compare_panel(configs: Mapping[str, Mapping], *, model, **kwargs) -> ComparePanel:
    """Build a ``ComparePanel`` over ``configs`` ({name: settings}, as ``compare`` takes them) on
    ``model`` (a ``GPTConfig`` or a function returning a model). Display it as the last expression
    of a cell; ``panel.update()`` runs it once without clicking. Other keywords: ``seeds`` (how
    many, 1 to 8), ``steps``, ``chosen`` (the configurations selected at first), ``max_steps``,
    and ``compare``'s own (``target``, ``window``, ``confidence``, ``nprocs``, ...)."""
    return ComparePanel(configs, model=model, **kwargs)
