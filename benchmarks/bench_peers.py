"""muonlab's distributed Muon against Dion's (microsoft/dion) and XTuner's FSDP2 Muon, side by side.

    .venv/bin/python benchmarks/bench_peers.py [--sets gpt small48] [--world 2 4] [--rounds 20]
        [--small-rounds 400] [--warmup 3] [--kinds K ...] [--out PATH] [--fetch-only]

Two sets (``--sets``, both by default): "gpt", compute-bound (below), and "small48", host-bound: the
48 hidden matrices of ``GPT(GPTConfig(d_model=8, n_layers=12, n_heads=2))`` (benchmarks/_sets.py),
where a step is nearly all fixed host cost (``--small-rounds`` of them, they are short). For every
optimizer, one untimed step after the warm-up counts its collectives: bytes, torch.distributed
calls, and the gloo process group's operations (torch.profiler's ``gloo:<op>`` events, rank 0).

``--replicas`` runs each set a second time with muonlab's kinds on plain tensors, equal on every
rank (DDP replicas: equal weights, bit-identical gradients, one owner rank per matrix), where each
step's control exchange carries a fingerprint of the replicas' gradients; that fingerprint is also
timed alone.

``--kinds`` runs a subset (muonlab is always in: the ratios are to it); ``muonlab-normuon`` and
``dion-normuon`` (NorMuon, on request only) write results/peers_normuon.md. With muonlab's variants
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

Parameters of "gpt": the 32 hidden matrices of an 8-layer width-256 GPT plus 4 one-of-a-kind shapes (36),
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
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _peers_workers import PEERS_DIR, SETS, lower_bound_bytes, matrix_shapes, peers_worker  # noqa: E402
from _machine import load  # noqa: E402
from _report import md_table, results_path, write_report  # noqa: E402
from _rounds import median_interval  # noqa: E402

from muonlab.launcher import launch  # noqa: E402

DION = dict(repo="microsoft/dion", commit="0a059a4542e5aa74b40dcd1dce363836c7afcd48")
XTUNER = dict(repo="InternLM/xtuner", commit="3b6701a1d9dec1e3ab619d82b6edc1518b8d82ff",
              files=("xtuner/v1/optim/muon.py", "xtuner/v1/optim/newton_schulz_triton.py"))
KINDS = ["muonlab", "muonlab-again", "muonlab-ignore", "dion", "xtuner"]
NORMUON_KINDS = ["muonlab-normuon", "dion-normuon"]
OPTIONAL_KINDS = NORMUON_KINDS + ["muonlab-device"]
"""Run on request only; muonlab-device: the non-finite skip decided on the device (nonfinite_decision="device")."""
"""NorMuon (update_rule="normuon"; Dion's NorMuon class), on request (``--kinds``): not in the default run."""


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


def summarize(res: dict, world: int, set_name: str) -> tuple[list, list, dict, dict]:
    """Rows of the time table and the bytes table from the ranks' results, muonlab's phases, and
    the figures the text and the goals use."""
    r0 = res[0]
    kinds = r0["kinds"]
    # a step's time: the slowest rank's, per round (barrier to barrier they are nearly equal)
    per_round = {k: [max(res[r]["times"][k][i] for r in res) for i in range(len(r0["times"][k]))] for k in kinds}
    base = per_round["muonlab"]
    bound = lower_bound_bytes(world, set_name)
    time_rows, byte_rows, ratio = [], [], {}
    for k in kinds:
        ratios = [t / b for t, b in zip(per_round[k], base)]
        low, high = median_interval(ratios)
        ratio[k] = (statistics.median(ratios), low, high)
        time_rows.append([k, f"{1e3 * statistics.median(per_round[k]):.2f}", f"{statistics.median(ratios):.3f}",
                          f"{low:.3f}-{high:.3f}", f"{min(ratios):.2f}-{max(ratios):.2f}",
                          f"{r0['agreement'][k]:.2e}"])
        sent = sum(res[r]["bytes"][k]["sent"] for r in res)
        recv = sum(res[r]["bytes"][k]["recv"] for r in res)
        ops = r0["ops"][k]
        ops_txt = ", ".join(f"{name} {n}" for name, n in sorted(ops.items(), key=lambda kv: -kv[1]))
        byte_rows.append([k, f"{sent:,}", f"{recv:,}", f"{bound:,.0f}", f"{sent / bound:.3f}",
                          r0["bytes"][k]["calls"], sum(ops.values()), ops_txt or "none"])
    check = {key: max(res[r].get(key, math.nan) for r in res) for key in ("start_s", "wait_s", "before_s",
                                                                           "fingerprint_s")}
    if {"muonlab-again", "muonlab-ignore"} <= set(kinds):
        # the check off against BOTH check-on copies, per round: the two copies are equally valid
        # samples of the same step, so their mean halves the check-on side's noise in the ratio
        both = [i / ((a + b) / 2) for i, a, b in zip(per_round["muonlab-ignore"], base, per_round["muonlab-again"])]
        check["off_vs_both"] = (statistics.median(both), *median_interval(both))
    return time_rows, byte_rows, r0["phases"], dict(check, step_s=statistics.median(base), plan=r0["plan"],
                                                     ratio=ratio)


def _pct(seconds: float, step_s: float) -> str:
    return "n/a" if math.isnan(seconds) else f"{1e3 * seconds:.2f} ms ({100 * seconds / step_s:.1f}%)"


def world_section(set_name: str, world: int, res: dict, replicas: bool = False) -> tuple[str, dict]:
    """One (set, W) section of the results and its figures (``replicas``: the plain-tensor run)."""
    time_rows, byte_rows, phases, check = summarize(res, world, set_name)
    phase_rows = [[k, *(f"{1e3 * v:.2f}" for v in p.values())] for k, p in phases.items()]
    lines = [
        f"### {set_name}{' (replicas)' if replicas else ''}, W = {world}",
        "",
        md_table(["optimizer", "median step ms", "time / muonlab (median of rounds)",
                  "95% interval of that median (bootstrap)", "range of rounds",
                  "max rel. error vs one process (NorMuon kinds: muonlab's NorMuon; else torch.optim.Muon)"],
                 time_rows),
        "",
        md_table(["optimizer", "bytes sent (all ranks)", "bytes received", "lower bound", "bytes / bound",
                  "torch.distributed calls (rank 0)", "process-group ops (rank 0)", "ops by kind"], byte_rows),
        "",
    ]
    if phase_rows:
        lines += ["muonlab's time per phase (rank 0, median over rounds; from last_step_stats()['seconds']):", "",
                  md_table(["optimizer", *(f"{name} ms" for name in next(iter(phases.values())))], phase_rows), ""]
    lines.append(
        "The safety check inside muonlab's steps (last_step_stats()['nonfinite_seconds'], host clock; per-rank "
        "medians over the rounds, the largest rank's; % of muonlab's median step): the check's pass ('check') "
        f"{_pct(check['start_s'], check['step_s'])}; the exchange that carries its flags with the ranks' "
        f"agreement digest ('wait') {_pct(check['wait_s'], check['step_s'])}; a check done the old way, alone "
        f"(an isfinite per grad, then a blocking all-reduce) {_pct(check['before_s'], check['step_s'])}.")
    if replicas:
        lines += ["", "The replicas' gradient fingerprint (muonlab.optim.replicas.fingerprints over every matrix's "
                  "gradient, read to the host; timed alone, per-rank medians, the largest rank's; it is part of "
                  f"'check' above): {_pct(check['fingerprint_s'], check['step_s'])} of this step. The bytes' lower "
                  "bound is the sharded layout's (replicas move each update from its owner)."]
    if "off_vs_both" in check:
        lines += ["", "muonlab-ignore against both check-on copies (per round, its time over the mean of muonlab's "
                  "and muonlab-again's; median and its 95% bootstrap interval): "
                  "{:.3f} ({:.3f}-{:.3f}).".format(*check["off_vs_both"])]
    lines += ["", f"muonlab's plan (batches per path): {check['plan']}."]
    return "\n".join(lines), check


def _interval(r) -> str:
    return f"{r[0]:.3f} ({r[1]:.3f}-{r[2]:.3f})"


def goal_lines(figures: dict) -> list[str]:
    """The team's goals, each with this run's figure (median of per-round ratios and its interval)."""
    out = []

    def verdict(r, at_least: float) -> str:  # r: (median, low, high) of a ratio that should be >= at_least
        return "met" if r[1] >= at_least else "missed" if r[2] < at_least else "not decided by this run (interval straddles it)"

    got = figures.get(("small48", 2))
    if got and "dion" in got["ratio"]:
        r = got["ratio"]["dion"]
        out.append(f"- small48, W = 2: Dion's step time at least 1.1x muonlab's: {_interval(r)}, {verdict(r, 1.1)}.")
    got = figures.get(("gpt", 2)) or figures.get(("gpt", min((w for s, w in figures if s == "gpt"), default=0)))
    if got:
        for peer in ("dion", "xtuner"):
            if peer in got["ratio"]:
                r = got["ratio"][peer]
                out.append(f"- gpt, W = {got['world']}: muonlab ahead of {peer} (time / muonlab > 1): "
                           f"{_interval(r)}, {verdict(r, 1.0)}.")
        if "off_vs_both" in got:
            r = got["off_vs_both"]
            out.append(f"- gpt, W = {got['world']}: the safety checks cost at most 2% of the step "
                       f"(muonlab-ignore / muonlab >= 0.98): {_interval(r)}, {verdict(r, 0.98)}.")
        elif "muonlab-ignore" in got["ratio"]:
            r = got["ratio"]["muonlab-ignore"]
            out.append(f"- gpt, W = {got['world']}: the safety checks cost at most 2% of the step "
                       f"(muonlab-ignore / muonlab >= 0.98): {_interval(r)}, {verdict(r, 0.98)}.")
    fp = figures.get(("gpt-replicas", 2))
    if fp and not math.isnan(fp["fingerprint_s"]):
        share = [f"{100 * fp['fingerprint_s'] / fp['step_s']:.2f}% of the replicas' step"]
        if ("gpt", 2) in figures:
            share.insert(0, f"{100 * fp['fingerprint_s'] / figures[('gpt', 2)]['step_s']:.2f}% of the FSDP2 step")
        worst = max(fp["fingerprint_s"] / fp["step_s"],
                    fp["fingerprint_s"] / figures[("gpt", 2)]["step_s"] if ("gpt", 2) in figures else 0)
        out.append(f"- gpt, W = 2: the replicas' per-step gradient fingerprint costs at most 1% of the step: "
                   f"{1e3 * fp['fingerprint_s']:.2f} ms, {', '.join(share)}, {'met' if worst <= 0.01 else 'missed'}.")
    return out


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


def set_paragraph(set_name: str, rounds: int, warmup: int, replicas: bool = False) -> str:
    n = len(matrix_shapes(set_name))
    what = ("the 32 hidden matrices of an 8-layer width-256 GPT and 4 one-of-a-kind shapes: 512x192, 192x512, "
            "320x256, 256x96; compute-bound" if set_name == "gpt" else
            "the 48 hidden matrices of `GPT(GPTConfig(d_model=8, n_layers=12, n_heads=2))`: 24x8, 8x8, 32x8, 8x32 "
            "per layer; host-bound: Newton-Schulz is tiny, so a step is nearly all fixed host cost")
    layout = ("FSDP2-style Shard(0) DTensors on a 1-D gloo mesh; with --replicas run again as plain tensors, "
              "equal on every rank (DDP replicas), muonlab's kinds only" if replicas else
              "FSDP2-style Shard(0) DTensors on a 1-D gloo mesh")
    return (f"Set {set_name}: {n} matrices ({what}), {layout}. "
            f"{rounds} alternating rounds after {warmup} warm-up rounds, one process group; a round steps every "
            "optimizer once, in balanced orders (a Williams design: each optimizer directly follows every other "
            "equally often), barrier to barrier, the slowest rank's time.")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--sets", nargs="+", choices=SETS, default=list(SETS))
    ap.add_argument("--world", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rounds", type=int, default=20, help="timed rounds of the gpt set")
    ap.add_argument("--small-rounds", type=int, default=400, help="timed rounds of the small48 set")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--mirrors", default="/work/.mirror")
    ap.add_argument("--kinds", nargs="+", choices=KINDS + OPTIONAL_KINDS, default=KINDS,
                    help="the optimizers to run (muonlab is always in: the ratios are to it)")
    ap.add_argument("--out", default=None, help="default: results/peers.md, peers_check.md without peers, "
                                                "peers_normuon.md with a NorMuon kind")
    ap.add_argument("--replicas", action="store_true",
                    help="run each set again with muonlab's kinds on plain tensors (DDP replicas)")
    ap.add_argument("--fetch-only", action="store_true",
                    help="copy the peers into benchmarks/_peers and stop (e.g. before carrying them to a GPU machine)")
    args = ap.parse_args(argv)
    if args.fetch_only:
        missing = fetch_peers(Path(args.mirrors))
        print("\n".join(f"{p}: {why or 'present'}" for p, why in missing.items()))
        return
    wanted = ["muonlab"] + [k for k in KINDS + OPTIONAL_KINDS if k in args.kinds and k != "muonlab"]
    peers_wanted = [k for k in ("dion", "xtuner") if any(w.split("-")[0] == k for w in wanted)]
    missing = fetch_peers(Path(args.mirrors)) if peers_wanted else {}
    for peer, why in missing.items():
        if why:
            print(f"skipping {peer}: {why}")
    kinds = [k for k in wanted if not missing.get(k.split("-")[0])]
    os.environ["TORCHDYNAMO_DISABLE"] = "1"  # the peers' torch.compile decorators: eager, like muonlab
    sets = [s for s in SETS if s in args.sets]
    paragraphs, sections, figures = [], [], {}
    load_before = load()
    for set_name in sets:
        rounds = args.rounds if set_name == "gpt" else args.small_rounds
        paragraphs.append(set_paragraph(set_name, rounds, args.warmup, args.replicas))
        sections.append(f"## Set {set_name}")
        for replicas in (False, True) if args.replicas else (False,):
            for world in args.world:
                res = launch(peers_worker, world, [k for k in kinds if k.startswith("muonlab") or not replicas],
                             rounds, args.warmup, set_name, replicas, timeout_s=900)
                text, check = world_section(set_name, world, res, replicas)
                figures[(set_name + ("-replicas" if replicas else ""), world)] = dict(check, world=world)
                print(text, flush=True)
                sections.append(text)
    skipped = [f"{p} skipped: {why}." for p, why in missing.items() if why]
    goals = goal_lines(figures)
    body = "\n\n".join([
        *paragraphs,
        *(peers_paragraphs() if peers_wanted else []),
        "Collectives are counted in one untimed step of each optimizer after the warm-up: bytes at the "
        "torch.distributed calls (muonlab's from its own counter, which leaves out its small control messages), "
        "'torch.distributed calls' every call to a torch.distributed collective (object collectives and barriers "
        "included), 'process-group ops' every operation the gloo process group ran (torch.profiler's gloo events: "
        "also those DTensor's functional collectives issue, and the inner gathers of an object collective).",
        *(["## Goals (this run)\n\n" + "\n".join(goals)] if goals else []),
        *sections,
        "'time / muonlab' > 1: slower than muonlab with its non-finite check on. "
        "muonlab-ignore is muonlab with nonfinite=\"ignore\": its ratio is the safety check's cost (on replicas "
        "the gradient fingerprint's too: it rides on the non-finite check's read). "
        "muonlab-device (when asked for) decides the check's skip on the device (nonfinite_decision=\"device\": "
        "no flag read, one all-reduce of W flags, every write masked). "
        "muonlab-again is a second muonlab, identical to the first (check on): its ratio, 1 in a perfect measurement, "
        "is this run's noise floor for such an A/B. bytes / bound: goal <= 1.005 for muonlab. "
        "muonlab-normuon and dion-normuon (when asked for) are NorMuon (beta2 0.95): their error column compares "
        "each with muonlab's NorMuon in one process on the whole matrices.",
        *skipped,
    ])
    title = "muonlab vs Dion and XTuner distributed Muon (FSDP2, gloo)"
    if not peers_wanted:  # muonlab's variants alone: the safety check's A/B
        title = ("muonlab's safety check: its cost in an A/B of muonlab's variants "
                 f"({'FSDP2 and DDP replicas' if args.replicas else 'FSDP2'}, gloo)")
    normuon = any(k in NORMUON_KINDS for k in kinds)
    if normuon:
        title = "NorMuon: muonlab's against Dion's, beside muonlab's Muon (FSDP2, gloo)"
    out = args.out or results_path("peers_normuon" if normuon else "peers" if peers_wanted else "peers_check")
    write_report(out, title, body, script=__file__, argv=argv,
                 machine_note=f"Gloo, W ranks of 1 thread each sharing {os.cpu_count()} cores. Load average "
                              f"{load_before} before, {load()} after (other work shares this machine).")


if __name__ == "__main__":
    main()
