"""ipywidgets panels for notebooks, and the small plots they draw.

A panel only reads what its callback returns (a ``History`` or a dict of them); the callback owns the
training. ``muon_trainer`` builds such a callback for the small GPT, so a notebook needs no glue.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import matplotlib.pyplot as plt

from ..kernels.coefficients import PRESETS
from ..models import GPT, GPTConfig
from ..train import History, make_optimizer, train
from .curves import ns_choice_short, plot_loss_curves, robust_ylim
from .busy import say_when_busy
from .caption import add_caption, caption_runs
from .panel_output import check_range, show_figure


def plot_val_loss_vs_time(histories: dict, *, ax=None, title: str = "validation loss vs wall time",
                          ylabel: str = "validation loss"):
    """Validation loss against the cumulative training-step wall time of each named History.

    Evaluation time is not counted, so the x axis is what the optimizer and the model cost. Runs
    are labelled with the Newton-Schulz choice their History recorded; a diverged run is marked.
    """
    points = {}
    for name, h in histories.items():
        elapsed, total = {0: 0.0}, 0.0  # an evaluation before the first step is at time 0
        for step, dt in zip(h.steps, h.step_time_s):
            total += dt
            elapsed[step] = total
        missing = [s for s in h.val_steps if s not in elapsed]
        if missing or len(h.val_steps) != len(h.val_loss):
            raise ValueError(f"run {name!r}: validation steps {missing or h.val_steps} have no training time "
                             f"(steps {len(h.steps)}, step times {len(h.step_time_s)}) or val_loss has "
                             f"{len(h.val_loss)} values for {len(h.val_steps)} steps")
        points[name] = [elapsed[s] for s in h.val_steps]
    if ax is None:  # made only once the runs are checked: no figure is left open by an error
        _, ax = plt.subplots(figsize=(6, 3.5))
    for i, (name, h) in enumerate(histories.items()):
        ns = ns_choice_short(h.ns_choices)
        ax.plot(points[name], h.val_loss, "o-", color=f"C{i}", ms=3, label=f"{name} ({ns})" if ns else name)
    ax.set_xlabel("training wall time (s)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    robust_ylim(ax)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    add_caption(ax.figure, caption_runs(histories))
    return ax


def muon_trainer(cfg: GPTConfig, *, steps: int, batch_size: int = 16, seed: int = 0,
                 eval_every: int = 0, eval_batches: int = 4, adamw_lr: float = 3e-3,
                 progress: bool = True, spectral_every: int = 0, **muon_kwargs) -> Callable[..., History]:
    """A callback ``run(lr, momentum, ns_steps, ns_coefficients) -> History`` for ``training_panel``.

    Every call trains a fresh ``GPT(cfg)`` from the same seed on the same batches, so two calls
    differ only in the optimizer settings. ``progress`` shows ``train``'s tqdm bar while it runs
    (inside the panel when the panel calls it); ``spectral_every`` records spectra into
    ``History.spectral`` as ``train`` does (``muonlab.run_checks`` reads them). Extra keyword
    arguments go to ``Muon`` (e.g. ns_dtype).
    """

    def run(lr: float, momentum: float, ns_steps: int, ns_coefficients: str) -> History:
        import torch

        torch.manual_seed(seed)
        model = GPT(cfg)
        opt = make_optimizer("muon", model, lr=lr, adamw_lr=adamw_lr, momentum=momentum,
                             ns_steps=int(ns_steps), ns_coefficients=ns_coefficients, **muon_kwargs)
        return train(model, opt, steps=steps, batch_size=batch_size, seed=seed, eval_every=eval_every,
                     eval_batches=eval_batches, progress=progress, desc="muon", spectral_every=spectral_every)

    return run


# the momentum and Newton-Schulz-steps sliders' limits (lr's are the panel's lr_range argument)
MOMENTUM_RANGE = (0.0, 0.99)
NS_STEPS_RANGE = (1, 10)


class TrainingPanel:
    """Sliders (lr, momentum, ns_steps), a preset dropdown and a button that reruns and redraws.

    ``update()`` is the button's callback; call it directly to run once without a frontend (CI).
    The last ``keep`` runs are overlaid, labelled by their settings. The callback runs inside the
    panel's output area, so a progress bar it shows (``muon_trainer``'s) appears in the panel.
    """

    def __init__(self, run_fn: Callable, *, lr: float = 0.02, momentum: float = 0.95,
                 ns_steps: int = 5, preset: str = "keller", presets: Sequence[str] | None = None,
                 lr_range: tuple[float, float] = (1e-3, 0.1), keep: int = 3):
        import ipywidgets as w

        presets = list(presets) if presets is not None else list(PRESETS)
        if preset not in presets:
            raise ValueError(f"preset {preset!r} is not among the panel's presets {presets}")
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        # refused, not clamped (as a slider would, silently: the first run would train with settings
        # nobody asked for) nor widened to fit: a slider's range is what one can pick back after moving
        # it, so it stays what the caller chose (lr_range) or the panel's fixed limits
        check_range("lr", lr, *lr_range, what="lr_range")
        check_range("momentum", momentum, *MOMENTUM_RANGE)
        check_range("ns_steps", ns_steps, *NS_STEPS_RANGE, integer=True)
        self.run_fn = run_fn
        self.keep = keep
        self.runs: dict[str, History] = {}
        style = {"description_width": "110px"}
        self.lr = w.FloatLogSlider(value=lr, base=10, min=_log10(lr_range[0]), max=_log10(lr_range[1]),
                                   step=0.05, description="Muon lr", readout_format=".4f", style=style)
        self.momentum = w.FloatSlider(value=momentum, min=MOMENTUM_RANGE[0], max=MOMENTUM_RANGE[1], step=0.01,
                                      description="momentum", style=style)
        self.ns_steps = w.IntSlider(value=ns_steps, min=NS_STEPS_RANGE[0], max=NS_STEPS_RANGE[1],
                                    description="NS steps", style=style)
        self.preset = w.Dropdown(options=presets, value=preset, description="coefficients", style=style)
        self.button = w.Button(description="train", button_style="primary", icon="play")
        self.clear = w.Button(description="clear runs")
        self.status = w.Label("")
        self.output = w.Output()  # the figure, set from here (show_figure)
        # the running callback's bar and summary line, captured by the frontend: a separate area,
        # since the frontend syncs what it captured back into an Output and would overwrite a figure
        self.progress_area = w.Output()
        self.button.on_click(self.update)
        self.clear.on_click(self._clear)
        say_when_busy(self.button, self.clear)
        controls = w.VBox([self.lr, self.momentum, self.ns_steps, self.preset,
                           w.HBox([self.button, self.clear, self.status])])
        self.widget = w.VBox([controls, self.progress_area, self.output])

    def values(self) -> dict:
        """The callback's keyword arguments as the widgets hold them now."""
        return dict(lr=float(self.lr.value), momentum=float(self.momentum.value),
                    ns_steps=int(self.ns_steps.value), ns_coefficients=self.preset.value)

    def update(self, _button=None):
        """Run the callback with the current values, keep the result, redraw; returns the figure."""
        v = self.values()
        label = f"lr={v['lr']:.3g} mu={v['momentum']:.2f} ns={v['ns_steps']} {v['ns_coefficients']}"
        self.status.value = f"training: {label} ..."
        kept = dict(self.runs)
        try:
            self.progress_area.clear_output(wait=True)
            with self.progress_area:  # a bar the callback opens is drawn here, above the last plot
                result = self.run_fn(**v)
            histories = result if isinstance(result, dict) else {label: result}
            if not histories:
                raise ValueError("the callback returned no runs")
            for name, h in histories.items():
                self.runs.pop(name, None)  # a rerun moves to the end instead of keeping its old slot
                self.runs[name] = h
            while len(self.runs) > self.keep:
                self.runs.pop(next(iter(self.runs)))
            fig = self._draw()  # a run the plot refuses is not kept: the next click still draws
        except BaseException as e:  # a Ctrl-C too: the status must not say "training" any more
            self.runs = kept
            what = "interrupted" if isinstance(e, KeyboardInterrupt) else "failed"
            self.status.value = f"{what}: {label}: {type(e).__name__}: {e}"
            raise
        last = next(reversed(histories.values()))
        final = last.val_loss[-1] if last.val_loss else float("nan")
        self.status.value = f"done: {label}, final val loss {final:.3f}"
        return fig

    def _clear(self, _button=None) -> None:
        self.runs.clear()
        self.output.outputs = ()
        self.progress_area.clear_output()
        self.status.value = ""

    def _draw(self):
        fig, ax = plt.subplots(figsize=(9, 3.5))
        try:  # the legend right of the axis: inside, it covered the curves
            plot_loss_curves(self.runs, ax=ax, title="Muon on the small GPT", ylabel="cross-entropy (nats/byte)")
        except BaseException:
            plt.close(fig)  # not left open in pyplot for every failed draw
            raise
        fig.tight_layout()
        show_figure(self.output, fig, "loss curves")
        return fig

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)


def _log10(x: float) -> float:
    import math

    if not x > 0:
        raise ValueError(f"lr_range bounds must be > 0, got {x}")
    return math.log10(x)


def training_panel(run_fn: Callable, **kwargs) -> TrainingPanel:
    """Build a ``TrainingPanel`` around ``run_fn(lr, momentum, ns_steps, ns_coefficients)``.

    ``run_fn`` returns a ``History`` or a dict of named Histories (see ``muon_trainer``). Display
    the panel as the last expression of a cell; ``panel.update()`` runs it once without clicking.
    """
    return TrainingPanel(run_fn, **kwargs)
