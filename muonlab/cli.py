"""Command line: ``python -m muonlab.cli demo`` (what ``make demo`` runs)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def demo(args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .models import GPTConfig
    from .train import compare_optimizers
    from .viz import plot_loss_curves

    cfg = GPTConfig(d_model=args.width, n_layers=args.layers, n_heads=4, context=64)
    hist = compare_optimizers(
        cfg, steps=args.steps, batch_size=16, eval_every=max(1, args.steps // 5),
        progress=sys.stderr.isatty(),
        optimizer_kwargs={"muon": {"lr": 0.02, "adamw_lr": 3e-3}, "adamw": {"lr": 3e-3}},
    )
    print(f"\nsmall GPT (width {args.width}, {args.layers} layers), {args.steps} steps on CPU")
    print(f"{'optimizer':<10}{'train loss':>12}{'val loss':>10}{'tokens/s':>11}{'opt step ms':>13}")
    for name, h in hist.items():
        s = h.summary()
        print(f"{name:<10}{s['final_train_loss']:>12.3f}{s['final_val_loss']:>10.3f}"
              f"{s['tokens_per_s']:>11.0f}{s['opt_step_ms']:>13.2f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot_loss_curves(hist, title="Muon vs AdamW, small GPT")
    plt.tight_layout()
    plt.savefig(out / "loss_curves.png", dpi=120)
    print(f"wrote {out / 'loss_curves.png'}")
    if args.nprocs > 1:
        from .demo_distributed import run as run_distributed

        run_distributed(out, nprocs=args.nprocs)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="muonlab")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="train the small GPT with Muon and AdamW, print a table, plot")
    d.add_argument("--steps", type=int, default=int(os.environ.get("MUONLAB_DEMO_STEPS", 150)))
    d.add_argument("--width", type=int, default=128)
    d.add_argument("--layers", type=int, default=2)
    d.add_argument("--out", default="runs/demo")
    d.add_argument("--nprocs", type=int, default=4, help="CPU workers for the FSDP2 part (1 skips it)")
    d.set_defaults(fn=demo)
    args = parser.parse_args(argv)
    args.fn(args)


if __name__ == "__main__":
    main()
