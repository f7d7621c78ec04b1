"""How long launch() takes around the work: cold launches against warm ones (the running workers
of the previous launch reused), on 2 CPU ranks over gloo.

    PYTHONPATH=. python benchmarks/bench_launch.py [--repeats 3] [--steps 20]

Each launch runs benchmarks/_launch_workers.train_mlp (an MLP under DDP, ``--steps`` steps, a
progress report per step) with ``progress=False``; its run directory's launch.json gives, in wall
seconds from the call:
  start-up:   until every rank had its process group;
  first step: until every rank had reported its first step (what a notebook user waits for);
  teardown:   from the last rank's return to the call's return;
  total:      the call.
Rows: ``cold`` launches (warm=False: fresh processes each time, as before warm workers; with the
default start method and with ``start_method="spawn"``), then the
first warm launch (a new pool: a cold start-up) and the warm launches that reuse it, then the time
``shutdown_workers()`` takes to end the pool. Medians and maxima over ``--repeats`` launches.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import load  # noqa: E402
from _report import md_table, results_path, text_table, write_report  # noqa: E402

FIELDS = ("startup_s", "first_step_s", "teardown_s", "total_s")


def _one(kind: str, index: int, steps: int, start_method: str | None = None) -> dict:
    from _launch_workers import train_mlp

    from muonlab.launcher import launch
    from muonlab.launcher import LAUNCH_INFO, RUNS_DIR_ENV

    name = f"{kind}-{start_method or 'default'}-{index}"
    started = time.perf_counter()
    launch(train_mlp, 2, steps, warm=kind != "cold", name=name, progress=False, timeout_s=300, device="cpu",
           **({} if start_method is None else dict(start_method=start_method)))
    wall = time.perf_counter() - started
    with open(os.path.join(os.environ[RUNS_DIR_ENV], name, LAUNCH_INFO)) as f:
        info = json.load(f)
    info["total_s"] = wall
    return info


def _row(label: str, infos: list[dict]) -> list[str]:
    cells = [label, str(len(infos))]
    for field in FIELDS:
        values = [i[field] for i in infos if i.get(field) is not None]
        cells.append(f"{median(values):.2f} / {max(values):.2f}" if values else "n/a")
    return cells


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)

    from muonlab.launcher import RUNS_DIR_ENV, shutdown_workers

    os.environ.setdefault(RUNS_DIR_ENV, tempfile.mkdtemp(prefix="bench_launch_runs_"))
    cold = [_one("cold", i, args.steps) for i in range(args.repeats)]
    spawned = [_one("cold", i, args.steps, start_method="spawn") for i in range(args.repeats)]
    first_warm = _one("warm", 0, args.steps)
    assert first_warm["workers"] == "new warm", first_warm
    reused = [_one("warm", i, args.steps) for i in range(1, args.repeats + 1)]
    assert all(r["workers"] == "reused warm" for r in reused), reused
    started = time.perf_counter()
    shutdown_workers()
    shutdown_s = time.perf_counter() - started

    header = ["launch", "n", "start-up s", "first step s", "teardown s", "total s"]
    rows = [_row("cold (warm=False), default start method", cold),
            _row("cold (warm=False), start_method='spawn'", spawned), _row("warm, new pool (first launch)", [first_warm]),
            _row("warm, reused pool", reused), ["shutdown_workers()", "1", "", "", f"{shutdown_s:.2f}", ""]]
    print(text_table(header, rows))
    body = (
        "Goal (issue 32): a second launch in the same kernel reaches its first step within 1 s of the cell "
        "starting (4-5 s before warm workers), teardown under 0.5 s.\n\n"
        f"Each cell: median / max over the launches (n). {args.steps} steps of "
        "benchmarks/_launch_workers.train_mlp (a 64-wide MLP under DDP, AdamW) per launch, 2 CPU ranks "
        "over gloo, progress=False. Seconds from the call: start-up (every rank has its process group), "
        "first step (every rank has reported step 1), total; teardown from the last rank's return to the "
        "call's return. The default start method is a forkserver that has imported muonlab (spawn where "
        "its socket path would not fit, under a long TMPDIR); 'spawn' starts every worker from a fresh "
        "interpreter. `shutdown_workers()` ends the pool (each worker leaves its loop, destroys its "
        "group and exits; elastic's agent sees them end).\n\n"
        + md_table(header, rows)
    )
    write_report(results_path("launch"), "launch(): cold and warm workers", body, script=__file__, argv=argv,
                 machine_note=f"Load average (1, 5, 15 min) at the end: {load()}.")


if __name__ == "__main__":
    main()
