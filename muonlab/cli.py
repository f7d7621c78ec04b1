"""Command line: ``python -m muonlab.cli demo`` (what ``make demo`` runs). Argument parsing only; the
demo itself is muonlab.demo."""

from __future__ import annotations

import argparse
import os


def demo(args) -> None:
    import matplotlib

    # A command line has no display to draw on; set before anything imports pyplot.
    matplotlib.use("Agg")
    from .demo import run

    run(args.out, steps=args.steps, width=args.width, layers=args.layers, nprocs=args.nprocs, device=args.device)


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1 (argparse names the option and the value on failure)."""
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="muonlab")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="train the small GPT with Muon and AdamW, print a table, plot")
    d.add_argument("--steps", type=positive_int, default=None, help="default: $MUONLAB_DEMO_STEPS, else 150")
    d.add_argument("--width", type=positive_int, default=128, help="a multiple of 4 (the demo's attention heads)")
    d.add_argument("--layers", type=positive_int, default=2)
    d.add_argument("--out", default="runs/demo")
    d.add_argument("--nprocs", type=positive_int, default=4,
                   help="workers for the FSDP2 part (1 skips it): one per GPU with enough GPUs, else CPU")
    d.add_argument("--device", default=None, choices=("auto", "cpu", "cuda"),
                   help="the workers' device (default: auto, or $MUONLAB_DEVICE)")
    d.set_defaults(fn=demo)
    args = parser.parse_args(argv)
    if args.command == "demo":
        # checked here, before minutes of training: each a usage error (exit 2), not a traceback
        if args.steps is None:
            env = os.environ.get("MUONLAB_DEMO_STEPS", "150")
            try:
                args.steps = positive_int(env)
            except ValueError:
                d.error(f"$MUONLAB_DEMO_STEPS must be a whole number >= 1, got {env!r}")
        from .distributed.device import requested_device
        from .demo import SINGLE_HEADS, check_out_dir
        from .models.gpt import check_width

        try:
            check_width("--width", args.width, SINGLE_HEADS)
            check_out_dir(args.out)
            if args.device is not None or args.nprocs > 1:  # as the demo: $MUONLAB_DEVICE matters only for workers
                requested_device(args.device)
        except ValueError as err:
            d.error(str(err))
    args.fn(args)


if __name__ == "__main__":
    main()
