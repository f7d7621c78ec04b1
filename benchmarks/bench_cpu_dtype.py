"""Which compute dtype is faster for Newton-Schulz on a CPU with native bf16 matmul, by matrix size.

On such a CPU ``ns_dtype="auto"`` computes in bf16, except for matrices whose m^2 n (one product's
multiply-adds, m the smaller side) is at most ``CPU_FP32_MAX_WORK``: there a bf16 product's fixed cost
per call outweighs its arithmetic and fp32 is faster (and more accurate). This script measures that
crossover: for stacks of ``--batch`` matrices of each shape, 5 plain iterations (``newton_schulz``,
torch backend) in bf16 and in fp32, timed in alternating order round after round (so load from other
jobs hits both alike); the table gives the median over rounds of fp32's time over bf16's, and the
dtype "auto" takes for that shape.

    python benchmarks/bench_cpu_dtype.py                 # what results/cpu_dtype.md holds
    python benchmarks/bench_cpu_dtype.py --rounds 5 --out /tmp/cpu_dtype.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import load  # noqa: E402
from _report import md_table, results_path, text_table, write_report  # noqa: E402

from muonlab import newton_schulz  # noqa: E402
from muonlab.kernels.newton_schulz import CPU_FP32_MAX_WORK, cpu_bf16_flags, resolve_dtype  # noqa: E402

SHAPES = [(8, 8), (8, 32), (16, 16), (16, 64), (24, 24), (24, 96), (32, 32), (32, 128), (48, 48), (64, 64),
          (48, 192), (96, 96), (64, 256), (128, 128), (128, 512), (256, 256)]


def ratio(shape: tuple[int, int], batch: int, rounds: int) -> tuple[float, float, float]:
    """(median bf16 ms, median fp32 ms, median over rounds of fp32 time / bf16 time)."""
    x = torch.randn(batch, *shape, generator=torch.Generator().manual_seed(0))
    runs = {dtype: (lambda dtype=dtype: newton_schulz(x, dtype=dtype, form="plain", backend="torch"))
            for dtype in (torch.bfloat16, torch.float32)}
    for run in runs.values():
        for _ in range(2):
            run()
    times: dict[torch.dtype, list[float]] = {dtype: [] for dtype in runs}
    for r in range(rounds):
        for dtype in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            t0 = time.perf_counter()
            runs[dtype]()
            times[dtype].append(time.perf_counter() - t0)
    ratios = [f / b for b, f in zip(times[torch.bfloat16], times[torch.float32])]
    return (1e3 * statistics.median(times[torch.bfloat16]), 1e3 * statistics.median(times[torch.float32]),
            statistics.median(ratios))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", default=str(results_path("cpu_dtype")))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    flags = cpu_bf16_flags()
    if not flags:
        print("this CPU lists no native bf16 matmul: ns_dtype='auto' is fp32 for every shape here, nothing to measure")
        return
    start_load, t0 = load(), time.perf_counter()
    header = ["matrix", "m^2 n", "bf16 ms", "fp32 ms", "fp32 / bf16 (median of rounds)", "faster", "'auto' takes"]
    rows = []
    for shape in SHAPES:
        bf16_ms, fp32_ms, r = ratio(shape, args.batch, args.rounds)
        m, n = sorted(shape)
        auto = resolve_dtype("auto", "cpu", shape)
        rows.append([f"{shape[0]}x{shape[1]}", m * m * n, f"{bf16_ms:.2f}", f"{fp32_ms:.2f}", f"{r:.2f}",
                     "fp32" if r < 1 else "bf16", str(auto).removeprefix("torch.")])
        print(text_table(header, rows[-1:]), flush=True)
    note = (f"The CPU lists {', '.join(flags)}. torch threads {args.threads}. Load average {start_load} at the "
            f"start, {load()} at the end; total wall time {time.perf_counter() - t0:.0f} s.")
    body = (f"Stacks of {args.batch} matrices, 5 plain Newton-Schulz iterations, bf16 and fp32 alternating over "
            f"{args.rounds} rounds after 2 warm-up calls each. `CPU_FP32_MAX_WORK` = {CPU_FP32_MAX_WORK} "
            "(m^2 n, m the smaller side): \"'auto' takes\" is what `resolve_dtype('auto', 'cpu', shape)` "
            "gives.\n\n" + md_table(header, rows))
    write_report(args.out, "Newton-Schulz on a CPU: bf16 against fp32 by matrix size", body, script=__file__,
                 argv=argv, machine_note=note)


if __name__ == "__main__":
    main()
