"""Newton-Schulz time and orthogonality per schedule x form x dtype x shape, against the exact polar factor.

Schedules and forms are the registered ones (``muonlab.kernels.SCHEDULES``, ``muonlab.kernels.FORMS``).

For each configuration: median wall time of ``muonlab.newton_schulz`` (all configurations interleaved
round by round, so load from other jobs hits them alike), its FLOPs from ``ns_flops`` and the
achieved rate next to this CPU's measured matmul rate in the same dtype; and how orthogonal the
output O is: the range of its singular values, ||O - U V^T||_F / sqrt(m) against the exact polar
factor of the input (from an fp64 SVD) and ||O O^T - I||_F / sqrt(m), for m = min(rows, cols).
Batched shapes report the worst matrix for the range and the mean over the batch for the errors.

    python benchmarks/bench_newton_schulz.py              # what results/newton_schulz.md holds
    python benchmarks/bench_newton_schulz.py --repeats 3 --out /tmp/ns.md
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from muonlab.kernels import SCHEDULES, newton_schulz, ns_flops
from muonlab.kernels.config import FORM_NAMES
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import MatmulProbe, load  # noqa: E402
from _report import md_table, results_path, text_table, write_report  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_shape(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.lower().split("x"))


def orthogonality(O: torch.Tensor, polar: torch.Tensor) -> dict:
    """Singular value range (worst matrix) and mean polar / Gram errors, computed in fp64."""
    O = O.double().reshape(-1, *O.shape[-2:])
    polar = polar.reshape(-1, *polar.shape[-2:])
    if O.shape[-2] > O.shape[-1]:
        O, polar = O.mT, polar.mT
    m = O.shape[-2]
    sv = torch.linalg.svdvals(O)
    eye = torch.eye(m, dtype=O.dtype)
    polar_err = torch.linalg.matrix_norm(O - polar) / math.sqrt(m)
    gram_err = torch.linalg.matrix_norm(O @ O.mT - eye) / math.sqrt(m)
    return dict(sv_min=sv.min().item(), sv_max=sv.max().item(),
                polar_err=polar_err.mean().item(), gram_err=gram_err.mean().item())


def refusal_here(schedule: str, steps: int) -> str | None:
    """Why ``schedule`` can't run ``steps`` steps in every form and dtype of this benchmark on
    this device (its ValueError), or None."""
    try:
        for form in FORM_NAMES:
            for dtype in DTYPES.values():
                newton_schulz(torch.ones(2, 4), steps=steps, coefficients=schedule, dtype=dtype, form=form)
    except ValueError as err:
        return str(err)
    return None


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="256x256,256x1024,8x128x512")
    p.add_argument("--presets", default=",".join(SCHEDULES), help="schedule names, comma-separated")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--repeats", type=int, default=30, help="timed rounds (after --warmup rounds)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--matmul-n", type=int, default=1024)
    p.add_argument("--out", default=str(results_path("newton_schulz")))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    shapes = [parse_shape(s) for s in args.shapes.split(",")]
    # a schedule refuses (by name) the forms, dtypes and step counts where its output is not
    # bounded (cans: 16-bit iterates); the tables below compare every form and dtype, so such a
    # schedule is left out of this run, and said so
    refused = {p: why for p in args.presets.split(",") if (why := refusal_here(p, args.steps))}
    presets = [p for p in args.presets.split(",") if p not in refused]
    for p, why in refused.items():
        print(f"skipped {p}: {why}")
    load_start, t_start = load(), time.perf_counter()

    # Inputs: Gaussian matrices; their smallest singular values are tiny (square) or moderate
    # (rectangular), which is what separates the presets.
    gen = torch.Generator().manual_seed(0)
    inputs = {shape: torch.randn(*shape, generator=gen) for shape in shapes}
    polars = {}
    for shape, G in inputs.items():
        U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
        polars[shape] = U @ Vh

    configs = [(shape, preset, form, dname) for shape in shapes for preset in presets
               for form in FORM_NAMES for dname in DTYPES]

    def call(cfg):
        shape, preset, form, dname = cfg
        return newton_schulz(inputs[shape], steps=args.steps, coefficients=preset, dtype=DTYPES[dname], form=form)

    probe = MatmulProbe(args.matmul_n)
    times: dict[tuple, list[float]] = {cfg: [] for cfg in configs}
    for r in range(args.warmup + args.repeats):
        probe.probe(record=r >= args.warmup)
        # Rotate the order each round so no configuration always runs right after a given other.
        order = configs[r % len(configs):] + configs[: r % len(configs)]
        for cfg in order:
            t0 = time.perf_counter()
            call(cfg)
            dt = time.perf_counter() - t0
            if r >= args.warmup:
                times[cfg].append(dt)
    rates = {d: probe.rate(d) for d in DTYPES}

    rows, summary = [], {}
    for cfg in configs:
        shape, preset, form, dname = cfg
        med = statistics.median(times[cfg])
        flops = ns_flops(shape, steps=args.steps, form=form)
        gflops = flops / med / 1e9
        acc = orthogonality(call(cfg), polars[shape])
        summary[cfg] = dict(ms=1e3 * med, flops=flops, acc=acc)
        rows.append(["x".join(map(str, shape)), preset, form, dname, f"{1e3 * med:.2f}",
                     f"{flops / 1e9:.3f}", f"{gflops:.1f}", f"{100 * gflops / rates[dname]:.0f}%",
                     f"{acc['sv_min']:.3f}", f"{acc['sv_max']:.3f}", f"{acc['polar_err']:.3f}",
                     f"{acc['gram_err']:.3f}"])
    head = ["shape", "preset", "form", "dtype", "median ms", "GFLOP", "GFLOP/s", "of matmul",
            "sv min", "sv max", "||O-UV^T||/sqrt(m)", "||OO^T-I||/sqrt(m)"]

    # Gram vs plain, same preset/dtype/shape: time ratio and FLOP ratio.
    ratio_head = ["shape", "dtype", "preset", "plain ms", "gram ms", "time gram/plain",
                  "FLOPs gram/plain", "fp32 plain / bf16 plain time"]
    ratio_rows = []
    for shape in shapes:
        for dname in DTYPES:
            for preset in presets:
                pl, gr = summary[(shape, preset, "plain", dname)], summary[(shape, preset, "gram", dname)]
                f32, b16 = summary[(shape, preset, "plain", "fp32")], summary[(shape, preset, "plain", "bf16")]
                ratio_rows.append(["x".join(map(str, shape)), dname, preset, f"{pl['ms']:.2f}",
                                   f"{gr['ms']:.2f}", f"{gr['ms'] / pl['ms']:.2f}",
                                   f"{gr['flops'] / pl['flops']:.2f}", f"{f32['ms'] / b16['ms']:.2f}"])
    def geomean(xs):
        xs = list(xs)
        return math.exp(sum(math.log(x) for x in xs) / len(xs))

    gram_parts, flop_parts = [], []
    for shape in shapes:
        name = "x".join(map(str, shape))
        per_dtype = ", ".join(
            f"{dname} {geomean(summary[(shape, pr, 'gram', dname)]['ms'] / summary[(shape, pr, 'plain', dname)]['ms'] for pr in presets):.2f}"
            for dname in DTYPES)
        gram_parts.append(f"{name}: {per_dtype}")
        flop_parts.append(f"{name}: {ns_flops(shape, steps=args.steps, form='gram') / ns_flops(shape, steps=args.steps, form='plain'):.2f}")
    gram_txt, flop_txt = "; ".join(gram_parts), "; ".join(flop_parts)
    dtype_ratio = geomean(summary[(shape, pr, "plain", "fp32")]["ms"] / summary[(shape, pr, "plain", "bf16")]["ms"]
                          for shape in shapes for pr in presets)
    gram_acc = {d: max(abs(summary[(sh, pr, "gram", d)]["acc"]["polar_err"] - summary[(sh, pr, "plain", d)]["acc"]["polar_err"])
                       for sh in shapes for pr in presets) for d in DTYPES}
    dtype_verdict = "fp32 is faster on this CPU" if dtype_ratio < 1 else "bf16 is faster on this CPU"
    square = [("x".join(map(str, sh))) for sh in shapes if sh[-1] == sh[-2]]
    square_txt = ", ".join(square) if square else "square shapes"
    total_s = time.perf_counter() - t_start
    load_end = load()

    print(f"matmul {args.matmul_n}^3: fp32 {rates['fp32']:.1f} GFLOP/s, bf16 {rates['bf16']:.1f} GFLOP/s")
    print(text_table(head, rows))
    print()
    print(text_table(ratio_head, ratio_rows))

    conditions = f"""Shared with other jobs while this ran (load average {load_start} at the
start, {load_end} at the end on 2 cores), so absolute times are noisy; every configuration was
timed once per round, in a rotating order, for {args.repeats} rounds after {args.warmup} warm-up
rounds, and the table gives medians. Total wall time {total_s:.0f} s."""
    md = f"""Measured in the same run: `torch.matmul` {args.matmul_n}x{args.matmul_n}x{args.matmul_n} at
**{rates['fp32']:.1f} GFLOP/s in fp32** and **{rates['bf16']:.1f} GFLOP/s in bf16** (timed once per
round next to the configurations; median). "of matmul" is the achieved Newton-Schulz rate
(`ns_flops` / median time) as a fraction of that rate in the same dtype.

Input: a standard Gaussian matrix per shape (seed 0), {args.steps} steps, `eps=1e-7`, gram form
with the default restarts (after iteration 1 when it iterates in fp16, 2 in fp32 and fp64:
`DEFAULT_GRAM_RESTARTS`; a bf16 compute dtype iterates in fp16 on CUDA, fp32 on a CPU without fp16
matmul); time includes the cast to the compute dtype and the
normalisation, as in `newton_schulz`. Orthogonality, in fp64 on the output: singular value range
(worst matrix of a batch), ||O - U V^T||_F / sqrt(m) against the exact polar factor U V^T of the
input from an SVD, and ||O O^T - I||_F / sqrt(m) (m = the short side; batch: mean over matrices).

Schedules left out because they refuse a form or dtype compared here: {", ".join(refused) or "none"}.

## All configurations

{md_table(head, rows)}

## Gram vs plain, and fp32 vs bf16

{md_table(ratio_head, ratio_rows)}

## Reading it

- Orthogonality depends on the preset and the input's spectrum, hardly on form or dtype (compare
  rows that differ only in those). Keller's single quintic deliberately stops short of 1 (singular
  values spread over roughly [0.7, 1.2]; Keller Jordan's Muon post and torch.optim.Muon's
  docstring); the per-step presets (XTuner's; Polar Express, Amsel et al., 2025) land closer. A
  square Gaussian matrix has singular values near 0 that no preset lifts to 1 in {args.steps} steps:
  that is the low "sv min" on {square_txt}. Largest change of ||O - U V^T|| / sqrt(m) from the
  plain to the Gram form: {gram_acc['fp32']:.1e} in fp32, {gram_acc['bf16']:.1e} in bf16 (the Gram
  form iterates on R = X X^T, which drifts in low precision; see `newton_schulz`'s module doc).
- Gram vs plain, geometric mean of the time ratio over presets: {gram_txt}. The FLOP ratio from
  `ns_flops` is {flop_txt}: the Gram form pays only on rectangular matrices, and only where the
  matmuls are large enough for their FLOPs to dominate the time (the Gram form runs more, smaller
  m x m products).
- fp32 vs bf16, plain form, geometric mean of fp32 time / bf16 time over presets and shapes:
  {dtype_ratio:.2f} ({dtype_verdict}). This CPU's bf16 matmul rate is {rates['bf16'] / rates['fp32']:.2f}x its
  fp32 rate at {args.matmul_n}^3; on GPUs with bf16 tensor cores the balance is the other way.
"""
    print()
    write_report(args.out, "Newton-Schulz: time and orthogonality per preset, form and dtype", md,
                 script=__file__, argv=argv, machine_note=conditions)


if __name__ == "__main__":
    main()
