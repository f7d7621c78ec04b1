"""Distributed Muon on gloo ranks: step time vs a redundant baseline and one process; bytes vs the bound.

    .venv/bin/python benchmarks/bench_distributed.py [--world 4] [--steps 5]

Parameters are the hidden matrices of a 4-layer width-256 GPT (16 matrices), FSDP2-style Shard(0)
DTensors ("fsdp") or replicated plain tensors ("ddp"). Times are medians of --steps steps after
warm-up, barrier to barrier. Lower bounds (wire dtype bf16):
  fsdp: sum over matrices of 2 (W-1)/W bytes (gathered once to one rank, scattered back once);
  ddp:  every rank receives the (W-1)/W of the updates it did not compute: W (W-1)/W total bytes.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _dist_workers import bench_worker, gpt_matrix_shapes, single_process  # noqa: E402

from muonlab import ns_flops  # noqa: E402
from muonlab.launcher import launch  # noqa: E402
from _report import md_table, results_path, write_report  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    W = args.world
    shapes = [s for _, s in gpt_matrix_shapes()]
    matrix_bytes = [a * b * 2 for a, b in shapes]  # bf16 on the wire
    bound = {"fsdp": sum(2 * (W - 1) / W * m for m in matrix_bytes), "ddp": (W - 1) * sum(matrix_bytes)}
    per_matrix = [ns_flops(s) for s in shapes]
    flop_target = max(sum(per_matrix) / W, max(per_matrix))

    single = single_process(args.steps)
    rows = []
    for layout in ("fsdp", "ddp"):
        for strategy in ("muonlab", "redundant"):
            res = launch(bench_worker, W, layout, strategy, args.steps, timeout_s=600)
            seconds = max(r["seconds"] for r in res.values())
            total_sent = sum(r["sent"] for r in res.values())
            flops = res[0]["plan_flops"]
            rows.append(dict(layout=layout, strategy=strategy, seconds=seconds, paths=",".join(res[0]["paths"]),
                             bytes=total_sent, bound=bound[layout], max_flops=max(flops),
                             imbalance=max(flops) / flop_target))
    by = {(r["layout"], r["strategy"]): r for r in rows}
    header = ["layout", "strategy", "paths", "step ms", "vs redundant", "vs 1 process", "total bytes",
              "bytes / bound", "max-rank NS GFLOP", "FLOP imbalance"]
    body = []
    for r in rows:
        red = by[(r["layout"], "redundant")]["seconds"]
        body.append([r["layout"], r["strategy"], r["paths"], f"{1e3 * r['seconds']:.1f}",
                     f"{red / r['seconds']:.2f}x", f"{single / r['seconds']:.2f}x", f"{r['bytes']:,}",
                     f"{r['bytes'] / r['bound']:.3f}", f"{r['max_flops'] / 1e9:.3f}", f"{r['imbalance']:.3f}"])
    text = "\n".join([
        "Parameters: the 16 hidden matrices of a 4-layer width-256 GPT; bf16 on the wire, bf16 Newton-Schulz.",
        "",
        md_table(header, body),
        "",
        f"Single process (all 16 matrices, one process, {torch.get_num_threads()} threads): {1e3 * single:.1f} ms.",
        "",
        "'vs redundant' = redundant step time / this step time (higher is better); 'vs 1 process' likewise.",
        "FLOP imbalance = max-rank Newton-Schulz FLOPs / max(mean, largest single matrix); goal <= 1.1.",
        "bytes / bound: goal <= 1.05 for muonlab. The redundant baseline moves padded whole matrices to every rank.",
    ])
    print(text)
    write_report(results_path("distributed" if W == 4 else f"distributed_w{W}"),
                 "Distributed Muon: step time, bytes and FLOP balance", text, script=__file__,
                 machine_note=f"Gloo, {W} ranks (1 thread each; {W} ranks share {os.cpu_count()} cores).")


if __name__ == "__main__":
    main()
