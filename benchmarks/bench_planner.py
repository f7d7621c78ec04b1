"""Planner scenarios: muonlab vs two reference strategies from 8 to 2048 ranks, from shapes alone.

    .venv/bin/python benchmarks/bench_planner.py [--profile h100_node]

Models (Muon-routed matrices only):
  dense: 60 layers, hidden 4096, grouped-query attention (8 KV heads of 128 -> k, v 1024 x 4096),
         SwiGLU MLP 10944 x 4096 (gate, up) and 4096 x 10944 (down).
  moe:   24 layers, hidden 2048, 128 experts of hidden 1024 (banks 128 x 1024 x 2048 and
         128 x 2048 x 1024), attention qkv 6144 x 2048, out 2048 x 2048, router 128 x 2048.
Columns: total bytes / lower bound (muonlab.simulate.lower_bound_bytes: each sharded matrix
gathered once and scattered back once, 2 (W-1)/W of its bytes; experts already whole on a rank
count nothing), the bytes of experts moved off overloaded ranks for balance (path rebalance: a
trade of bytes for balance, beyond any bound), the largest per-rank bytes, max-rank Newton-Schulz
FLOPs / max(mean, largest single matrix), and modelled optimizer seconds under the hardware
profile (muonlab.comm.cost). Goal for muonlab in every row: bytes other than those moves <= 1.05x
the bound, FLOP imbalance <= 1.1, and a modelled time no worse than the better reference.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from muonlab.comm.cost import get_profile
from muonlab.simulate import simulate, summarize
from muonlab.viz.planner import dense_shapes, moe_shapes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import md_table, results_path, write_report  # noqa: E402

WORLDS = (8, 64, 128, 512, 2048)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default="h100_node")
    args = ap.parse_args()
    profile = get_profile(args.profile)
    rows = []
    t_start = time.time()
    for model, shapes in (("dense", dense_shapes()), ("moe", moe_shapes())):
        for W in WORLDS:
            for ep in (1, 8):
                mesh = W if ep == 1 else (W // ep, ep)
                for strategy in ("muonlab", "padded_all_to_all", "xtuner"):
                    t0 = time.time()
                    plan = simulate(shapes, mesh, strategy=strategy, profile=profile)
                    s = summarize(plan, W, profile)
                    # a plan on one axis of a bigger mesh repeats per slice (ep > 1), as summarize counts it
                    moved = sum(sum(b.bytes_sent) * (len(b.group.mesh_ranks) // b.group.size)
                                for b in plan if b.path == "rebalance")
                    s.update(model=model, W=W, ep=ep, strategy=strategy, plan_s=time.time() - t0, moved=moved)
                    rows.append(s)
    planned_s = time.time() - t_start
    header = ["model", "W", "ep", "strategy", "paths", "bytes / bound", "experts moved for balance MB",
              "max-rank MB", "FLOP imbalance", "modelled ms", "goal"]
    body = []
    for r in rows:
        goal = ""
        if r["strategy"] == "muonlab":
            refs = [x["modelled_s"] for x in rows if (x["model"], x["W"], x["ep"]) == (r["model"], r["W"], r["ep"])
                    and x["strategy"] != "muonlab"]
            beyond = r["total_bytes"] - r["moved"]
            ok = (beyond <= 1.05 * r["bound_bytes"], r["flop_imbalance"] <= 1.1, r["modelled_s"] <= min(refs) * 1.0001)
            goal = "met" if all(ok) else "MISSED: " + ", ".join(
                n for n, o in zip(("bytes", "balance", "time"), ok) if not o)
        body.append([r["model"], r["W"], r["ep"], r["strategy"], ",".join(r["paths"]),
                     f"{r['bytes_over_bound']:.3f}", f"{r['moved'] / 1e6:.1f}", f"{r['max_rank_bytes'] / 1e6:.1f}",
                     f"{r['flop_imbalance']:.3f}", f"{1e3 * r['modelled_s']:.2f}", goal])
    lines = [
        f"Profile: {profile.source}",
        f"Whole table planned in {planned_s:.1f} s on the machine above (no processes launched).",
        "",
        md_table(header, body),
        "",
        "Notes:",
        "- Whole experts (a bank sharded on its expert dim) need no bytes where they lie and count nothing in",
        "  the bound; bytes for them appear only when the planner moves experts off overloaded ranks (path",
        "  rebalance), a trade of bytes for balance shown in its own column (MoE rows above 1.0 are those).",
        "- The reference strategies count the zero matrices they pad in as computed FLOPs, so their",
        "  imbalance column compares padded work; muonlab's counts real matrices only.",
        "- moe W=128 ep=8 misses the balance goal: each rank holds one expert per bank and the 72 dense",
        "  matrices land on 72 of 128 ranks; evening that out needs moving experts differently in each EP",
        "  slice, while a plan is one pattern repeated over the slices (a known limit).",
        "- dense W=128 misses the balance goal since Newton-Schulz runs in the gram form (ns_form=\"auto\",",
        "  the default) where it saves 20% of the FLOPs: 180 MLP matrices at 3.39 TFLOP each, 120 square",
        "  ones at 2.06 and 120 k/v at 0.06 average 6.76 per rank, and no placement of whole matrices on 128",
        "  ranks stays within 1.1 of it (some rank then holds one MLP matrix and two square ones: 1.111).",
        "  In the plain form the same bound was 1.069 (two MLP matrices on a rank), a met row.",
        "- Modelled time replays the engine's pipeline (muonlab.comm.cost.step_seconds): batch i+1's",
        "  transfer is in flight while batch i computes.",
    ]
    text = "\n".join(lines)
    print(text)
    write_report(results_path("planner"), "Planner scenarios", text, script=__file__)


if __name__ == "__main__":
    main()
