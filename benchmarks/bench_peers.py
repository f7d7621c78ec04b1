"""muonlab's distributed Muon against Dion's (microsoft/dion) and XTuner's FSDP2 Muon, side by side.

    .venv/bin/python benchmarks/bench_peers.py [--world 2 4] [--rounds 20] [--warmup 3] [--kinds K ...]

``--kinds`` runs a subset (muonlab is always in: the ratios are to it). With muonlab's variants
alone (``--kinds muonlab muonlab-again muonlab-ignore``) the rounds are short, so many of them fit
the time of a full run: the A/B of the safety check's cost, written to results/peers_check.md.

The peers are never vendored: they are copied at a pinned commit into benchmarks/_peers/
(gitignored) from a git mirror of each repository, by this script when the folder lacks them
(--mirrors, default /work/.mirror, holding OWNER+NAME/repo git directories), or by hand:

    mkdir -p benchmarks/_peers/xtuner_muon && \\
    git --git-dir=MIRRORS/microsoft+dion/repo archive 0a059a4542e5aa74b40dcd1dce363836c7afcd48 dion \\
        | tar -x -C benchmarks/_peers && \\
    for f in muon.py newton_schulz_triton.py; do git --git-dir=MIRRORS/InternLM+xtuner/repo show \\
        3b6701a1d9dec1e3ab619d82b6edc1518b8d82ff:xtuner/v1/optim/$f > benchmarks/_peers/xtuner_muon/$f; done && \\
    touch benchmarks/_peers/xtuner_muon/__init__.py

A peer that is absent is skipped with a line saying so.

Parameters: the 32 hidden matrices of an 8-layer width-256 GPT plus 4 one-of-a-kind shapes (36),
FSDP2-style Shard(0) DTensors on a 1-D gloo mesh, one copy per optimizer, the same grads. All
optimizers run in ONE process group, in alternating rounds (each round steps every optimizer once,
in balanced orders: each optimizer follows every other equally often), barrier to barrier; per
round, each optimizer's time is divided by muonlab's (safety check on) and the table gives the
median of these per-round ratios. Bytes are counted at the collectives during one step (peers:
torch.distributed wrapped; muonlab: its own last_step_stats()), summed over ranks, own chunks
excluded; the lower bound is the sum over matrices of 2 (W-1)/W of the matrix bytes in bf16
(gathered once to one rank and scattered back once).
Agreement: max over matrices of the relative Frobenius error of the whole-matrix update
after two steps from the same start, against torch.optim.Muon on full matrices.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _peers_workers import PEERS_DIR, lower_bound_bytes, matrix_shapes, peers_worker  # noqa: E402
from _machine import load  # noqa: E402
from _report import md_table, results_path, write_report  # noqa: E402

from muonlab.distributed import launch  # noqa: E402

DION = dict(repo="microsoft/dion", commit="0a059a4542e5aa74b40dcd1dce363836c7afcd48")
XTUNER = dict(repo="InternLM/xtuner", commit="3b6701a1d9dec1e3ab619d82b6edc1518b8d82ff",
              files=("xtuner/v1/optim/muon.py", "xtuner/v1/optim/newton_schulz_triton.py"))
KINDS = ["muonlab", "muonlab-again", "muonlab-ignore", "dion", "xtuner"]


def _git_dir(mirrors: Path, repo: str) -> Path:
    return mirrors / repo.replace("/", "+") / "repo"


def fetch_peers(mirrors: Path) -> dict[str, str]:
    """Copy each absent peer from its mirror; returns peer -> why it is missing ('' when present)."""
    missing = {}
    PEERS_DIR.mkdir(exist_ok=True)
    dion_dir = PEERS_DIR / "dion"
    if not (dion_dir / "muon.py").exists():
        git_dir = _git_dir(mirrors, DION["repo"])
        if git_dir.exists():
            archive = subprocess.run(["git", f"--git-dir={git_dir}", "archive", DION["commit"], "dion"],
                                     check=True, capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", str(PEERS_DIR)], input=archive, check=True)
    missing["dion"] = ("" if (dion_dir / "muon.py").exists()
                       else f"no benchmarks/_peers/dion and no mirror {_git_dir(mirrors, DION['repo'])}")
    xt_dir = PEERS_DIR / "xtuner_muon"
    if not (xt_dir / "muon.py").exists():
        git_dir = _git_dir(mirrors, XTUNER["repo"])
        if git_dir.exists():
            xt_dir.mkdir(exist_ok=True)
            for path in XTUNER["files"]:
                text = subprocess.run(["git", f"--git-dir={git_dir}", "show", f"{XTUNER['commit']}:{path}"],
                                      check=True, capture_output=True).stdout
                (xt_dir / Path(path).name).write_bytes(text)
            (xt_dir / "__init__.py").write_text("")
    missing["xtuner"] = ("" if (xt_dir / "muon.py").exists()
                         else f"no benchmarks/_peers/xtuner_muon and no mirror {_git_dir(mirrors, XTUNER['repo'])}")
    return missing


def median_interval(values: list[float], level: float = 0.95, resamples: int = 2000, seed: int = 0):
    """A percentile-bootstrap interval for the median of ``values`` (resampled with replacement):
    how far this run's median ratio could move with other rounds of the same noise."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return medians[int((1 - level) / 2 * resamples)], medians[int((1 + level) / 2 * resamples) - 1]


def summarize(res: dict, world: int) -> tuple[list, list, dict]:
    """Rows of the time table and the bytes table from the ranks' results."""
    r0 = res[0]
    kinds = r0["kinds"]
    # a step's time: the slowest rank's, per round (barrier to barrier they are nearly equal)
    per_round = {k: [max(res[r]["times"][k][i] for r in res) for i in range(len(r0["times"][k]))] for k in kinds}
    base = per_round["muonlab"]
    bound = lower_bound_bytes(world)
    time_rows, byte_rows = [], []
    for k in kinds:
        ratios = [t / b for t, b in zip(per_round[k], base)]
        low, high = median_interval(ratios)
        time_rows.append([k, f"{1e3 * statistics.median(per_round[k]):.1f}", f"{statistics.median(ratios):.3f}",
                          f"{low:.3f}-{high:.3f}", f"{min(ratios):.2f}-{max(ratios):.2f}",
                          f"{r0['agreement'][k]:.2e}"])
        sent = sum(res[r]["bytes"][k]["sent"] for r in res)
        recv = sum(res[r]["bytes"][k]["recv"] for r in res)
        calls = res[0]["bytes"][k]["calls"]
        byte_rows.append([k, f"{sent:,}", f"{recv:,}", calls, f"{bound:,.0f}", f"{sent / bound:.3f}"])
    check = {key: max(res[r][key] for r in res) for key in ("start_s", "wait_s", "before_s")}
    if {"muonlab-again", "muonlab-ignore"} <= set(kinds):
        # the check off against BOTH check-on copies, per round: the two copies are equally valid
        # samples of the same step, so their mean halves the check-on side's noise in the ratio
        both = [i / ((a + b) / 2) for i, a, b in zip(per_round["muonlab-ignore"], base, per_round["muonlab-again"])]
        check["off_vs_both"] = (statistics.median(both), *median_interval(both))
    return time_rows, byte_rows, r0["phases"], dict(check, step_s=statistics.median(base), plan=r0["plan"])


def peers_paragraphs() -> list[str]:
    """The peers' versions and the settings matched with them (a run with peers only)."""
    return [
        f"Peers (eager: TORCHDYNAMO_DISABLE=1; their math is torch.compile-decorated): Dion "
        f"`{DION['repo']}@{DION['commit'][:12]}` (dion/muon.py, megabatched all_to_all), XTuner "
        f"`{XTUNER['repo']}@{XTUNER['commit'][:12]}` (xtuner/v1/optim/muon.py, batches of W same-shape "
        "matrices padded with zero matrices, all_to_all_single; the self-contained FSDP2 file of March 2026 "
        "- newer versions import xtuner.v1.utils and were not run).",
        "Settings matched: lr 0.02, momentum 0.95, Nesterov, 5 Newton-Schulz steps with Keller's coefficients "
        "(3.4445, -4.7750, 2.0315) in bf16 (the peers get the same `newton_schulz_func`; Dion's default is "
        "Polar Express, turned off), bf16 on the wire, eps 1e-7, no weight decay, lr scaled by 0.2 sqrt(max(A, B)) "
        "for every optimizer (muonlab and torch `match_rms_adamw`, the peers' `rms_norm`). What differs: the peers "
        "keep momentum in the sum form (M = 0.95 M + G) where muonlab and torch.optim.Muon keep the EMA "
        "(M = 0.95 M + 0.05 G); Newton-Schulz normalizes its input, so the updates differ only through eps "
        "and bf16 rounding. XTuner asserts that the sharded dimension divides by W, so every shape here has "
        "rows divisible by 4 (no uneven Shard(0) shards in this set).",
    ]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--mirrors", default="/work/.mirror")
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=KINDS,
                    help="the optimizers to run (muonlab is always in: the ratios are to it)")
    args = ap.parse_args(argv)
    wanted = ["muonlab"] + [k for k in KINDS if k in args.kinds and k != "muonlab"]
    peers_wanted = [k for k in ("dion", "xtuner") if k in wanted]
    missing = fetch_peers(Path(args.mirrors)) if peers_wanted else {}
    for peer, why in missing.items():
        if why:
            print(f"skipping {peer}: {why}")
    kinds = [k for k in wanted if not missing.get(k)]
    os.environ["TORCHDYNAMO_DISABLE"] = "1"  # the peers' torch.compile decorators: eager, like muonlab
    sections = []
    load_before = load()
    for world in args.world:
        res = launch(peers_worker, world, kinds, args.rounds, args.warmup, timeout_s=900)
        time_rows, byte_rows, phases, check = summarize(res, world)
        phase_rows = [[k, *(f"{1e3 * v:.2f}" for v in p.values())] for k, p in phases.items()]
        phase_header = ["optimizer", *(f"{name} ms" for name in next(iter(phases.values())))]
        text = "\n".join([
            f"## W = {world}",
            "",
            md_table(["optimizer", "median step ms", "time / muonlab (median of rounds)",
                      "95% interval of that median (bootstrap)", "range of rounds",
                      "max rel. error vs torch.optim.Muon"], time_rows),
            "",
            md_table(["optimizer", "bytes sent (all ranks)", "bytes received", "calls (rank 0)",
                      "lower bound", "bytes / bound"], byte_rows),
            "",
            "muonlab's time per phase (rank 0, median over rounds; from last_step_stats()['seconds']):",
            "",
            md_table(phase_header, phase_rows),
            "",
            "The safety check inside muonlab's steps (last_step_stats()['nonfinite_seconds'], host clock; "
            "per-rank medians over the rounds, the largest rank's; % of muonlab's median step): "
            "start() (fused check, the flags' exchange launched: one all_to_all_single on gloo; behind the "
            "first two batches' way out) "
            f"{1e3 * check['start_s']:.2f} ms ({100 * check['start_s'] / check['step_s']:.1f}%); the wait for "
            f"the flags at the commit point (after batch 0's Newton-Schulz; the flags travel behind "
            f"those two batches' way out) {1e3 * check['wait_s']:.2f} ms "
            f"({100 * check['wait_s'] / check['step_s']:.1f}%); the check it replaced, alone (an isfinite per "
            f"grad, then a blocking all-reduce) {1e3 * check['before_s']:.2f} ms "
            f"({100 * check['before_s'] / check['step_s']:.1f}%).",
            *([] if "off_vs_both" not in check else [
                "",
                "muonlab-ignore against both check-on copies (per round, its time over the mean of muonlab's and "
                "muonlab-again's; median and its 95% bootstrap interval): "
                "{:.3f} ({:.3f}-{:.3f}).".format(*check["off_vs_both"])]),
            "",
            f"muonlab's plan (batches per path): {check['plan']}.",
        ])
        print(text)
        sections.append(text)
    skipped = [f"{p} skipped: {why}." for p, why in missing.items() if why]
    n = len(matrix_shapes())
    body = "\n\n".join([
        f"Parameters: {n} matrices (the 32 hidden matrices of an 8-layer width-256 GPT and 4 one-of-a-kind "
        "shapes: 512x192, 192x512, 320x256, 256x96), FSDP2-style Shard(0) DTensors on a 1-D gloo mesh. "
        f"{args.rounds} alternating rounds after {args.warmup} warm-up rounds, one process group; a "
        "round steps every optimizer once, in balanced orders (a Williams design: each optimizer directly follows "
        "every other equally often), barrier to barrier, the slowest rank's time.",
        *(peers_paragraphs() if peers_wanted else []),
        *sections,
        "'time / muonlab' > 1: slower than muonlab with its non-finite check on (goal: >= 1.1 for both peers). "
        "muonlab-ignore is muonlab with nonfinite=\"ignore\": its ratio is the safety check's cost (goal: >= 0.98). "
        "muonlab-again is a second muonlab, identical to the first (check on): its ratio, 1 in a perfect measurement, "
        "is this run's noise floor for such an A/B. "
        "bytes / bound: goal <= 1.005 for muonlab.",
        *skipped,
    ])
    title = "muonlab vs Dion and XTuner distributed Muon (FSDP2, gloo)"
    if not peers_wanted:  # muonlab's variants alone: the safety check's A/B
        title = "muonlab's safety check: its cost in an A/B of muonlab's variants (FSDP2, gloo)"
    write_report(results_path("peers" if peers_wanted else "peers_check"), title, body,
                 script=__file__, argv=argv,
                 machine_note=f"Gloo, W ranks of 1 thread each sharing {os.cpu_count()} cores. Load average "
                              f"{load_before} before, {load()} after (other work shares this machine).")


if __name__ == "__main__":
    main()
