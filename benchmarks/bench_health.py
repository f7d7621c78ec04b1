"""What the update health check (muonlab.kernels.health) adds to a Muon step.

A GPT (``--d-model`` 256, ``--layers`` 4) and ``muon_param_groups`` (its block matrices on Muon,
the rest on AdamW), fixed random gradients. For each configuration two optimizers on copies of the
same parameters: one as shipped, one whose runner's check records nothing (``observe`` a no-op:
one method call per chunk is all that is left of it). Each round times one ``step()`` of each, in
alternating order (so load from other jobs hits them alike); the table gives medians and their
ratio. The ratio of two noisy medians can't resolve a cost of a fraction of a percent on a shared
machine, so the check's own time is also measured directly: the host seconds inside ``observe``
and ``end_step`` during the timed steps of the checked optimizer (on a CPU its kernels run
synchronously, so these are its compute time), over the step's median. On this project's
2-core machines with 2 torch threads, while other jobs loaded them, the first parallel op after a
bf16 matmul waited 6-10 ms for a core (whatever op it was: a sum, an add_; 0.1 ms with 1 thread):
the check's first norm then takes that wait from the update that would otherwise pay it, so its
own time overstates what it adds there; with 1 thread it is measured without the wait.

    python benchmarks/bench_health.py                    # what results/health.md holds
    python benchmarks/bench_health.py --steps 5 --out /tmp/health.md
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

import muonlab
from muonlab import muon_param_groups
from muonlab.kernels.health import UpdateHealth
from muonlab.models import GPT, GPTConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import load  # noqa: E402
from _report import md_table, results_path, text_table, write_report  # noqa: E402

# (label, parameter dtype, Muon's ns_dtype)
CONFIGS = [
    ("fp32 parameters, bf16 Newton-Schulz", torch.float32, torch.bfloat16),
    ("fp32 parameters, fp32 Newton-Schulz", torch.float32, torch.float32),
    ("bf16 parameters, bf16 Newton-Schulz", torch.bfloat16, torch.bfloat16),
]


class _Unchecked(UpdateHealth):
    """The check switched off: chunks pass by, nothing is recorded."""

    def observe(self, mats) -> None:
        pass


class _Timed(UpdateHealth):
    """The check as shipped, with the host seconds spent in it summed."""

    def __init__(self):
        super().__init__()
        self.seconds = 0.0

    def observe(self, mats) -> None:
        t0 = time.perf_counter()
        super().observe(mats)
        self.seconds += time.perf_counter() - t0

    def end_step(self) -> None:
        t0 = time.perf_counter()
        super().end_step()
        self.seconds += time.perf_counter() - t0


def _optimizer(model: torch.nn.Module, ns_dtype: torch.dtype, health: UpdateHealth) -> muonlab.Muon:
    opt = muonlab.Muon(muon_param_groups(model), lr=0.02, ns_dtype=ns_dtype)
    opt._ns_runner().health = health
    return opt


def measure(label: str, param_dtype: torch.dtype, ns_dtype: torch.dtype, steps: int, warmup: int,
            d_model: int, layers: int) -> list:
    torch.manual_seed(0)
    base = GPT(GPTConfig(d_model=d_model, n_layers=layers, n_heads=max(1, d_model // 64))).to(param_dtype)
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(p.shape, generator=gen).to(param_dtype) for p in base.parameters()]
    models = {"checked": base, "unchecked": copy.deepcopy(base)}
    timed = _Timed()
    opts = {"checked": _optimizer(models["checked"], ns_dtype, timed),
            "unchecked": _optimizer(models["unchecked"], ns_dtype, _Unchecked())}
    times: dict[str, list[float]] = {k: [] for k in opts}
    for step in range(warmup + steps):
        if step == warmup:
            timed.seconds = 0.0
        order = list(opts) if step % 2 == 0 else list(opts)[::-1]
        for key in order:
            for p, g in zip(models[key].parameters(), grads):
                p.grad = g.clone()
            t0 = time.perf_counter()
            opts[key].step()
            if step >= warmup:
                times[key].append(time.perf_counter() - t0)
    stats = opts["checked"].last_step_stats()
    checked, unchecked = (statistics.median(times[k]) for k in ("checked", "unchecked"))
    own = timed.seconds / steps
    return [label, stats["unhealthy_updates"], f"{stats['worst_update_ratio']:.3f}", f"{unchecked * 1e3:.1f}",
            f"{checked * 1e3:.1f}", f"{checked / unchecked:.4f}", f"{own * 1e6:.0f}", f"{own / unchecked:.3%}"]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="timed steps per optimizer and configuration")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", default=f"1,{torch.get_num_threads()}",
                        help="torch thread counts to run, comma-separated")
    parser.add_argument("--out", default=str(results_path("health")))
    args = parser.parse_args(argv)
    start_load, t0 = load(), time.perf_counter()
    header = ["torch threads", "configuration", "flagged (last step)", "worst ratio", "step ms without check (median)",
              "step ms with check (median)", "with / without", "check us per step", "check / step"]
    rows = []
    for threads in dict.fromkeys(int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        rows += [[threads, *measure(label, pd, nd, args.steps, args.warmup, args.d_model, args.layers)]
                 for label, pd, nd in CONFIGS]
    print(text_table(header, rows))
    note = (f"Load average {start_load} at the start, {load()} at the end; total wall time "
            f"{time.perf_counter() - t0:.0f} s.")
    body = (f"GPT(d_model={args.d_model}, n_layers={args.layers}), `muon_param_groups`, default Muon settings "
            f"but `ns_dtype`; {args.warmup} warm-up and {args.steps} timed steps per optimizer, alternating.\n\n"
            + md_table(header, rows)
            + "\n\n\"check us per step\": host time inside `observe` and `end_step` (synchronous kernels on a "
              "CPU), averaged over the timed steps; \"check / step\" divides it by the unchecked step's median. "
              "The ratio of medians carries the machine's noise, which on a shared 2-core machine is larger "
              "than the check. With 2 threads while other jobs loaded the machine, the first parallel op "
              "after a bf16 matmul waited 6-10 ms for a core whatever it was (an earlier run: 2-thread steps "
              "of 100-360 ms, the check's own time 4-5% of them, as its first norm took the wait the update "
              "would otherwise pay); where the 2-thread steps are far slower than the 1-thread ones, those "
              "rows measure the waits and the 1-thread rows the check.")
    write_report(args.out, "Update health check: its cost in a Muon step", body, script=__file__, argv=argv,
                 machine_note=note)


if __name__ == "__main__":
    main()
