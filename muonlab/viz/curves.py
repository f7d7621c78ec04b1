"""Loss curves and singular-value pictures."""

from __future__ import annotations

import matplotlib

matplotlib.use(matplotlib.get_backend())  # keep the notebook's backend; Agg when headless
import matplotlib.pyplot as plt  # noqa: E402


def plot_loss_curves(histories: dict, *, ax=None, title: str = "loss"):
    """Train (thin) and validation (markers) loss for each named History, on one axis."""
    for name, h in histories.items():  # matplotlib's own error names neither the run nor the lists
        for xs, ys in (("steps", "train_loss"), ("val_steps", "val_loss")):
            if len(getattr(h, xs)) != len(getattr(h, ys)):
                raise ValueError(f"run {name!r} has {len(getattr(h, xs))} {xs} but {len(getattr(h, ys))} {ys}: "
                                 "one loss per step")
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.5))
    for i, (name, h) in enumerate(histories.items()):
        color = f"C{i}"
        ax.plot(h.steps, h.train_loss, color=color, alpha=0.5, lw=1, label=f"{name} train")
        ax.plot(h.val_steps, h.val_loss, "o-", color=color, ms=3, label=f"{name} val")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/byte)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
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
