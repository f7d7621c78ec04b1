"""Optimizer step time: muonlab.Muon (bf16/fp32 x plain/gram) vs torch.optim.Muon, in one process.

Two matrix sets (``--sets``, both by default):

gpt256: the compute-bound set. The parameters are the hidden matrices of a 12-layer, width-256 GPT (every Linear weight inside the
transformer blocks: qkv, attention output, MLP in and out; 48 matrices, 4 shapes). Each optimizer
gets its own copy of them and the same fixed random gradients. After warm-up steps, every round
times one ``step()`` of each configuration in a rotating order (so load from other jobs hits them
alike); the table gives medians. ``torch.matmul`` in bf16 and fp32 is measured in the same run, and
each configuration's Newton-Schulz FLOPs (``ns_flops`` with its form) per step give an achieved rate.

Accuracy: one fresh step of each configuration on one matrix of every shape; the applied update
(recovered from the parameter change) is compared with muonlab's fp32 plain Newton-Schulz of the
same momentum input and with the exact polar factor from an SVD.

small48: the host-bound set, the 48 hidden matrices of ``GPT(GPTConfig(d_model=8, n_layers=12,
n_heads=2))`` (24x8, 8x8, 32x8, 8x32 per layer; benchmarks/_sets.py), whose Newton-Schulz work is
tiny: a step's time is the optimizer's fixed host cost. torch.optim.Muon, muonlab defaults (twice:
the second copy, identical, is the run's noise floor) and muonlab defaults with
``nonfinite="ignore"`` (the safety checks' cost) step in alternating rounds in balanced orders
(benchmarks/_rounds.py), with ``torch.set_num_threads`` at each of ``--small-threads`` (1 first:
the figure the goal is judged on; see the results for why); ratios are medians of per-round
ratios with bootstrap intervals.

variants: the gpt256 matrices stepped by the update rules and add-ons of muonlab.Muon against its
defaults (NorMuon, ``update_rule="normuon"``; the skip decided on the device,
``nonfinite_decision="device"``), in alternating rounds in balanced orders; ratios are
medians of per-round ratios with bootstrap intervals.

qkclip: what QK-clip (muonlab.optim.qk_clip) adds to a training step of a GPT: the forward+backward
with the max-logit recording on against off, and ``QKClip.apply()`` (no head over tau; every head
clipped) against the Muon step it follows, per-round ratios in alternating rounds.

For the first two sets, "host time per matrix" is the step time divided by the number of matrices, with its
ratio to torch.optim.Muon's (the per-round ratio of the same steps).

    python benchmarks/bench_optimizer_step.py             # what results/optimizer_step.md holds
    python benchmarks/bench_optimizer_step.py --sets small48 --small-rounds 200 --out /tmp/small.md
    python benchmarks/bench_optimizer_step.py --sets gpt256 --layers 2 --repeats 3 --out /tmp/step.md
    python benchmarks/bench_optimizer_step.py --sets qkclip --qk-rounds 20   # results/optimizer_step_qkclip.md
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

import muonlab
from muonlab import muon_param_groups, newton_schulz, ns_flops
from muonlab.models import GPT, GPTConfig
from muonlab.kernels.config import NSConfig
from muonlab.kernels.newton_schulz import cpu_bf16_flags, resolve_dtype, resolve_form
from muonlab.optim import functional as F
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import MatmulProbe, load  # noqa: E402
from _report import md_table, results_path, text_table, write_report  # noqa: E402
from _rounds import balanced_orders, ratio_summary  # noqa: E402
from _sets import SMALL48, small48_matrices  # noqa: E402

LR, MOMENTUM, NS_STEPS = 0.02, 0.95, 5
KELLER = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's default, = muonlab's "keller" preset


def cpu_bf16_support() -> str:
    """Whether /proc/cpuinfo lists bf16 matmul instructions (AVX512_BF16 or AMX-BF16), in words."""
    found = cpu_bf16_flags()
    if found is None:
        return "CPU flags unknown"
    return f"the CPU lists {', '.join(found)}" if found else "the CPU lists neither avx512_bf16 nor amx_bf16"


# (label, factory(params) -> optimizer, NS dtype name, NS form as Muon's ns_form)
CONFIGS = [
    ("torch.optim.Muon (bf16, one matrix at a time)",
     lambda ps: torch.optim.Muon(ps, lr=LR, weight_decay=0.0, momentum=MOMENTUM, nesterov=True,
                                 ns_coefficients=KELLER, ns_steps=NS_STEPS, adjust_lr_fn="original"),
     "bf16", "plain"),
    ("muonlab bf16 plain",
     lambda ps: muonlab.Muon(ps, lr=LR, momentum=MOMENTUM, ns_dtype=torch.bfloat16, ns_form="plain",
                             ns_backend="torch"), "bf16", "plain"),
    ("muonlab bf16 gram",
     lambda ps: muonlab.Muon(ps, lr=LR, momentum=MOMENTUM, ns_dtype=torch.bfloat16, ns_form="gram",
                             ns_backend="torch"), "bf16", "gram"),
    ("muonlab fp32 plain",
     lambda ps: muonlab.Muon(ps, lr=LR, momentum=MOMENTUM, ns_dtype=torch.float32, ns_form="plain",
                             ns_backend="torch"), "fp32", "plain"),
    ("muonlab fp32 gram",
     lambda ps: muonlab.Muon(ps, lr=LR, momentum=MOMENTUM, ns_dtype=torch.float32, ns_form="gram",
                             ns_backend="torch"), "fp32", "gram"),
    # what a user gets: ns_dtype="auto" is bf16 on a CPU with native bf16 matmul, else fp32
    ("muonlab defaults", lambda ps: muonlab.Muon(ps, lr=LR, momentum=MOMENTUM),
     "bf16" if resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16 else "fp32", "auto"),
    # the same without the safety checks (no non-finite check): their cost is the difference
    ("muonlab defaults, nonfinite=\"ignore\"",
     lambda ps: muonlab.Muon(ps, lr=LR, momentum=MOMENTUM, nonfinite="ignore"),
     "bf16" if resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16 else "fp32", "auto"),
]
TORCH_LABEL, DEFAULTS_LABEL, IGNORE_LABEL = CONFIGS[0][0], "muonlab defaults", CONFIGS[-1][0]
SETS = ("gpt256", "small48", "variants", "qkclip")


def hidden_matrices(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every Linear weight inside the transformer blocks (the matrices Muon is meant for)."""
    out = []
    for name, module in model.named_modules():
        if name.startswith("blocks.") and isinstance(module, nn.Linear):
            out.append((f"{name}.weight", module.weight))
    return out


def applied_update(factory, weight: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The orthogonalized update one fresh step applies, read off a zero parameter with lr 1.

    Starting from zero with lr 1 (no weight decay), the parameter after the step is exactly
    -ratio * O, so O is recovered without the rounding of a small change to a large weight.
    """
    p = nn.Parameter(torch.zeros_like(weight))
    p.grad = grad.clone()
    opt = factory([p])
    for group in opt.param_groups:
        group["lr"] = 1.0
    opt.step()
    ratio = F.adjust_lr_ratio(p.shape, "original")
    return -p.detach().double() / ratio


def gpt256_report(args) -> tuple[str, list]:
    """The compute-bound set's sections (markdown) and its rows of the host-time-per-matrix table."""
    torch.set_num_threads(args.threads)
    load_start, t_start = load(), time.perf_counter()

    torch.manual_seed(0)
    cfg = GPTConfig(d_model=args.width, n_layers=args.layers, n_heads=4, context=64)
    model = GPT(cfg)
    hidden = hidden_matrices(model)
    routed = {n for r in muon_param_groups(model).routes if r.algorithm == "muon" for n in [r.name]}
    not_routed = [n for n, _ in hidden if n not in routed]
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(p.shape, generator=gen) * 1e-2 for _, p in hidden]
    shapes: dict[tuple[int, int], int] = {}
    for _, p in hidden:
        shapes[tuple(p.shape)] = shapes.get(tuple(p.shape), 0) + 1

    # One parameter copy per configuration, all with the same values and gradients.
    runs = []
    for label, factory, dname, form in CONFIGS:
        params = [nn.Parameter(p.detach().clone()) for _, p in hidden]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        dtype = torch.bfloat16 if dname == "bf16" else torch.float32  # the form "auto" takes follows dtype and device
        flops = sum(ns_flops(p.shape, NSConfig(steps=NS_STEPS, **resolve_form(form, dtype, "cpu"))) for p in params)
        runs.append(dict(label=label, opt=factory(params), dtype=dname, form=form, flops=flops, times=[]))

    probe = MatmulProbe(args.matmul_n)
    orders = balanced_orders(len(runs))
    for r in range(args.warmup + args.repeats):
        probe.probe(record=r >= args.warmup)
        order = [runs[i] for i in orders[r % len(orders)]]
        for run in order:
            t0 = time.perf_counter()
            run["opt"].step()
            dt = time.perf_counter() - t0
            if r >= args.warmup:
                run["times"].append(dt)
        print(f"round {r + 1}/{args.warmup + args.repeats}: "
              + ", ".join(f"{1e3 * run['times'][-1]:.0f}" if run["times"] else "warm-up" for run in runs)
              + " ms", flush=True)
    rates = {d: probe.rate(d) for d in ("fp32", "bf16")}

    # ---------------------------------------------------------------- accuracy on one matrix per shape
    acc = {run["label"]: {} for run in runs}
    first_of_shape = {}
    for (name, p), g in zip(hidden, grads):
        first_of_shape.setdefault(tuple(p.shape), (name, p, g))
    for shape, (name, p, g) in first_of_shape.items():
        buf = torch.zeros_like(g)
        (inp,) = F.muon_momentum_([g], [buf], momentum=MOMENTUM, nesterov=True, form="ema")
        ref = newton_schulz(inp, steps=NS_STEPS, coefficients="keller", dtype=torch.float32, form="plain").double()
        U, _, Vh = torch.linalg.svd(inp.double(), full_matrices=False)
        polar = U @ Vh
        m = min(shape)
        for (label, factory, _, _), run in zip(CONFIGS, runs):
            O = applied_update(factory, p, g)
            sv = torch.linalg.svdvals(O)
            acc[label][shape] = dict(
                rel_ref=(torch.linalg.matrix_norm(O - ref) / torch.linalg.matrix_norm(ref)).item(),
                sv_min=sv.min().item(), sv_max=sv.max().item(),
                polar=(torch.linalg.matrix_norm(O - polar) / math.sqrt(m)).item(),
            )
    total_s = time.perf_counter() - t_start
    load_end = load()

    # ---------------------------------------------------------------- tables
    base = statistics.median(runs[0]["times"])
    base_min = min(runs[0]["times"])
    head = ["configuration", "median step ms", "min..max ms", "speed-up vs torch.optim.Muon",
            "speed-up from min times",
            "NS GFLOP/step", "achieved GFLOP/s", "of matmul rate (same dtype)"]
    rows = []
    for run in runs:
        med = statistics.median(run["times"])
        rate = run["flops"] / med / 1e9
        rows.append([run["label"], f"{1e3 * med:.0f}", f"{1e3 * min(run['times']):.0f}..{1e3 * max(run['times']):.0f}",
                     f"{base / med:.2f}x", f"{base_min / min(run['times']):.2f}x",
                     f"{run['flops'] / 1e9:.1f}", f"{rate:.1f}",
                     f"{100 * rate / rates[run['dtype']]:.0f}% of {rates[run['dtype']]:.1f} ({run['dtype']})"])
    med = {run["label"]: statistics.median(run["times"]) for run in runs}
    labels = [run["label"] for run in runs]
    flops = {run["label"]: run["flops"] for run in runs}
    decomp = [
        ["batching same-shape matrices (torch.optim.Muon -> muonlab bf16 plain; same FLOPs, same dtype)",
         f"{med[labels[0]] / med[labels[1]]:.2f}x", "1.00x"],
        ["Gram form in bf16 (muonlab bf16 plain -> bf16 gram)",
         f"{med[labels[1]] / med[labels[2]]:.2f}x", f"{flops[labels[1]] / flops[labels[2]]:.2f}x"],
        ["fp32 instead of bf16 (muonlab bf16 plain -> fp32 plain; same FLOPs)",
         f"{med[labels[1]] / med[labels[3]]:.2f}x", "1.00x"],
        ["Gram form in fp32 (muonlab fp32 plain -> fp32 gram)",
         f"{med[labels[3]] / med[labels[4]]:.2f}x", f"{flops[labels[3]] / flops[labels[4]]:.2f}x"],
        [f"matmul rate fp32 / bf16 ({args.matmul_n}^3, this CPU)", f"{rates['fp32'] / rates['bf16']:.2f}x", ""],
    ]
    decomp_head = ["step", "measured time ratio", "FLOP ratio (ns_flops)"]

    bf16_isa = cpu_bf16_support()
    speedup = {label: med[labels[0]] / med[label] for label in labels}
    best_label = max(labels[1:-1], key=lambda label: speedup[label])
    bf16_best = max(labels[1:3], key=lambda label: speedup[label])
    goal = "meets" if speedup[best_label] >= 2 else "misses"
    head_line = (f"The issue's goal is at least 2x over torch.optim.Muon. The fastest configuration here, "
                 f"{best_label}, is {speedup[best_label]:.2f}x, which {goal} it; muonlab defaults are "
                 f"{speedup['muonlab defaults']:.2f}x. ")
    if rates["bf16"] < rates["fp32"]:
        dtype_line = (
            f"On this CPU most of that comes from the dtype: bf16 matmuls run at "
            f"1/{rates['fp32'] / rates['bf16']:.1f} of the fp32 rate ({bf16_isa}), so the same FLOPs in fp32 "
            f"take 1/{med[labels[1]] / med[labels[3]]:.1f} of the time, and `ns_dtype=\"auto\"` computes in "
            "fp32 here. That part does not carry over to GPUs, where bf16 is the fast dtype. ")
    else:
        dtype_line = (
            f"On this CPU bf16 matmuls run at {rates['bf16'] / rates['fp32']:.1f}x the fp32 rate ({bf16_isa}), "
            "so `ns_dtype=\"auto\"` computes in bf16 like torch.optim.Muon, and the speed-up is muonlab's own "
            "(batching, and the step's fewer passes over memory); the defaults also pay the non-finite check "
            "(one fused pass over every grad), which torch.optim.Muon does not make. ")
    verdict = head_line + dtype_line + (
        f"The Gram form does "
        f"{flops[labels[1]] / flops[labels[2]]:.2f}x fewer Newton-Schulz FLOPs on these shapes "
        f"(`ns_flops`; it saves on the rectangular qkv and MLP matrices; the square attention output "
        f"runs in the plain form), measured {med[labels[1]] / med[labels[2]]:.2f}x in bf16 and "
        f"{med[labels[3]] / med[labels[4]]:.2f}x in fp32; batching the {args.layers} same-shape matrices per "
        f"shape gives {med[labels[0]] / med[labels[1]]:.2f}x at these sizes. Like for like in bf16 "
        f"(the dtype torch.optim.Muon uses), muonlab's best is {bf16_best} at "
        f"{speedup[bf16_best]:.2f}x."
    )
    def worst(label: str) -> float:
        return max(v["rel_ref"] for v in acc[label].values())

    shape_list = list(first_of_shape)
    acc_head = ["configuration"] + [f"{s[0]}x{s[1]}: rel. diff vs fp32 plain" for s in shape_list] + \
               ["sv range (all shapes)", "max ||O-UV^T||_F/sqrt(m)"]
    acc_rows = []
    for label in labels:
        a = acc[label]
        acc_rows.append([label] + [f"{a[s]['rel_ref']:.2e}" for s in shape_list]
                        + [f"[{min(v['sv_min'] for v in a.values()):.3f}, {max(v['sv_max'] for v in a.values()):.3f}]",
                           f"{max(v['polar'] for v in a.values()):.3f}"])

    print()
    print(text_table(head, rows))
    print()
    print(text_table(decomp_head, decomp))
    print()
    print(text_table(acc_head, acc_rows))

    shape_txt = ", ".join(f"{n} x {s[0]}x{s[1]}" for s, n in shapes.items())
    routing_note = (
        f"`muon_param_groups` on this model routes {len(hidden) - len(not_routed)} of these {len(hidden)} "
        f"to Muon: it sends {', '.join(sorted(not_routed)[:2])}, ... ({len(not_routed)} matrices) to AdamW "
        "as an \"output head (shaped like the embedding)\", because they happen to have the token "
        "embedding's shape; they are hidden matrices, so they are benchmarked here."
        if not_routed else "`muon_param_groups` routes all of them to Muon.")
    conditions = f"""The compute-bound set (gpt256), at {args.threads} torch threads. Shared with other jobs while
this ran (load average {load_start} at the start, {load_end} at the end, on 2 cores), so absolute times
are noisy; the configurations were timed in rounds in one process (one step each per round, in
balanced orders: each follows every other equally often; {args.warmup} warm-up rounds,
{args.repeats} timed rounds) and the ratios come from medians of the same rounds. Total wall time
{total_s:.0f} s."""
    md = f"""Parameters: the hidden matrices of `GPT(GPTConfig(d_model={args.width}, n_layers={args.layers}))`,
i.e. every Linear weight inside the blocks: {len(hidden)} matrices ({shape_txt}), fp32, fixed
random gradients. {routing_note} All configurations: lr {LR}, momentum {MOMENTUM} Nesterov, {NS_STEPS}
Newton-Schulz steps with Keller's coefficients {KELLER}, lr scaled by sqrt(max(1, rows/cols)),
no weight decay. torch.optim.Muon runs Newton-Schulz in bf16 on one matrix at a time; muonlab.Muon
stacks same-shape matrices ({len(shapes)} batched chains) and takes `ns_dtype` / `ns_form`.

Measured in the same run: `torch.matmul` {args.matmul_n}^3 at {rates['fp32']:.1f} GFLOP/s (fp32) and
{rates['bf16']:.1f} GFLOP/s (bf16), timed once per round next to the configurations (median).

## Step time

{md_table(head, rows)}

"Speed-up" is the ratio of medians (the figure to quote); "from min times" is the ratio of each
configuration's fastest round, the least disturbed by other jobs, as a check on the medians. Under
heavy load from other jobs, torch.optim.Muon's loop over 48 matrices (many short multi-threaded
matmuls) slowed down much more than the 4 batched chains in earlier runs of this script, which
inflates the medians' speed-ups; when the two columns disagree a lot, the run was disturbed.
"NS GFLOP/step" is `sum(ns_flops(shape, steps={NS_STEPS}, form=...))` over the matrices, with the form
each configuration runs (torch.optim.Muon's iteration is the plain form; muonlab's defaults take
`ns_form="auto"`: the gram form where it saves at least 20% of the FLOPs). "Achieved GFLOP/s"
divides it by the whole step's median time (momentum and the parameter update included), so it is
a lower bound on the Newton-Schulz rate.

## Where the time goes

{md_table(decomp_head, decomp)}

{verdict}

## Orthogonality is kept

One fresh step of each configuration on the first matrix of each shape; O is the applied update
(read off a zero parameter stepped with lr 1), compared with muonlab's fp32 plain Newton-Schulz of the same
momentum input, and with the exact polar factor U V^T of that input (SVD, fp64).

{md_table(acc_head, acc_rows)}

The gradients are random Gaussian, so the square matrices start with singular values near 0 that 5
steps do not lift ("sv min"). Singular value range and polar error are the same for every
configuration up to rounding: their spread comes from Keller's coefficients, which deliberately do
not converge to 1 (Keller Jordan's Muon post; torch.optim.Muon's docstring), not from dtype or form.
Against the fp32 plain reference, bf16 plain differs by at most {worst(labels[1]):.1e} (bf16 keeps 8
mantissa bits), bf16 Gram by at most {worst(labels[2]):.1e} (rounding in R = X X^T carries through
the Gram iteration), fp32 Gram by at most {worst(labels[4]):.1e}.
"""
    per_matrix = per_matrix_rows(
        f"gpt256, {args.threads} thread{'s' * (args.threads > 1)}", len(hidden),
        {label: run["times"] for label, run in zip(labels, runs)})
    return conditions + "\n\n" + md, per_matrix


PER_MATRIX_HEAD = ["set, threads", "configuration", "median step ms", "host time per matrix us",
                   "time / torch.optim.Muon (median of rounds)", "95% interval (bootstrap)",
                   "median-of-rounds ratio to muonlab defaults"]


def per_matrix_rows(set_label: str, num_matrices: int, times: dict[str, list[float]]) -> list[list]:
    """Rows of PER_MATRIX_HEAD for torch.optim.Muon and the muonlab configurations given, from
    per-round step times (round i of every configuration measured in the same round)."""
    rows = []
    base, ours = times[TORCH_LABEL], times[DEFAULTS_LABEL]
    for label, t in times.items():
        if label != TORCH_LABEL and not label.startswith("muonlab defaults"):
            continue
        med, low, high, _ = ratio_summary(t, base)
        to_ours = ratio_summary(t, ours)[0]
        rows.append([set_label, label, f"{1e3 * statistics.median(t):.2f}",
                     f"{1e6 * statistics.median(t) / num_matrices:.1f}", f"{med:.3f}", f"{low:.3f}-{high:.3f}",
                     f"{to_ours:.3f}"])
    return rows


def small48_factories() -> dict:
    """torch.optim.Muon as in CONFIGS, muonlab defaults twice (an A/A pair: the noise floor) and
    muonlab defaults with nonfinite="ignore"."""
    by_label = {label: factory for label, factory, _, _ in CONFIGS}
    return {TORCH_LABEL: by_label[TORCH_LABEL], DEFAULTS_LABEL: by_label[DEFAULTS_LABEL],
            "muonlab defaults (again)": by_label[DEFAULTS_LABEL], IGNORE_LABEL: by_label[IGNORE_LABEL]}


def small48_rounds(threads: int, rounds: int, warmup: int) -> tuple[dict[str, list[float]], float]:
    """Step times per configuration and round, every configuration stepped once per round in
    balanced orders, at ``threads`` torch threads; and the wall seconds it took."""
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    matrices = small48_matrices()
    gen = torch.Generator().manual_seed(1)
    values = [torch.randn(shape, generator=gen) * 0.3 for _, shape in matrices]
    grads = [torch.randn(shape, generator=gen) * 1e-2 for _, shape in matrices]
    opts = {}
    for label, factory in small48_factories().items():
        params = [nn.Parameter(v.clone()) for v in values]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opts[label] = factory(params)
    return stepped_rounds(opts, rounds, warmup), time.perf_counter() - t0


def stepped_rounds(opts: dict, rounds: int, warmup: int) -> dict[str, list[float]]:
    """Each optimizer's step seconds per timed round: every round steps each once, in balanced
    orders (each follows every other equally often), after ``warmup`` untimed rounds."""
    labels = list(opts)
    orders = balanced_orders(len(labels))
    times = {label: [] for label in labels}
    for r in range(warmup + rounds):
        for i in orders[r % len(orders)]:
            t = time.perf_counter()
            opts[labels[i]].step()
            if r >= warmup:
                times[labels[i]].append(time.perf_counter() - t)
    return times


def small48_report(args) -> tuple[str, list, dict]:
    """The host-bound set's section, its rows of the host-time-per-matrix table, and the goal's
    figures (at the first thread count)."""
    load_start = load()
    matrices = small48_matrices()
    shapes: dict[tuple[int, int], int] = {}
    for _, s in matrices:
        shapes[s] = shapes.get(s, 0) + 1
    rows, walls, goal = [], [], {}
    for n, threads in enumerate(args.small_threads):
        times, wall = small48_rounds(threads, args.small_rounds if n == 0 else args.small_rounds_more_threads,
                                     args.small_warmup)
        walls.append(f"{wall:.0f} s at {threads} thread{'s' * (threads > 1)}")
        rows += per_matrix_rows(f"small48, {threads} thread{'s' * (threads > 1)}", len(matrices), times)
        if not goal:
            med, low, high, _ = ratio_summary(times[DEFAULTS_LABEL], times[TORCH_LABEL])
            again = ratio_summary(times["muonlab defaults (again)"], times[DEFAULTS_LABEL])[:3]
            ignore = ratio_summary(times[IGNORE_LABEL], times[DEFAULTS_LABEL])[:3]
            goal = dict(threads=threads, ratio=(med, low, high), again=again, ignore=ignore,
                        ms={k: 1e3 * statistics.median(v) for k, v in times.items()})
        print(text_table(PER_MATRIX_HEAD, rows[-len(times):]), flush=True)
    torch.set_num_threads(args.threads)
    med, low, high = goal["ratio"]
    verdict = ("meets" if high <= 1.0 else "misses" if low > 1.0 else
               "is within this run's noise of")
    shape_txt = ", ".join(f"{n} x {s[0]}x{s[1]}" for s, n in shapes.items())
    threads_txt = ", ".join(map(str, args.small_threads))
    md = f"""## The host-bound set (small48)

Parameters: the {len(matrices)} hidden matrices of `GPT(GPTConfig(d_model={SMALL48['d_model']}, n_layers={SMALL48['n_layers']}, n_heads={SMALL48['n_heads']}))` ({shape_txt}; `muon_param_groups` routes every one of them to Muon), fp32, fixed random gradients, the same settings as above. Newton-Schulz on these shapes is a few thousand FLOPs per matrix, so a step's time is the optimizer's fixed host cost: per step (validation, agreement, the non-finite check, planning) and per matrix or batch (dispatching each tensor operation). torch.optim.Muon, muonlab defaults twice (an A/A pair: the second copy's ratio to the first is this run's noise floor) and muonlab defaults with `nonfinite="ignore"` (without the safety checks) each step once per round, in balanced orders (each follows every other equally often), {args.small_warmup} warm-up rounds then {args.small_rounds} timed rounds at {args.small_threads[0]} thread{'s' * (args.small_threads[0] > 1)} (other thread counts: {threads_txt}); the ratios are medians of per-round ratios with 95% bootstrap intervals. Load average {load_start} before, {load()} after; {'; '.join(walls)}.

Threads: the goal is judged at {goal['threads']} thread{'s' * (goal['threads'] > 1)} (`torch.set_num_threads({goal['threads']})`). On matrices of 8 to 32 rows, torch's intra-op parallelism has nothing to split: a second thread only adds the cost of waking it and waiting for it on every small operation, and on this 2-core machine shared with other jobs that wait is long and erratic (the 2-thread rows below: slower and noisier for every optimizer). A process that steps a model this small would run with one thread (as every distributed worker here does: one thread per rank), so one thread measures the host cost itself rather than the thread pool's handoffs under load. The 2-thread rows (torch's default here; {args.small_rounds_more_threads} rounds) are kept beside it for comparison: the small48 rows of the table above.

Goal (one process, {len(matrices)} small matrices, safety checks on): muonlab defaults' step time at most 1.0x torch.optim.Muon's. Measured at {goal['threads']} thread{'s' * (goal['threads'] > 1)}: {med:.3f}x ({low:.3f}-{high:.3f}), {goal['ms'][DEFAULTS_LABEL]:.2f} ms against {goal['ms'][TORCH_LABEL]:.2f} ms, which {verdict} it. The safety checks' cost: `nonfinite="ignore"` over the defaults {goal['ignore'][0]:.3f} ({goal['ignore'][1]:.3f}-{goal['ignore'][2]:.3f}); the A/A pair {goal['again'][0]:.3f} ({goal['again'][1]:.3f}-{goal['again'][2]:.3f}).
"""
    return md, rows, goal


VARIANTS = {
    "muonlab defaults": {},
    "muonlab defaults (again)": {},
    "NorMuon (update_rule=\"normuon\")": dict(update_rule="normuon"),
    "skip decided on the device (nonfinite_decision=\"device\")": dict(nonfinite_decision="device"),
}
"""Each variant's Muon options over the defaults (the second copy of the defaults: the noise floor)."""


def variants_report(args) -> str:
    """The variants set's section: each variant's step time against the defaults'."""
    torch.set_num_threads(args.threads)
    load_start, t0 = load(), time.perf_counter()
    torch.manual_seed(0)
    hidden = hidden_matrices(GPT(GPTConfig(d_model=args.width, n_layers=args.layers, n_heads=4, context=64)))
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(p.shape, generator=gen) * 1e-2 for _, p in hidden]
    opts = {}
    for label, options in VARIANTS.items():
        params = [nn.Parameter(p.detach().clone()) for _, p in hidden]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opts[label] = muonlab.Muon(params, lr=LR, momentum=MOMENTUM, **options)
    times = stepped_rounds(opts, args.variant_rounds, args.variant_warmup)
    labels = list(times)
    base = times[labels[0]]
    head = ["configuration", "median step ms", "time / muonlab defaults (median of rounds)", "95% interval (bootstrap)"]
    rows = []
    for label in labels:
        med, low, high, _ = ratio_summary(times[label], base)
        rows.append([label, f"{1e3 * statistics.median(times[label]):.1f}", f"{med:.3f}", f"{low:.3f}-{high:.3f}"])
    print(text_table(head, rows), flush=True)
    normuon = ratio_summary(times[labels[2]], base)[:3]
    verdict = "meets" if normuon[2] <= 1.1 else "misses" if normuon[1] > 1.1 else "is within this run's noise of"
    return f"""## Variants (the gpt256 matrices)

The {len(hidden)} hidden matrices of `GPT(GPTConfig(d_model={args.width}, n_layers={args.layers}, n_heads=4))` (as in gpt256), fixed random gradients, each variant with its own copy, every one stepped once per round in balanced orders; {args.variant_warmup} warm-up rounds, then {args.variant_rounds} timed rounds at {args.threads} threads. Load average {load_start} before, {load()} after; {time.perf_counter() - t0:.0f} s.

{md_table(head, rows)}

Goal: NorMuon's step at most 1.1x Muon's. Measured {normuon[0]:.3f}x ({normuon[1]:.3f}-{normuon[2]:.3f}), which {verdict} it. NorMuon adds per matrix one pass over its update (the row sums of squares) and a row vector of state; its row scales ride on the update's add (one `addcmul_`); on one process no collective.

The skip decided on the device (`nonfinite_decision="device"`, muonlab.optim.step_gate) reads nothing on the host but pays for its masked writes: per matrix a `where` over the grad the momentum reads (and with weight decay one over the decayed parameter), a masked fill of the update, and AdamW's new values computed apart and committed. On a CPU the host decision's read costs nothing, so this row is the masking's price alone; on a GPU it buys a step without a synchronisation.
"""


def qkclip_rounds(args) -> tuple[dict[str, list[float]], dict]:
    """Per-round times of: forward+backward with recording off and on (in alternating order), the
    Muon step, QKClip.apply() with no head over tau and with every head clipped."""
    from muonlab.optim.qk_clip import QKClip

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = GPTConfig(d_model=args.qk_width, n_layers=args.qk_layers, n_heads=args.qk_heads, context=args.qk_context)
    model = GPT(cfg)
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (args.qk_batch, cfg.context + 1), generator=gen)
    opt = muonlab.Muon(muon_param_groups(model), lr=LR, momentum=MOMENTUM)
    tau = 100.0
    watch, clip = QKClip(model, tau=math.inf), QKClip(model, tau=tau)
    attns = [h.module for h in clip.heads]
    times = {k: [] for k in ("off", "on", "step", "apply_none", "apply_all")}

    def fwd_bwd(recording: bool) -> float:
        for a in attns:
            a.qk_recording = recording
        t = time.perf_counter()
        model(x[:, :-1], x[:, 1:]).backward()
        return time.perf_counter() - t

    for r in range(args.qk_warmup + args.qk_rounds):
        order = ("off", "on") if r % 2 == 0 else ("on", "off")
        got = {}
        for which in order:
            opt.zero_grad(set_to_none=True)
            got[which] = fwd_bwd(which == "on")
        t = time.perf_counter()
        opt.step()
        got["step"] = time.perf_counter() - t
        t = time.perf_counter()
        watch.apply()  # tau = inf: reads the maxima, clips nothing
        got["apply_none"] = time.perf_counter() - t
        for a in attns:  # every head just over tau: all q and k rows scaled (by 0.9999)
            a.qk_max_logit = torch.full((cfg.n_heads,), tau / 0.9999)
        t = time.perf_counter()
        clip.apply()
        got["apply_all"] = time.perf_counter() - t
        if r >= args.qk_warmup:
            for k, v in got.items():
                times[k].append(v)
    watch.close()
    clip.close()
    assert all(s.clipped_heads == cfg.n_layers * cfg.n_heads for s in clip.history)
    return times, dict(cfg=cfg, batch=args.qk_batch)


def qkclip_report(args) -> str:
    load_start, t0 = load(), time.perf_counter()
    times, info = qkclip_rounds(args)
    cfg = info["cfg"]
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    rows = [["forward+backward, recording off", f"{ms['off']:.2f}", "", ""]]
    for label, key, base, base_label in (
            ("forward+backward, recording on", "on", "off", "recording off"),
            ("Muon step", "step", None, ""),
            ("QKClip.apply(), no head over tau", "apply_none", "step", "Muon step"),
            ("QKClip.apply(), every head clipped", "apply_all", "step", "Muon step")):
        if base is None:
            rows.append([label, f"{ms[key]:.2f}", "", ""])
            continue
        med, low, high, _ = ratio_summary(times[key], times[base])
        rows.append([label, f"{ms[key]:.2f}", base_label, f"{med:.3f} ({low:.3f}-{high:.3f})"])
    per_step = [on - off + a for on, off, a in zip(times["on"], times["off"], times["apply_all"])]
    whole = [off + s for off, s in zip(times["off"], times["step"])]
    share = statistics.median([p / w for p, w in zip(per_step, whole)])
    head = ["what", "ms (median)", "per-round ratio to", "ratio (95% CI)"]
    print(text_table(head, rows), flush=True)
    return f"""## QK-clip's cost per step (qkclip)

Model: `GPT(GPTConfig(d_model={cfg.d_model}, n_layers={cfg.n_layers}, n_heads={cfg.n_heads}, context={cfg.context}))`, fp32, batch {info['batch']} x {cfg.context} tokens, muonlab.Muon defaults on its hidden matrices, {args.threads} torch threads, one process. Each round runs forward+backward with the max-logit recording off and on (alternating which goes first), the Muon step, `QKClip.apply()` with tau = inf (the maxima read and reset, nothing clipped) and `QKClip.apply()` with every head just over tau (every q and k row of every layer scaled: the most it does); {args.qk_warmup} warm-up rounds, then {args.qk_rounds} timed. Ratios are medians of per-round ratios with 95% bootstrap intervals. Load average {load_start} before, {load()} after; {time.perf_counter() - t0:.0f} s.

{md_table(head, rows)}

QK-clip's whole cost per step (the recording's extra forward time plus apply with every head clipped) is {100 * share:.1f}% of a step without it (forward+backward plus the Muon step), median over rounds. The recording recomputes each layer's q k^T in fp32 under no_grad (scaled_dot_product_attention does not return its logits), so its cost grows with the context like attention's own.
"""


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sets", nargs="+", choices=SETS, default=list(SETS))
    ap.add_argument("--layers", type=int, default=12, help="gpt256: layers")
    ap.add_argument("--width", type=int, default=256, help="gpt256: width")
    ap.add_argument("--warmup", type=int, default=2, help="gpt256: warm-up rounds")
    ap.add_argument("--repeats", type=int, default=15, help="gpt256: timed rounds (one step per configuration)")
    ap.add_argument("--threads", type=int, default=2, help="gpt256: torch threads")
    ap.add_argument("--matmul-n", type=int, default=1024)
    ap.add_argument("--small-threads", type=int, nargs="+", default=[1, 2],
                    help="small48: torch threads, one pass each (the first is the goal's)")
    ap.add_argument("--small-rounds", type=int, default=600, help="small48: timed rounds at the first thread count")
    ap.add_argument("--small-rounds-more-threads", type=int, default=150,
                    help="small48: timed rounds at the other thread counts (slow and noisy under load)")
    ap.add_argument("--small-warmup", type=int, default=20, help="small48: warm-up rounds")
    ap.add_argument("--variant-rounds", type=int, default=40, help="variants: timed rounds")
    ap.add_argument("--variant-warmup", type=int, default=3, help="variants: warm-up rounds")
    ap.add_argument("--qk-width", type=int, default=256, help="qkclip: the GPT's d_model")
    ap.add_argument("--qk-layers", type=int, default=4, help="qkclip: layers")
    ap.add_argument("--qk-heads", type=int, default=4, help="qkclip: attention heads")
    ap.add_argument("--qk-context", type=int, default=128, help="qkclip: context (tokens per row)")
    ap.add_argument("--qk-batch", type=int, default=8, help="qkclip: rows per batch")
    ap.add_argument("--qk-rounds", type=int, default=20, help="qkclip: timed rounds")
    ap.add_argument("--qk-warmup", type=int, default=3, help="qkclip: warm-up rounds")
    ap.add_argument("--out", default=None,
                    help="default: results/optimizer_step.md with both sets, else results/optimizer_step_SET.md")
    args = ap.parse_args(argv)
    sets = [s for s in SETS if s in args.sets]
    out = args.out or results_path("optimizer_step" if len(sets) == len(SETS) else f"optimizer_step_{sets[0]}")
    load_start, t_start = load(), time.perf_counter()
    parts, per_matrix = [], []
    if "gpt256" in sets:
        md, rows = gpt256_report(args)
        parts.append(md)
        per_matrix += rows
    if "small48" in sets:
        md, rows, _ = small48_report(args)
        per_matrix = rows + per_matrix
        small_md = md
    if "gpt256" in sets or "small48" in sets:
        parts.append("## Host time per matrix\n\n"
                     "The step time divided by the number of matrices (48 in each set at the default sizes), and the per-round ratio to "
                     "torch.optim.Muon's (the same as the ratio of step times: the same matrices), with the safety "
                     "checks on (muonlab defaults) and off (`nonfinite=\"ignore\"`). In the small set it is nearly all "
                     "fixed host cost; in gpt256 mostly Newton-Schulz.\n\n" + md_table(PER_MATRIX_HEAD, per_matrix))
    if "small48" in sets:
        parts.append(small_md)
    if "variants" in sets:
        parts.append(variants_report(args))
    if "qkclip" in sets:
        parts.append(qkclip_report(args))
    print()
    print(text_table(PER_MATRIX_HEAD, per_matrix))
    torch.set_num_threads(args.threads)  # the machine line reports the gpt256 set's threads
    write_report(out, "Optimizer step: muonlab.Muon vs torch.optim.Muon", "\n\n".join(parts),
                 script=__file__, argv=argv,
                 machine_note=f"Load average {load_start} at the start, {load()} at the end (2 cores shared "
                              f"with other jobs); {time.perf_counter() - t_start:.0f} s in all.")


if __name__ == "__main__":
    main()
