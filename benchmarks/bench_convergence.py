"""Steps to a target loss: Muon vs AdamW on the small GPT, each at its best lr from a short sweep.

Every run starts from the same initial weights (seed) and sees the same batches; validation loss is
evaluated every ``--eval-every`` steps on the same fixed held-out windows. Learning rates are
constant (no warm-up, no decay), so a curve's value at step s is what a run with a budget of s
steps would end at, and "steps to reach a loss" can be read off one curve.

With a constant lr the validation loss fluctuates from evaluation to evaluation (by about 0.1-0.2
nats at this size, partly in step across optimizers because they see the same batches). So every
curve is smoothed with a trailing mean over ``--window`` evaluations before anything is read off it:

* best lr: the lowest smoothed final value in the sweep (seed ``--seed``);
* the best lrs are rerun with the ``--confirm-seeds`` and curves are averaged over seeds;
* target: AdamW's smoothed final value; steps to target: the step from which a smoothed curve stays
  at or below it (linear interpolation between evaluations); ratio = Muon's steps / AdamW's.

    python benchmarks/bench_convergence.py            # the sweep behind results/convergence.md
    python benchmarks/bench_convergence.py --steps 20 --eval-every 10 --eval-batches 2 --confirm-seeds "" --out /tmp/c.md
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from muonlab.models import GPT, GPTConfig
from muonlab.train import History, make_optimizer, train
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import load  # noqa: E402
from _report import md_table, results_path, text_table, write_report  # noqa: E402


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean over ``window`` points (shorter at the start)."""
    return [sum(values[max(0, i - window + 1): i + 1]) / (i + 1 - max(0, i - window + 1))
            for i in range(len(values))]


def steps_to_reach(steps: list[int], losses: list[float], target: float) -> float | None:
    """Step from which the curve stays at or below ``target`` (linear between evaluations).

    "Stays" rather than "first touches": a transient dip below the target is not reaching it.
    """
    if not losses or losses[-1] > target:
        return None
    above = [i for i, loss in enumerate(losses) if loss > target]
    if not above:
        return float(steps[0])
    i = above[-1]  # the last evaluation above the target; the next one is at or below it
    s0, l0, s1, l1 = steps[i], losses[i], steps[i + 1], losses[i + 1]
    return s0 + (l0 - target) / (l0 - l1) * (s1 - s0)


def run_one(cfg: GPTConfig, name: str, lr: float, args, seed: int) -> tuple[History, float]:
    torch.manual_seed(seed)
    model = GPT(cfg)
    if name == "muon":
        opt = make_optimizer("muon", model, lr=lr, adamw_lr=args.muon_adamw_lr, ns_form=args.muon_ns_form)
    else:
        opt = make_optimizer("adamw", model, lr=lr)
    t0 = time.perf_counter()
    hist = train(model, opt, steps=args.steps, batch_size=args.batch_size, eval_every=args.eval_every,
                 eval_batches=args.eval_batches, seed=seed, progress=False, device="cpu")
    return hist, time.perf_counter() - t0


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-batches", type=int, default=32)
    p.add_argument("--window", type=int, default=3, help="trailing mean over this many evaluations")
    p.add_argument("--muon-lrs", default="0.01,0.02,0.04")
    p.add_argument("--muon-adamw-lr", type=float, default=3e-3,
                   help="AdamW lr for the parameters Muon does not take (embeddings, head, norms)")
    p.add_argument("--adamw-lrs", default="1e-3,3e-3,6e-3,1.2e-2")
    p.add_argument("--muon-ns-form", default="auto", help="Muon's ns_form (e.g. gram, to compare with plain)")
    p.add_argument("--seed", type=int, default=0, help="seed of the lr sweep")
    p.add_argument("--confirm-seeds", default="1,2", help="rerun both best lrs with these seeds")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(results_path("convergence")))
    p.add_argument("--plot", default="", help="also save the validation curves to this PNG")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    cfg = GPTConfig(d_model=args.d_model, n_layers=args.n_layers, n_heads=4, context=args.context)
    sweep = [("muon", float(v)) for v in args.muon_lrs.split(",")] + \
            [("adamw", float(v)) for v in args.adamw_lrs.split(",")]
    confirm = [int(v) for v in args.confirm_seeds.split(",") if v.strip() and int(v) != args.seed]
    load_start, t_start = load(), time.perf_counter()

    runs: dict[tuple[str, float, int], tuple[History, float]] = {}

    def do(name: str, lr: float, seed: int) -> None:
        h, wall = runs[(name, lr, seed)] = run_one(cfg, name, lr, args, seed)
        print(f"{name:<6} lr {lr:<7g} seed {seed}: final val {h.val_loss[-1]:.4f}, smoothed "
              f"{smooth(h.val_loss, args.window)[-1]:.4f}  ({wall:.0f} s)", flush=True)

    for name, lr in sweep:
        do(name, lr, args.seed)
    best = {}
    for name in ("muon", "adamw"):
        cands = [lr for (n, lr, s) in runs if n == name and s == args.seed]
        best[name] = min(cands, key=lambda lr: smooth(runs[(name, lr, args.seed)][0].val_loss, args.window)[-1])
    for seed in confirm:
        for name in ("muon", "adamw"):
            do(name, best[name], seed)
    total_s = time.perf_counter() - t_start
    load_end = load()

    # ---------------------------------------------------------------- steps to target
    seeds = [args.seed] + confirm
    val_steps = runs[("muon", best["muon"], args.seed)][0].val_steps

    def curve(name: str, seed: int | None) -> list[float]:
        """Smoothed validation curve of the best lr; seed None: the mean over all seeds first."""
        if seed is None:
            per_seed = [runs[(name, best[name], s)][0].val_loss for s in seeds]
            raw = [sum(v) / len(v) for v in zip(*per_seed)]
        else:
            raw = runs[(name, best[name], seed)][0].val_loss
        return smooth(raw, args.window)

    results = []
    for seed in ([None] if len(seeds) > 1 else []) + seeds:
        muon_c, adamw_c = curve("muon", seed), curve("adamw", seed)
        target = adamw_c[-1]
        muon_steps = steps_to_reach(val_steps, muon_c, target)
        adamw_steps = steps_to_reach(val_steps, adamw_c, target)
        results.append(dict(
            seed="mean of " + ",".join(map(str, seeds)) if seed is None else str(seed),
            target=target, muon_final=muon_c[-1], muon_steps=muon_steps, adamw_steps=adamw_steps,
            ratio_crossing=None if muon_steps is None else muon_steps / adamw_steps,
            ratio_budget=None if muon_steps is None else muon_steps / args.steps))

    # ---------------------------------------------------------------- tables
    checkpoints = sorted({s for s in (args.steps // 6, args.steps // 3, args.steps // 2,
                                      2 * args.steps // 3, args.steps) if s > 0 and s in val_steps})
    head = ["optimizer", "lr", "seed"] + [f"val@{s}" for s in checkpoints] + \
           [f"smoothed final (last {args.window})", "ms/step"]
    rows = []
    for (name, lr, seed), (h, wall) in runs.items():
        at = dict(zip(h.val_steps, h.val_loss))
        step_ms = 1e3 * sorted(h.step_time_s)[len(h.step_time_s) // 2]
        mark = " (best)" if lr == best[name] else ""
        rows.append([name, f"{lr:g}{mark}", str(seed)] + [f"{at[s]:.3f}" for s in checkpoints]
                    + [f"{smooth(h.val_loss, args.window)[-1]:.3f}", f"{step_ms:.0f}"])
    ratio_head = ["seed(s)", "target: AdamW smoothed final", "Muon smoothed final",
                  "Muon steps to target", "AdamW steps to target", "ratio Muon/AdamW",
                  f"Muon steps / budget ({args.steps})"]

    def fmt(v, spec):
        return "not reached" if v is None else format(v, spec)

    ratio_txt = [[r["seed"], f"{r['target']:.3f}", f"{r['muon_final']:.3f}", fmt(r["muon_steps"], ".0f"),
                  fmt(r["adamw_steps"], ".0f"), fmt(r["ratio_crossing"], ".2f"), fmt(r["ratio_budget"], ".2f")]
                 for r in results]

    print()
    print(text_table(head, rows))
    print()
    print(text_table(ratio_head, ratio_txt))

    n_tokens = args.eval_batches * args.batch_size * args.context
    headline = results[0]
    conditions = f"""Shared with other jobs while this ran (load average {load_start} at the
start, {load_end} at the end, on 2 cores); this benchmark counts steps, not seconds, so the load
only changes the ms/step column. Total wall time {total_s / 60:.1f} min."""
    md = f"""**Result: Muon (lr {best['muon']:g}) reaches AdamW's (lr {best['adamw']:g}) final validation loss in
{fmt(headline['ratio_crossing'], '.2f')} of AdamW's steps** ({headline['seed']}; per seed below). Goal in the issue: <= 0.7.

Setup: `GPT(GPTConfig(d_model={args.d_model}, n_layers={args.n_layers}, n_heads=4, context={args.context}))`,
byte-level corpus (the Python standard library's source, `muonlab.data`), batch {args.batch_size} x
{args.context} tokens, {args.steps} steps at constant lr; for a given seed the initial weights and the
batches are identical across optimizers. Validation loss every {args.eval_every} steps on the same
{args.eval_batches} fixed held-out batches ({n_tokens} tokens). Muon: `muonlab.Muon` with its defaults
(momentum 0.95 Nesterov, 5 Newton-Schulz steps with Keller's coefficients in bf16, `ns_form="{args.muon_ns_form}"`,
lr scaled by sqrt(max(1, rows/cols))) on the hidden matrices, AdamW lr {args.muon_adamw_lr:g} betas (0.9, 0.95) on
embeddings, head and norms. AdamW: `torch.optim.AdamW`, betas (0.9, 0.95), no weight decay, on
everything. Sweep: Muon lr in {{{args.muon_lrs}}}, AdamW lr in {{{args.adamw_lrs}}}, seed {args.seed}; the best
of each (lowest smoothed final value) rerun with seeds {", ".join(map(str, confirm)) or "(none)"}.

## Steps to target

{md_table(ratio_head, ratio_txt)}

Curves are smoothed with a trailing mean over {args.window} evaluations ({args.window * args.eval_every} steps)
before reading them: with a constant lr the validation loss moves by 0.1-0.2 nats between
evaluations, enough to move a single-point target by tens of steps. "Steps to target" is the step
from which a smoothed curve stays at or below the target (linear interpolation between
evaluations); AdamW's own crossing can be earlier than the budget. The first row averages the
seeds' curves before smoothing.

## Sweep and reruns (validation loss, nats/byte)

{md_table(head, rows)}

ms/step is the median wall time of a training step (forward, backward, optimizer) on this shared
machine with {args.threads} torch thread(s); it is not a speed benchmark (see optimizer_step.md).
"""
    print()
    write_report(args.out, "Convergence: Muon vs AdamW, steps to AdamW's final validation loss", md,
                 script=__file__, argv=argv, machine_note=conditions)

    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for (name, lr, seed), (h, _) in runs.items():
            ax.plot(h.val_steps, smooth(h.val_loss, args.window), "-" if name == "muon" else "--",
                    label=f"{name} lr={lr:g} seed={seed}")
        ax.axhline(headline["target"], color="k", lw=0.8)
        ax.set_xlabel("step")
        ax.set_ylabel(f"val loss, trailing mean of {args.window}")
        ax.set_ylim(top=min(4.0, ax.get_ylim()[1]))
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=100)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
