"""Command line: ``python -m muonlab.cli demo`` (what ``make demo`` runs). Argument parsing only; the
demo itself is muonlab.experiments.demo."""

from __future__ import annotations

import argparse
import os


def demo(args) -> None:
    import matplotlib

    # A command line has no display to draw on; set before anything imports pyplot.
    matplotlib.use("Agg")
    from .experiments.demo import run

    run(args.out, steps=args.steps, width=args.width, layers=args.layers, nprocs=args.nprocs, device=args.device)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="muonlab")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="train the small GPT with Muon and AdamW, print a table, plot")
    d.add_argument("--steps", type=int, default=int(os.environ.get("MUONLAB_DEMO_STEPS", 150)))
    d.add_argument("--width", type=int, default=128)
    d.add_argument("--layers", type=int, default=2)
    d.add_argument("--out", default="runs/demo")
    d.add_argument("--nprocs", type=int, default=4,
                   help="workers for the FSDP2 part (1 skips it): one per GPU with enough GPUs, else CPU")
    d.add_argument("--device", default=None, choices=("auto", "cpu", "cuda"),
                   help="the workers' device (default: auto, or $MUONLAB_DEVICE)")
    d.set_defaults(fn=demo)
    args = parser.parse_args(argv)
    args.fn(args)


if __name__ == "__main__":
    main()
