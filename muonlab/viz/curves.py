"""Loss curves and singular-value pictures, and what every curve over steps shares: integer step
ticks, y-axes that a diverged run does not flatten (:func:`robust_ylim`), the Newton-Schulz choice
in a short label (:func:`ns_choice_short`)."""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Mapping, Sequence
from numbers import Real

import matplotlib

matplotlib.use(matplotlib.get_backend())  # keep the notebook's backend; Agg when headless
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from ..runs import RunRecord, as_history  # noqa: E402
from ..trace.ns_choice import ns_choice_short  # noqa: E402
from .caption import add_caption, caption_runs  # noqa: E402

__all__ = ["DIVERGED_FACTOR", "integer_steps", "ns_choice_short", "plot_loss_curves", "plot_singular_values",
           "robust_ylim"]

DIVERGED_FACTOR = 10.0
"""A curve has diverged where it turns non-finite, or where its magnitude passes this many times
its largest over its first quarter (or, if larger, the median of that over the curves drawn
together): the y-axis is then set by the curves before they diverged, and a mark says where."""
_MARK = "muonlab-diverged"  # the gid of the marks robust_ylim draws (and removes on a redraw)


def integer_steps(ax) -> None:
    """Step ticks at whole numbers only (a run of 8 steps would get 2.5, 7.5)."""
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _series(ax) -> list:
    return [line for line in ax.lines if line.get_gid() != _MARK and len(line.get_ydata())]


def _diverged_index(ys: list[float], scale: float, factor: float) -> int | None:
    """The first index where ``ys`` passes ``factor`` x ``scale`` in magnitude or is not finite,
    then back to where the climb to it began (every value from there on more than 1.5 times any
    before it), so that the runaway does not set the axis either."""
    cut = next((i for i, y in enumerate(ys) if not math.isfinite(y) or abs(y) > factor * scale), None)
    if cut is None:
        return None
    before = list(itertools.accumulate((abs(y) for y in ys[:cut]), max))  # before[i]: max |y| of ys[:i + 1]
    lowest = math.inf  # the smallest |y| from the candidate start to the cut
    while cut > 1:
        lowest = min(lowest, abs(ys[cut - 1]))
        if not lowest > 1.5 * before[cut - 2]:
            break
        cut -= 1
    return cut


def _start_scale(ys: list[float]) -> float:
    """The largest magnitude over the first quarter of the finite values (at least one)."""
    finite = [abs(y) for y in ys if math.isfinite(y)]
    return max(finite[:max(1, len(finite) // 4)], default=0.0)


def robust_ylim(axes, *, factor: float = DIVERGED_FACTOR) -> list[tuple[str, float]]:
    """One y-range for the curves of ``axes`` (an Axes or several: a shared axis that one diverged
    run does not flatten), from every curve's values before it diverged (``DIVERGED_FACTOR``); each
    diverged curve gets a mark in its colour at the top of its axis where it left, and the axis a
    note by the first mark ("diverged at step k", or "off the scale" for a spike it came back
    from). Without a diverged curve, one axis keeps matplotlib's own limits. Returns (label, x) of
    each diverged curve."""
    axes = [axes] if isinstance(axes, Axes) else [a for a in np.ravel(np.asarray(axes, dtype=object))]
    for ax in axes:
        for artist in [*ax.lines, *ax.texts]:
            if artist.get_gid() == _MARK:
                artist.remove()
    curves = [(ax, line, [float(x) for x in line.get_xdata()], [float(y) for y in line.get_ydata()])
              for ax in axes for line in _series(ax)]
    starts = [s for s in (_start_scale(ys) for *_, ys in curves) if s > 0]
    floor = statistics.median(starts) if starts else 0.0
    kept: list[float] = []
    diverged = []
    for ax, line, xs, ys in curves:
        scale = max(_start_scale(ys), floor)
        cut = _diverged_index(ys, scale, factor) if scale > 0 else next(
            (i for i, y in enumerate(ys) if not math.isfinite(y)), None)
        kept += [y for y in ys[:cut] if math.isfinite(y)]
        if cut is not None:
            # "diverged" where the curve ends not finite or still off the scale; a spike it came back from is not
            ended = not math.isfinite(ys[-1]) or (scale > 0 and abs(ys[-1]) > factor * scale)
            diverged.append((ax, line, xs[cut], ended))
    if not kept or (not diverged and len(axes) == 1):
        return []
    log = all(ax.get_yscale() == "log" for ax in axes)
    if log:
        kept = [y for y in kept if y > 0] or [1.0]
        lo, hi = min(kept), max(kept)
        lo, hi = lo / (hi / lo) ** 0.05 if hi > lo else lo / 2, hi * (hi / lo) ** 0.05 if hi > lo else hi * 2
    else:
        lo, hi = min(kept), max(kept)
        pad = 0.05 * (hi - lo) if hi > lo else 0.05 * abs(hi) or 1.0
        lo, hi = lo - pad, hi + pad
    for ax in axes:
        ax.set_ylim(lo, hi)
    out = []
    for ax in dict.fromkeys(ax for ax, *_ in diverged):
        here = [(line, x, ended) for a, line, x, ended in diverged if a is ax]
        for line, x, _ in here:
            ax.plot([x], [1.0], marker="v", ms=8, color=line.get_color(), transform=ax.get_xaxis_transform(),
                    clip_on=False, gid=_MARK, label="_diverged", zorder=5)
            label = line.get_label()
            out.append(("" if label.startswith("_") else label, x))
        # one word by the first mark, where the diverged curve leaves the axis anyway
        line, x, ended = min(here, key=lambda lx: lx[1])
        left, right = ax.get_xlim()
        more = f" ({len(here)} curves)" if len(here) > 1 else ""
        what = "diverged" if ended else "off the scale"
        ax.text(x, 0.97, f" {what} at step {x:g}{more} ", transform=ax.get_xaxis_transform(), va="top",
                ha="left" if x - left < 0.6 * (right - left) else "right", fontsize=7.5, color=line.get_color(),
                gid=_MARK)
    return out


def _loss_runs(histories) -> list[tuple[str, list, list, list, list, str]]:
    """(name, steps, train losses, val steps, val losses, Newton-Schulz label) per run, from a
    History, a saved run (a RunRecord), a sequence of losses, or a mapping of names to any."""
    if isinstance(histories, Mapping):
        items = list(histories.items())
    elif isinstance(histories, RunRecord) or hasattr(histories, "train_loss") or _is_losses(histories):
        items = [("", histories)]
    else:
        raise TypeError(f"expected a History, a sequence of losses or a mapping {{name: History or losses}} (a saved "
                        f"run, muonlab.runs.load(name), counts as a History), got {type(histories).__name__}")
    runs = []
    for name, h in items:
        h = as_history(h)
        if hasattr(h, "train_loss"):
            for xs, ys in (("steps", "train_loss"), ("val_steps", "val_loss")):
                # matplotlib's own error names neither the run nor the lists
                if len(getattr(h, xs)) != len(getattr(h, ys)):
                    raise ValueError(f"run {name!r} has {len(getattr(h, xs))} {xs} but {len(getattr(h, ys))} {ys}: "
                                     "one loss per step")
            runs.append((str(name), list(h.steps), list(h.train_loss), list(h.val_steps), list(h.val_loss),
                         ns_choice_short(getattr(h, "ns_choices", None))))
        elif _is_losses(h):
            runs.append((str(name), list(range(1, len(h) + 1)), [float(v) for v in h], [], [], ""))
        else:
            raise TypeError(f"run {name!r}: expected a History or a sequence of losses, got {type(h).__name__}")
    return runs


def _is_losses(value) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str) and all(isinstance(v, Real) for v in value)


def plot_loss_curves(histories, *, ax=None, title: str = "loss", legend: str = "outside", ylabel: str = "loss"):
    """Train (thin) and validation (markers) loss of each run, on one axis.

    ``histories``: a mapping ``{name: run}`` or one run, a run being a History (``train``,
    ``compare_optimizers``), a saved one (``muonlab.runs.load``) or a sequence of losses, one per
    step from 1 (a worker's ``losses``). A run whose History says what Newton-Schulz ran (``History.ns_choices``) is
    labelled with it: "muon (bf16, plain, torch)". Steps tick at whole numbers; a diverged run is
    marked and leaves the y-axis to the others (:func:`robust_ylim`). ``legend``: "outside" (right
    of the axis, clear of the curves), "inside" (matplotlib's best place), or "none". The figure's
    caption says what produced the runs (:mod:`muonlab.viz.caption`).
    """
    if legend not in ("outside", "inside", "none"):
        raise ValueError(f"legend must be 'outside', 'inside' or 'none', got {legend!r}")
    runs = _loss_runs(histories)
    if ax is None:
        # constrained: the figure makes room for a legend outside the axis (saved or shown)
        _, ax = plt.subplots(figsize=(7.5, 3.5) if legend == "outside" else (6, 3.5), layout="constrained")
    for i, (name, steps, train, val_steps, val, ns) in enumerate(runs):
        color = f"C{i}"
        label = " ".join(p for p in (name, f"({ns})" if ns else "") if p)
        ax.plot(steps, train, color=color, alpha=0.5 if val else 0.9, lw=1, label=f"{label} train".strip())
        if val:
            ax.plot(val_steps, val, "o-", color=color, ms=3, label=f"{label} val".strip())
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    integer_steps(ax)
    robust_ylim(ax)
    if legend == "outside":
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    elif legend == "inside":
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    add_caption(ax.figure, caption_runs(histories))
    return ax


def plot_singular_values(spectra: dict, *, ax=None, title: str = "singular values"):
    """Sorted singular values for each named 1-D tensor (e.g. before / after Newton-Schulz)."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.5))
    for name, sv in spectra.items():
        ax.plot(sv.detach().float().cpu().numpy(), label=name)
    ax.set_xlabel("index (descending)")
    ax.set_ylabel("singular value")
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return ax
