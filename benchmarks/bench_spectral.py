"""Overhead of spectral records (muonlab.trace.spectral) at one recorded step in k, on the small GPT.

Four configurations train their own copy of the same GPT on the same batches: muonlab's Muon (on the
hidden matrices, AdamW on the rest) and torch.optim.AdamW, each without and with a SpectralRecorder
(every k steps, all 2-D matrices). A round runs k steps of each configuration in a rotating order,
so every timed block holds exactly one recorded step and load from other jobs hits the
configurations alike; tables give medians over rounds.

Two measures of the overhead, as a fraction of a whole training step (forward, backward, optimizer):
the recorder's own time (its hooks, and the Newton-Schulz observer muonlab's Muon calls inside its
step), timed where it runs, per k steps, over the median step time without recording; and the
end-to-end difference of the paired blocks' medians (noisier: it is a difference of two noisy times).

    PYTHONPATH=. python benchmarks/bench_spectral.py --threads 1      # what results/spectral.md holds
    PYTHONPATH=. python benchmarks/bench_spectral.py --rounds 3 --out /tmp/spectral.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from muonlab.models import GPT, GPTConfig
from muonlab.train import make_optimizer
from muonlab.trace import SpectralRecorder

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import load  # noqa: E402
from _report import md_table, results_path, text_table, write_report  # noqa: E402


class Timed:
    """A callable's wall time, summed."""

    def __init__(self, fn):
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0


class Config:
    """One optimizer on its own model, with or without a recorder whose time is measured."""

    def __init__(self, name: str, record: bool, cfg: GPTConfig, every: int):
        torch.manual_seed(0)
        self.model = GPT(cfg)
        self.opt = make_optimizer(name, self.model, ns_dtype=torch.float32) if name == "muon" else \
            make_optimizer(name, self.model)
        self.label = f"{name} {'with' if record else 'without'} records"
        self.recorder_time = None
        if record:
            rec = SpectralRecorder(self.opt, self.model, every=every)
            rec.detach()  # registered again below, timed
            rec.observe_newton_schulz = self.observer = Timed(rec.observe_newton_schulz)
            self.pre, self.post = Timed(rec._pre_step), Timed(rec._post_step)
            rec._handles = [self.opt.register_step_pre_hook(self.pre), self.opt.register_step_post_hook(self.post)]
            self.recorder = rec
            self.recorder_time = lambda: self.pre.seconds + self.post.seconds + self.observer.seconds

    def run(self, batches) -> tuple[float, float]:
        """Seconds of these training steps, and of the recorder within them."""
        before = self.recorder_time() if self.recorder_time else 0.0
        t0 = time.perf_counter()
        for x in batches:
            loss = self.model(x, x)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
        total = time.perf_counter() - t0
        return total, (self.recorder_time() - before if self.recorder_time else 0.0)


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--out", default=str(results_path("spectral")))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = GPTConfig(d_model=args.d_model, n_layers=args.layers, n_heads=4, context=args.context)
    load_start, t_start = load(), time.time()
    configs = [Config(name, record, cfg, args.every) for name in ("muon", "adamw") for record in (False, True)]
    gen = torch.Generator().manual_seed(0)
    block_s = {c.label: [] for c in configs}
    recorder_s = {c.label: [] for c in configs}
    for r in range(args.warmup + args.rounds):
        batches = [torch.randint(0, 256, (args.batch, args.context), generator=gen) for _ in range(args.every)]
        for c in configs[r % len(configs):] + configs[:r % len(configs)]:
            total, rec = c.run(batches)
            if r >= args.warmup:
                block_s[c.label].append(total)
                recorder_s[c.label].append(rec)
    wall = time.time() - t_start
    k = args.every
    header = ["optimizer", "step ms, no records", f"step ms, records every {k}", "recorder ms per recorded step",
              "recorder share of a step (own time)", "end-to-end share (paired medians)"]
    rows = []
    for name in ("muon", "adamw"):
        base = statistics.median(block_s[f"{name} without records"]) / k
        withrec = statistics.median(block_s[f"{name} with records"]) / k
        own = statistics.median(recorder_s[f"{name} with records"])  # one recorded step per block
        rows.append([name, f"{1e3 * base:.1f}", f"{1e3 * withrec:.1f}", f"{1e3 * own:.2f}",
                     f"{100 * own / k / base:.2f}%", f"{100 * (withrec - base) / base:+.2f}%"])
    table = text_table(header, rows)
    print(table)
    matrices = len(configs[1].recorder.names)
    body = f"""Model: `GPTConfig(d_model={args.d_model}, n_layers={args.layers}, n_heads=4, context={args.context})`,
batch {args.batch}, random tokens; {matrices} recorded matrices (every 2-D parameter: embeddings, the blocks'
Linear weights, the head). muonlab's Muon with fp32 Newton-Schulz (`ns_dtype=torch.float32`) on the hidden
matrices, AdamW on the rest; torch.optim.AdamW on everything. Recorder defaults: 20 products
(Lanczos-refined power iteration) per weight at the first recorded step, then 3 warm-started ones, 6 per
update; the orthogonality error of every Muon matrix from a fixed sample of 64 rows of O O^T - I.

Torch threads: {torch.get_num_threads()} (the machine is shared; two threads per process under other jobs'
load made step times swing tenfold). Rounds: {args.warmup} warm-up, {args.rounds} timed; each round runs {k}
steps of each of the 4 configurations (rotating order), one of them recorded. Load average {load_start} at
the start, {load()} at the end; total wall time {wall:.0f} s.

{md_table(header, rows)}

"recorder share (own time)": the recorder's hooks plus Muon's calls of its Newton-Schulz observer, timed where
they run, per recorded step, divided by {k} and by the median step time without records. Goal: at most 2%
at k = {k}. "end-to-end share": the difference of the median block times with and without records (a
difference of two noisy medians: it can come out negative on a loaded machine).
"""
    return write_report(args.out, f"Spectral records: overhead at k = {k}", body, script=__file__, argv=argv)


if __name__ == "__main__":
    main()
