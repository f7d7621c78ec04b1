"""``make demo`` (``python -m muonlab.cli demo``), both halves; the CLI only parses arguments.

``run_single``: the small GPT trained with Muon and with AdamW in this process; prints a table
(final losses, tokens/s, optimizer step time) and writes loss_curves.png.

``run_distributed``: FSDP2 + Muon on ``nprocs`` workers, then what the optimizer did. It launches
``muonlab.experiments.train.train_worker`` by muonlab's device rule (NCCL, one GPU per worker, on a
node with enough GPUs; gloo CPU workers elsewhere, or with ``device="cpu"``), prints the plan and the
bytes each rank moved per path (counted at the collectives, next to the plan's figure), and
writes the last step's per-rank timeline as a PNG and as Chrome-trace JSON (open it in
https://ui.perfetto.dev).

Figures are drawn on ``matplotlib.figure.Figure`` objects, not pyplot, so calling these from a
notebook neither needs a backend switch nor leaves figures open.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from ._base import check_whole
from .distributed.device import requested_device
from .experiments.train import MODES, train_worker
from .launcher import launch
from .models.gpt import check_width
from .trace import Span, write_chrome_trace

__all__ = ["DEMO_MODEL", "check_out_dir", "run", "run_distributed", "run_single"]

# 5 blocks on 4 ranks: 5 matrices per shape do not split evenly, so the plan shows full and
# remainder batches.
DEMO_MODEL = dict(d_model=64, n_layers=5, n_heads=4, context=64, batch_per_rank=4)
DEMO_EP = 2
"""Expert-parallel ranks of the "ep" demo: its workers run a (nprocs // DEMO_EP, DEMO_EP) mesh."""
SINGLE_HEADS = 4
"""Attention heads of the single-process demo's GPT: its width must be a multiple."""


def run(out_dir="runs/demo", *, steps: int = 150, width: int = 128, layers: int = 2, nprocs: int = 4,
        device: str | None = None) -> None:
    """Both halves: ``run_single`` for ``steps`` steps, then, if ``nprocs > 1``, ``run_distributed``
    on ``nprocs`` workers for its own few steps (it shows the plan and a step's timeline, not
    convergence, and each CPU worker step is slow). ``device`` goes to ``launch`` (None: the rule).

    Every argument is checked before either half trains (a ValueError naming it)."""
    check_out_dir(out_dir)
    _check_single_args(steps, width, layers)
    _check_workers_args(nprocs, device)
    run_single(out_dir, steps=steps, width=width, layers=layers)
    if nprocs > 1:
        run_distributed(out_dir, nprocs=nprocs, device=device)


def check_out_dir(out_dir) -> None:
    """Refuse, before any training, an output folder the figures could not be written to: an
    existing file, a path under one, or one whose nearest existing folder this process may not
    write to (the folders missing below it are made when the figures are saved)."""
    path = Path(out_dir)
    if os.path.lexists(path) and not path.is_dir():
        raise ValueError(f"out_dir {str(path)!r} is an existing file, not a folder: pass a folder for the figures")
    # lexists: a dangling link counts as in the way, since mkdir would fail on it too
    existing = next((p for p in (path, *path.parents) if os.path.lexists(p)), Path("."))
    if not existing.is_dir():
        raise ValueError(f"out_dir {str(path)!r} can't be made: {str(existing)!r} is an existing file, "
                         "not a folder: pass a folder for the figures")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"out_dir {str(path)!r} can't be written: this process may not write in the folder "
                         f"{str(existing)!r}")


def _check_single_args(steps, width, layers) -> None:
    check_whole("steps", steps, 1)
    check_width("width", width, SINGLE_HEADS)
    check_whole("layers", layers, 1)


def _check_workers_args(nprocs, device) -> None:
    check_whole("nprocs", nprocs, 1)
    if device is not None or nprocs > 1:  # $MUONLAB_DEVICE matters only if workers start
        requested_device(device)


def run_single(out_dir="runs/demo", *, steps: int = 150, width: int = 128, layers: int = 2) -> dict:
    """Muon vs AdamW on the small GPT in this process: print a table, write loss_curves.png; return
    the histories."""
    check_out_dir(out_dir)
    _check_single_args(steps, width, layers)
    from matplotlib.figure import Figure

    from .models import GPTConfig
    from .train import compare_optimizers, default_device
    from .viz import plot_loss_curves

    cfg = GPTConfig(d_model=width, n_layers=layers, n_heads=SINGLE_HEADS, context=64)
    hist = compare_optimizers(
        cfg, steps=steps, batch_size=16, eval_every=max(1, steps // 5),
        progress=sys.stderr.isatty(),
        optimizer_kwargs={"muon": {"lr": 0.02, "adamw_lr": 3e-3}, "adamw": {"lr": 3e-3}},
    )
    print(f"\nsmall GPT (width {width}, {layers} layers), {steps} steps on {default_device().type.upper()}")
    print(f"{'optimizer':<10}{'train loss':>12}{'val loss':>10}{'tokens/s':>11}{'opt step ms':>13}")
    for name, h in hist.items():
        s = h.summary()
        print(f"{name:<10}{s['final_train_loss']:>12.3f}{s['final_val_loss']:>10.3f}"
              f"{s['tokens_per_s']:>11.0f}{s['opt_step_ms']:>13.2f}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(6, 3.5))
    plot_loss_curves(hist, ax=fig.add_subplot(), title="Muon vs AdamW, small GPT")
    fig.tight_layout()
    fig.savefig(out / "loss_curves.png", dpi=120)
    print(f"wrote {out / 'loss_curves.png'}")
    return hist


def run_distributed(out_dir="runs/demo", steps: int = 5, nprocs: int = 4, mode: str = "fsdp",
                    timeout_s: float = 300, device: str | None = None) -> dict:
    """Train, print the plan and bytes per path, write timeline.png and trace.json; return the results.

    ``device`` goes to :func:`muonlab.launch` (None: GPUs when there is one per worker).
    The arguments are checked before any worker starts (a ValueError naming the one at fault)."""
    from matplotlib.figure import Figure

    from .viz.timeline import plot_timeline

    check_out_dir(out_dir)
    check_whole("steps", steps, 1)  # the summary below reads the first and last step's loss
    _check_workers_args(nprocs, device)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES} (the modes train_worker runs), got {mode!r}")
    if mode == "ep" and nprocs % DEMO_EP:
        raise ValueError(f"nprocs must be a multiple of {DEMO_EP} in mode 'ep' (its workers run {DEMO_EP} "
                         f"expert-parallel ranks), got {nprocs}")
    t0 = time.time()
    results = launch(train_worker, nprocs, mode=mode, steps=steps, timeout_s=timeout_s, device=device,
                     name=f"demo-{mode}", progress=sys.stderr.isatty(), **DEMO_MODEL,
                     **(dict(ep=DEMO_EP) if mode == "ep" else {}))
    first = results[0]
    where = "GPU" if first["device"].startswith("cuda") else "CPU"
    print(f"\n{mode} on {nprocs} {where} workers, small GPT (width {DEMO_MODEL['d_model']}, "
          f"{DEMO_MODEL['n_layers']} layers), {steps} steps in {time.time() - t0:.1f} s (start-up included); "
          f"mean loss {first['mean_losses'][0]:.3f} -> {first['mean_losses'][-1]:.3f}")
    print("\nMuon plan (same on every rank):")
    print(first["plan_table"])
    print("\nbytes sent per path in the last step (counted at the collectives | planned):")
    for rank, res in results.items():
        counted, planned = res["stats"]["bytes_sent"], res["plan_bytes_sent"]
        paths = sorted(set(counted) | set(planned))
        cells = "  ".join(f"{p} {counted.get(p, 0):>8} | {planned.get(p, 0):>8}" for p in paths)
        print(f"  rank {rank}: {cells}")

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    spans = [Span(**row) for row in first["spans"]]
    fig = Figure(figsize=(11, 1.0 + 1.1 * nprocs))
    plot_timeline(spans, ax=fig.add_subplot(), title=f"{mode}, {nprocs} ranks: last optimizer step")
    fig.tight_layout()
    fig.savefig(out / "timeline.png", dpi=120)
    write_chrome_trace(spans, out / "trace.json")
    print(f"wrote {out / 'timeline.png'} and {out / 'trace.json'} (open the JSON in https://ui.perfetto.dev)")
    return results
