"""The distributed half of ``make demo``: FSDP2 + Muon on CPU workers, then what the optimizer did.

``run`` launches ``nprocs`` gloo workers (``muonlab.train_distributed.train_worker``), prints the
plan and the bytes each rank moved per path (counted at the collectives, next to the plan's
figure), and writes the last step's per-rank timeline as a PNG and as Chrome-trace JSON (open it
in https://ui.perfetto.dev).
"""

from __future__ import annotations

import time
from pathlib import Path

from .distributed import launch
from .trace import Span, write_chrome_trace
from .train_distributed import train_worker

# 5 blocks on 4 ranks: 5 matrices per shape do not split evenly, so the plan shows full and
# remainder batches.
DEMO_MODEL = dict(d_model=64, n_layers=5, n_heads=4, context=64, batch_per_rank=4)


def run(out_dir="runs/demo", steps: int = 5, nprocs: int = 4, mode: str = "fsdp", timeout_s: float = 300) -> dict:
    """Train, print the plan and bytes per path, write timeline.png and trace.json; return the results."""
    from matplotlib.figure import Figure

    from .viz.timeline import plot_timeline

    t0 = time.time()
    results = launch(train_worker, nprocs, mode=mode, steps=steps, timeout_s=timeout_s, **DEMO_MODEL)
    first = results[0]
    print(f"\n{mode} on {nprocs} CPU workers, small GPT (width {DEMO_MODEL['d_model']}, "
          f"{DEMO_MODEL['n_layers']} layers), {steps} steps in {time.time() - t0:.1f} s (start-up included); "
          f"mean loss {first['mean_losses'][0]:.3f} -> {first['mean_losses'][-1]:.3f}")
    print("\nMuon plan (same on every rank):")
    print(first["plan_table"])
    print("\nbytes sent per path in the last step (counted at the collectives | planned):")
    for rank, res in results.items():
        counted, planned = res["stats"]["bytes_sent"], res["plan_bytes_sent"]
        paths = sorted(set(counted) | set(planned))
        cells = "  ".join(f"{p} {counted.get(p, 0):>8} | {planned.get(p, 0):>8}" for p in paths)
        print(f"  rank {rank}: {cells}")

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    spans = [Span(**row) for row in first["spans"]]
    fig = Figure(figsize=(11, 1.0 + 1.1 * nprocs))
    plot_timeline(spans, ax=fig.add_subplot(), title=f"{mode}, {nprocs} ranks: last optimizer step")
    fig.tight_layout()
    fig.savefig(out / "timeline.png", dpi=120)
    write_chrome_trace(spans, out / "trace.json")
    print(f"wrote {out / 'timeline.png'} and {out / 'trace.json'} (open the JSON in https://ui.perfetto.dev)")
    return results


if __name__ == "__main__":
    run()
