"""Host work per steady optimizer step: Python calls and aten ops, counted, per added matrix.

    .venv/bin/python benchmarks/bench_host_work.py [--sizes 24 48 96] [--world 1 2] [--kinds K ...]
    python3 benchmarks/bench_host_work.py --device cuda --world 1 --out $OUT/host_work_cuda.md   # on a GPU

On a GPU the kernels of a step of small matrices are asynchronous and the host's work is the step,
so host work is counted here (see benchmarks/_host_work_workers.py): in one steady step after three
warm-up steps, the Python function calls (``sys.setprofile``) and the aten ops (a
``TorchDispatchMode``) of rank 0, for GPT-2-small's hidden matrices at 1/8 scale (layers x [288x96,
96x96, 384x96, 96x384]) at 24, 48 and 96 matrices. Counts, not times: the same on any machine of
the same kind (the CPU path's choices, e.g. where "auto" resolves to fp32, can change aten ops).
World 1 is one process with plain tensors; world 2 is rank 0 of 2 gloo ranks with FSDP2-style
Shard(0) DTensors (torch.optim.Muon is single-device: world 1 only). Dion (microsoft/dion's Muon,
eager, at the commit bench_peers.py pins) is copied into benchmarks/_peers by ``bench_peers.py
--fetch-only``; absent, its rows are skipped with a line saying so.

Per added matrix: (count at the largest size - count at the smallest) / (difference in matrices).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _host_work_workers import KINDS, host_work_worker  # noqa: E402
from _machine import load  # noqa: E402
from _peers_workers import PEERS_DIR  # noqa: E402
from _report import md_table, results_path, text_table, write_report  # noqa: E402

from muonlab.launcher import launch  # noqa: E402


def rows_for(counts: dict, kinds: list[str], sizes: list[int], dion: dict | None) -> tuple[list, list]:
    header = ["optimizer", *(f"{n} matrices: calls / ops" for n in sizes), "per added matrix: calls / ops",
              "calls / Dion's at the largest", "muonlab files walked (kernels/)"]
    rows = []
    lo, hi = min(sizes), max(sizes)
    for kind in kinds:
        if (kind, lo) not in counts:
            continue
        cells = [f"{counts[(kind, n)][0]:,} / {counts[(kind, n)][1]:,}"
                 + (f" [{counts[(kind, n)][4]}]" if counts[(kind, n)][4] else "") for n in sizes]
        per = [(counts[(kind, hi)][k] - counts[(kind, lo)][k]) / (hi - lo) for k in (0, 1)]
        vs = f"{counts[(kind, hi)][0] / dion[(hi)][0]:.2f}x" if dion else "n/a"
        files, kernel_files = counts[(kind, hi)][2:4]
        walk = f"{files} ({kernel_files})" if files else "-"
        rows.append([kind, *cells, f"{per[0]:.1f} / {per[1]:.1f}", vs, walk])
    return header, rows


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[24, 48, 96])
    ap.add_argument("--world", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=KINDS)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where one process's tensors live (cuda: --world 1 only, adds muonlab-captured)")
    ap.add_argument("--out", default=None, help="default: results/host_work.md (cuda: results/host_work_cuda.md)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and args.world != [1]:
        ap.error("--device cuda: --world 1 only (the distributed rows run on gloo)")
    if any(n % 4 for n in args.sizes) or len(set(args.sizes)) < 2:
        ap.error("--sizes: at least two different multiples of 4 (4 matrices per layer)")
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    kinds = list(args.kinds)
    notes = []
    if "dion" in kinds and not (PEERS_DIR / "dion" / "muon.py").exists():
        kinds.remove("dion")
        notes.append("Dion skipped: no benchmarks/_peers/dion (run `bench_peers.py --fetch-only`).")
    load_before = load()
    sections = []
    for world in args.world:
        if world == 1:
            counts = host_work_worker(kinds, args.sizes, args.device)
        else:
            counts = launch(host_work_worker, world, kinds, args.sizes, device="cpu", timeout_s=900)[0]
        dion = {n: counts[("dion", n)] for n in args.sizes} if ("dion", args.sizes[0]) in counts else None
        header, rows = rows_for(counts, kinds, sorted(args.sizes), dion)
        where = (f"one process ({args.device})" if world == 1
                 else f"rank 0 of {world} gloo ranks (FSDP2 Shard(0))")
        print(f"\n{where}\n" + text_table(header, rows), flush=True)
        sections.append(f"## {where[0].upper()}{where[1:]}\n\n" + md_table(header, rows))
    body = "\n\n".join([
        "Python calls (`sys.setprofile` call events) and aten ops (a `TorchDispatchMode`), each counted in a steady step of "
        "rank 0, after 3 warm-up steps, on GPT-2-small's hidden matrices at 1/8 scale; see the script's docstring. "
        "muonlab kinds: the defaults, `nonfinite_decision=\"device\"`, `state_offload=\"cpu\"`, "
        "`update_rule=\"normuon\"`; on CUDA also `capture_after=1` with a device-tensor lr (the replayed graph). Goal (issue 40): at most 5 Python calls per added matrix and at most 1.2x "
        "Dion's calls at 96 matrices, one process and rank 0 of 2. The files walked: the muonlab modules whose functions "
        "the step called at the largest size (in brackets, those in kernels/); goal: at most 12 (3). In square "
        "brackets after a muonlab count: the Newton-Schulz backends the step ran.",
        *sections, *notes])
    default_out = "host_work" if args.device == "cpu" else "host_work_cuda"
    write_report(args.out or results_path(default_out), "Host work per optimizer step: Python calls and aten ops",
                 body, script=__file__, argv=argv,
                 machine_note=f"Load average {load_before} before, {load()} after (counts do not depend on it).")


if __name__ == "__main__":
    main()
