"""The plan against the run: the cost model's seconds per batch and phase against the spans of steps.

    PYTHONPATH=$PWD python benchmarks/bench_plan_vs_run.py                       # one device, gloo W=2 and 4
    PYTHONPATH=$PWD python benchmarks/bench_plan_vs_run.py --device cuda --out /tmp/plan_vs_run.md   # one GPU only

For the GPT set (the 16 hidden matrices of a 4-layer, width-256 GPT) and small48 (the 48 of a
width-8 GPT), muonlab's Muon with its defaults takes ``--warmup`` steps, then ``--steps`` recorded
ones; ``muonlab.comm.plan_vs_run`` compares, on each rank, ``muonlab.comm.cost.predict_phases``
of its plan with the medians of the recorded spans, under the shipped profile of the device's kind
(h100_node, cpu_gloo) and under one ``muonlab.calibrate()`` measured first in the same process
(on gloo: over the launch's world). Modes: one process on ``--device`` (cpu or cuda, default cuda
where available), and ``--gloo`` worlds of CPU ranks (FSDP2-style Shard(0) DTensors on a 1-D
mesh). Giving ``--device`` alone runs that one process only (the GPU check); neither runs both.

Goals after calibrate() (issue 41): median |error| per phase and batch <= 20%, whole step <= 15%.
Errors are (predicted - measured) / measured; on gloo each row is one rank's batch and phase (all
ranks pooled), the whole step the slowest rank's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _plan_vs_run_workers import SETS, gloo_worker, single_device  # noqa: E402
from _report import md_table, results_path, text_table, write_report  # noqa: E402

PHASE_GOAL, STEP_GOAL = 0.20, 0.15


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:+.0f}%" if x < 0 or x > 0 else "0%"


def summarize(mode: str, per_rank: list[dict], set_name: str) -> tuple[list[list], list[list]]:
    """Summary rows per profile, and the calibrated profile's detail rows (rank 0's)."""
    first = per_rank[0][set_name]
    summary, detail = [], []
    for label in first["profiles"]:
        rows = [r for res in per_rank for r in res[set_name]["profiles"][label]["rows"]]
        errors = [abs(r["error"]) for r in rows if r["error"] is not None]
        by_phase: dict[str, list[float]] = {}
        for r in rows:
            if r["error"] is not None:
                by_phase.setdefault(r["phase"], []).append(abs(r["error"]))
        pred = max(res[set_name]["profiles"][label]["step_predicted_s"] for res in per_rank)
        meas = max(res[set_name]["profiles"][label]["step_measured_s"] for res in per_rank)
        med = statistics.median(errors) if errors else None
        step_err = (pred - meas) / meas if meas > 0 else None
        goal = ""
        if label == "calibrated":
            ok = (med is not None and med <= PHASE_GOAL, step_err is not None and abs(step_err) <= STEP_GOAL)
            goal = "met" if all(ok) else "MISSED: " + ", ".join(n for n, o in zip(("phase/batch", "step"), ok) if not o)
        summary.append([mode, set_name, ",".join(first["paths"]), label, len(errors),
                        "-" if med is None else f"{100 * med:.0f}%",
                        " ".join(f"{p}={100 * statistics.median(v):.0f}%" for p, v in by_phase.items()),
                        f"{1e3 * pred:.2f}", f"{1e3 * meas:.2f}", _pct(step_err), goal])
    for r in first["profiles"].get("calibrated", {}).get("rows", []):
        detail.append([mode, set_name, r["batch"], r["path"], r["phase"], f"{1e3 * r['predicted_s']:.3f}",
                       "-" if r["measured_s"] is None else f"{1e3 * r['measured_s']:.3f}", _pct(r["error"])])
    return summary, detail


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None,
                    help="the one-process mode's device (default cuda where available); alone: that mode only")
    ap.add_argument("--gloo", type=int, nargs="*", default=None,
                    help="gloo worlds (default 2 4, or none when --device is given)")
    ap.add_argument("--sets", nargs="+", choices=SETS, default=list(SETS))
    ap.add_argument("--steps", type=int, default=10, help="recorded steps")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the one-process mode")
    ap.add_argument("--out", default=str(results_path("plan_vs_run")))
    args = ap.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    worlds = args.gloo if args.gloo is not None else ([] if args.device else [2, 4])
    t0 = time.time()
    summary, detail, sources = [], [], {}
    res = single_device(device, args.sets, args.steps, args.warmup, args.threads)
    mode = f"{device}, 1 process"
    for s in args.sets:
        rows, more = summarize(mode, [res], s)
        summary += rows
        detail += more
        for label, p in res[s]["profiles"].items():
            sources[(mode, label)] = p["source"]
    for world in worlds:
        from muonlab.launcher import launch
        out = launch(gloo_worker, world, args.sets, args.steps, args.warmup, device="cpu", timeout_s=600)
        mode = f"gloo W={world}"
        for s in args.sets:
            rows, more = summarize(mode, [out[r] for r in sorted(out)], s)
            summary += rows
            detail += more
            for label, p in out[0][s]["profiles"].items():
                sources[(mode, label)] = p["source"]
    header = ["mode", "set", "paths", "profile", "rows", "median abs err", "by phase", "step pred ms",
              "step meas ms", "step err", "goal (calibrated: 20% / 15%)"]
    print(text_table(header, summary))
    dheader = ["mode", "set", "batch", "path", "phase", "predicted ms", "measured ms", "error"]
    gpu = f" GPU: {torch.cuda.get_device_name()}." if device == "cuda" else ""
    body = "\n".join([
        __doc__.split("\n\n", 2)[2].strip(),
        "",
        f"{args.steps} recorded steps after {args.warmup} warm-up steps; one-process mode at {args.threads} "
        f"torch thread(s), gloo ranks at 1; {time.time() - t0:.0f} s in all.",
        "",
        "## Median absolute error, per profile",
        "",
        md_table(header, summary),
        "",
        "## Profiles",
        "",
        *[f"- {mode}, {label}: {src}" for (mode, label), src in sources.items()],
        "",
        "## Every batch and phase under the calibrated profile (rank 0)",
        "",
        md_table(dheader, detail),
    ])
    write_report(args.out, "The plan against the run (predicted vs measured seconds)", body, script=__file__,
                 argv=argv, machine_note=gpu)


if __name__ == "__main__":
    main()
