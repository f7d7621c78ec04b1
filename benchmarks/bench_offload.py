"""Optimizer state offload: what stays on the parameters' device, and what a step costs, for
``Muon(state_offload=None | "cpu" | "disk")`` side by side in one run.

A GPT (--layers, --width) in one process; every place gets its own copy of the model and the same
fixed gradients. After warm-up steps, every round times one ``step()`` of each place in a rotating
order (so load from other jobs hits them alike); the table gives medians. On this CPU the "device"
is host memory too: the numbers count where the store keeps the state (``state_residency()``),
and the time is what fetching, writing back and the file cost on top of the same arithmetic.
With CUDA the models and gradients go on the GPU.

    python benchmarks/bench_offload.py                      # what results/offload.md holds
    python benchmarks/bench_offload.py --layers 2 --rounds 5 --out /tmp/offload.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from muonlab import Muon, muon_param_groups  # noqa: E402
from muonlab.models import GPT, GPTConfig  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import load  # noqa: E402
from _report import md_table, results_path, text_table, write_report  # noqa: E402

PLACES = (None, "cpu", "disk")
GOAL_DISK_RATIO = 1.5


def build(args, place, offload_dir, device):
    torch.manual_seed(0)
    model = GPT(GPTConfig(d_model=args.width, n_layers=args.layers, n_heads=4, context=32)).to(device)
    opt = Muon(muon_param_groups(model), lr=0.02, adamw_lr=3e-3, state_offload=place,
               offload_dir=offload_dir if place == "disk" else None)
    gen = torch.Generator().manual_seed(1)
    for p in model.parameters():  # fixed gradients: every place does the same arithmetic
        p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(device)
    return model, opt


def timed_step(opt, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def measure(args, device) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="muonlab_bench_offload_", dir=args.dir) as root:
        runs = {place: build(args, place, root, device) for place in PLACES}
        for _ in range(args.warmup):
            for _, opt in runs.values():
                opt.step()
        times = {place: [] for place in PLACES}
        for r in range(args.rounds):
            order = PLACES[r % len(PLACES):] + PLACES[:r % len(PLACES)]
            for place in order:
                times[place].append(timed_step(runs[place][1], device))
        rows = []
        for place in PLACES:
            opt = runs[place][1]
            per_param = sorted(sum(v.numel() * v.element_size() for k, v in s.items() if k != "step")
                               for s in opt.state.values())
            rows.append(dict(place=str(place), median_s=statistics.median(times[place]), window=sum(per_param[-2:]),
                             **opt.state_residency()))
        for _, opt in runs.values():
            opt._offload.close()
    return rows


def table(rows, device) -> tuple[list, list]:
    base = rows[0]["median_s"]
    header = ["state_offload", "device", "state on device between steps (KB)", "offloaded (KB)",
              "peak fetch window on device (KB)", "window bound (KB)", "step ms (median)", "vs resident"]
    body = []
    for r in rows:
        ratio = r["median_s"] / base
        mark = " (goal <= 1.5x missed)" if r["place"] == "disk" and ratio > GOAL_DISK_RATIO else ""
        body.append([r["place"], device.type, f"{r['device_bytes'] / 1e3:.1f}", f"{r['offloaded_bytes'] / 1e3:.1f}",
                     f"{r['peak_window_bytes'] / 1e3:.1f}", f"{r['window'] / 1e3:.1f}", f"{r['median_s'] * 1e3:.2f}", f"{ratio:.2f}x{mark}"])
    return header, body


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--dir", default=None, help="where the disk store's directory is made (default: the temp dir)")
    ap.add_argument("--out", default=str(results_path("offload")))
    args = ap.parse_args(argv)
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    sections = []
    for device in devices:
        header, body = table(measure(args, device), device)
        print(text_table(header, body))
        sections.append(md_table(header, body))
    notes = (
        f"\n\nModel: {args.layers}-layer GPT, width {args.width}, context 32, fp32 parameters; Muon for the "
        "block matrices (fp32 momentum), AdamW for embeddings, head and norms (fp32 exp_avg, exp_avg_sq). "
        f"{args.rounds} rounds after {args.warmup} warm-up steps, one step of each place per round in a "
        "rotating order; medians. State bytes count momentum and AdamW moments (the step scalars stay on the "
        "host in every place, as in torch). The fetch window is one parameter's state being updated plus the "
        "next one's being fetched; its peak is the most it held during any step, and the bound is the state of the two "
        "largest parameters. The disk store's file is under --dir (default: the temp directory, on the local disk "
        "here); nothing forces it out of the page cache, so with spare RAM its reads come from memory. On a CPU the 'device' is host "
        "memory as well, so the time column is the price of the copies in and out of the store (and, for disk, "
        "of the page cache behind the memory-mapped file); the byte columns are what would stay in GPU memory."
    )
    write_report(args.out, "Optimizer state offload: device-resident bytes and step time",
                 "\n\n".join(sections) + notes, script=__file__, argv=argv,
                 machine_note=f"Load average at the end: {load()} (the machine is shared).")


if __name__ == "__main__":
    main()
