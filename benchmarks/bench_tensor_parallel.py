"""Muon on FSDP2 x tensor parallel (path ``pieces``) against plain FSDP2 and the padded full gather.

A GPT-like MLP stack (``layers`` blocks of fc (hidden, width) column-wise and out (width, hidden)
row-wise) on 4 gloo ranks, one thread each, in one launch:

* "fsdp x tp (2 x 2)": torch's TP over "tp", FSDP2 over "dp"; every weight takes path ``pieces``
  (owner compute over the flattened 4 ranks).
* "fsdp on 4": the same model, plain FSDP2 over the flattened world (Shard(0)): ``all_to_all``.
* "fsdp on 4, redundant": that, with ``strategy="redundant"``: every matrix padded-gathered whole on
  every rank and orthogonalized there (path ``gather_all``), the fallback a placement no path read
  used to take. No switch forces the TP weights themselves onto ``gather_all`` (it reads one shard
  dim on one axis), so the flattened world stands in for them.

Each case: one backward, then ``warmup`` steps and ``steps`` timed ones (every rank starts each
together); per case the median step seconds of the slowest rank, the medians of its phases (the
step's spans: communication, Newton-Schulz; slowest rank each), and bytes sent per rank
(counted at the collectives, and whether they equal ``plan()``'s).

    python benchmarks/bench_tensor_parallel.py [--width 256 --hidden 1024 --layers 4 --steps 5]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import _tp_workers as W  # noqa: E402
from _report import md_table, results_path, text_table, write_report  # noqa: E402

from muonlab.launcher import launch  # noqa: E402
from muonlab.kernels.newton_schulz import cpu_has_native_bf16  # noqa: E402

WORLD = 4


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    results = launch(W.steady_steps, WORLD, args.width, args.hidden, args.layers, args.warmup, args.steps,
                     timeout_s=600)
    load_after = os.getloadavg()

    base = max(results[r]["fsdp x tp (2 x 2)"]["seconds"] for r in results)
    head = ["case", "paths", "step ms (median, slowest rank)", "vs fsdp x tp", "communication ms",
            "Newton-Schulz ms", "MB sent per rank (ranks 0-3)", "counted = planned"]
    rows = []
    for case in W.CASES:
        per_rank = [results[r][case] for r in sorted(results)]
        seconds = max(got["seconds"] for got in per_rank)
        sent = [sum(got["sent"].values()) for got in per_rank]
        comm = max(got["phases"]["communication"] for got in per_rank)
        ns = max(got["phases"]["newton_schulz"] for got in per_rank)
        rows.append([case, " ".join(per_rank[0]["paths"]), f"{1e3 * seconds:.1f}", f"{seconds / base:.2f}x",
                     f"{1e3 * comm:.1f}", f"{1e3 * ns:.1f}",
                     " / ".join(f"{b / 1e6:.2f}" for b in sent),
                     all(s == got["planned"] for s, got in zip(sent, per_rank))])
    print(text_table(head, rows))
    sent = {case: max(sum(results[r][case]["sent"].values()) for r in results) for case in W.CASES}
    tp, flat, full = (sent[c] for c in W.CASES)
    summary = (f"Bytes per rank: FSDP2 x TP's pieces move {tp / flat:.2f}x plain FSDP2's on the same 4 ranks and "
               f"{tp / full:.2f}x the padded full gather's (each rank sends its piece of every matrix it does "
               "not own and gets its piece of each update back, where the full gather sends its shard to every "
               "other rank). Step times on a loaded 2-core machine are noisy; the Newton-Schulz column is "
               "the owner compute's share against every rank's whole set.")
    print(summary)
    kind = "native bf16" if cpu_has_native_bf16() else "no native bf16"
    note = (f"CPU kind as Muon sees it: {kind}; {WORLD} gloo ranks, 1 thread each, on this machine's "
            f"{os.cpu_count()} cores; load average (1, 5, 15 min) {load_before[0]:.2f} {load_before[1]:.2f} "
            f"{load_before[2]:.2f} before the run, {load_after[0]:.2f} after. Model: {args.layers} blocks, "
            f"fc ({args.hidden}, {args.width}), out ({args.width}, {args.hidden}), fp32 weights, Muon's defaults.")
    write_report(results_path("tensor_parallel"),
                 "Muon on FSDP2 x TP (pieces) against plain FSDP2 and the padded full gather (gather_all)",
                 md_table(head, rows) + "\n\n" + summary, script=__file__, argv=argv, machine_note=note)


if __name__ == "__main__":
    main()
