"""How long the planner panel takes to answer one control change, change by change.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_planner_panel.py [--baseline /path/to/other/checkout]

The panel of notebook 03 (``planner_panel(moe_shapes, world=64, ep=8, experts=64, layers=4)``, world
sizes 8..2048 in the sweep) is built without a frontend and its controls are moved one at a time
through the widget's choices, as a user would; each change is timed from the new value to the
finished PNG (simulation, drawing, rendering), in wall seconds and in this process's CPU seconds
(what the change costs when the machine is not shared). Columns:
  kept:  this checkout's ``panel.update()``, plans kept between changes (what a user gets);
  cold:  the same change with the plan cache emptied first (every plan simulated again);
  baseline (with --baseline): another checkout's panel callback plus the PNG the inline backend
         renders for it (``bbox_inches="tight"``), in a subprocess, same changes in the same order.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

import matplotlib

matplotlib.use("Agg")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import md_table, results_path, text_table, write_report  # noqa: E402

START = dict(world=64, ep=8, experts=64, layers=4, profile="h100_node", strategy="muonlab")
CHANGES = ([("world", w) for w in (128, 256, 512, 1024, 2048)]
           + [("strategy", s) for s in ("padded_all_to_all", "xtuner", "muonlab")]
           + [("world", 64), ("ep", 4), ("ep", 2), ("ep", 1), ("ep", 8)]
           + [("experts", 128), ("experts", 32), ("experts", 64)]
           + [("layers", 2), ("layers", 8), ("layers", 24), ("layers", 4)]
           + [("profile", "cpu_gloo"), ("profile", "h100_node"), ("world", 2048)])


def _steps():
    values = dict(START)
    yield "open the panel", dict(values)
    for key, value in CHANGES:
        values[key] = value
        yield f"{key} -> {value}", dict(values)


def time_this_checkout(cold: bool) -> list[tuple[float, float]]:
    import matplotlib.pyplot as plt

    from muonlab.viz import planner

    panel = planner.planner_panel(planner.moe_shapes, auto=False, **{k: START[k] for k in ("world", "ep", "experts",
                                                                                         "layers")})
    out = []
    for _, values in _steps():
        for key, value in values.items():
            getattr(panel, key).value = value
        if cold:
            planner.clear_plan_cache()
        t0, c0 = time.perf_counter(), time.process_time()
        result = panel.update()
        out.append((time.perf_counter() - t0, time.process_time() - c0))
        assert result is not None, panel.status.value
        plt.close("all")
    return out


_BASELINE = """
import io, json, sys, time, matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
from muonlab.viz.planner import moe_shapes, simulate_views, DEFAULT_SWEEP
out = []
for values in json.loads(sys.argv[1]):
    t0, c0 = time.perf_counter(), time.process_time()
    fig = simulate_views(moe_shapes, sweep_worlds=DEFAULT_SWEEP, **values)["figure"]
    fig.savefig(io.BytesIO(), format="png", bbox_inches="tight")
    out.append((time.perf_counter() - t0, time.process_time() - c0))
    plt.close("all")
print(json.dumps(out))
"""


def time_baseline(checkout: str) -> list[tuple[float, float]]:
    env = dict(os.environ, PYTHONPATH=str(Path(checkout).resolve()))
    steps = json.dumps([values for _, values in _steps()])
    done = subprocess.run([sys.executable, "-c", _BASELINE, steps], env=env, capture_output=True, text=True,
                          check=True, cwd=str(Path(checkout).resolve()))
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", help="another checkout of muonlab to time the same changes against")
    args = ap.parse_args(argv)
    names = [name for name, _ in _steps()]
    kept = time_this_checkout(cold=False)
    cold = time_this_checkout(cold=True)
    base = time_baseline(args.baseline) if args.baseline else None
    columns = [("kept", kept), ("cold", cold)] + ([("baseline", base)] if base else [])
    header = ["change"] + [f"{name} {kind}" for name, _ in columns for kind in ("wall s", "cpu s")]
    rows = [[n] + [f"{times[i][k]:.2f}" for _, times in columns for k in (0, 1)] for i, n in enumerate(names)]
    for label, stat in (("max", max), ("median", median)):
        rows.append([f"(each change after the first) {label}"]
                    + [f"{stat(t[k] for t in times[1:]):.2f}" for _, times in columns for k in (0, 1)])
    print(text_table(header, rows))
    if base:
        commit = subprocess.run(["git", "-C", args.baseline, "log", "-1", "--format=%h %s"], capture_output=True,
                                text=True).stdout.strip()
        print(f"baseline: {args.baseline} at {commit[:80]}")
    load = os.getloadavg()[0]
    note = (f"1-minute load average at the end: {load:.1f}: other processes shared the 2 cores, so wall seconds "
            "run above what a change costs on an idle machine; cpu s is this process's own CPU time.")
    body = ("Goal: every change of the notebook's panel answered in under 1 s on this 2-core CPU.\n\n"
            + (f"Baseline: the checkout at commit {commit[:80]}.\n\n" if base else "") + md_table(header, rows))
    write_report(results_path("planner_panel"), "Planner panel: seconds per control change", body,
                 script=__file__, argv=argv, machine_note=note)


if __name__ == "__main__":
    main()
