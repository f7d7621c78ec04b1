"""One Muon step on the hidden matrices of real model sizes: muonlab vs torch.optim.Muon (and
microsoft/dion's Muon), speed and memory, and the first step's time.

    python benchmarks/bench_gpu_step.py              # on a GPU: the full shapes; on a CPU: shapes / 8 per side
    python benchmarks/bench_gpu_step.py --sets gpt2 --repeats 5 --out /tmp/step.md

Dion (microsoft/dion at the commit bench_peers.py pins, dion/muon.py, one device:
``distributed_mesh=None``) runs from benchmarks/_peers/, where bench_peers.py copies it from a git
mirror (a GPU machine has no mirror: carry the folder there); absent, its rows are skipped with a
line saying so. Its torch.compile decorators are off (TORCHDYNAMO_DISABLE=1, set before it is
imported; muonlab does not use torch.compile), and it gets the 5-step Keller Newton-Schulz in bf16
that torch.optim.Muon runs (bench_peers' ``keller_ns``): the same FLOPs. "dion eager" runs on CPU
and GPU; "dion + CudaGraphOptimizer" (dion/cuda_graph.py: one eager step, then the whole step
captured in a CUDA graph and replayed) only on CUDA.

First step (``--first-step-sets``): the time of the very first ``step()`` of a fresh optimizer, in a
fresh process (construction timed apart, the second step beside it), for torch.optim.Muon, muonlab
defaults and dion eager; on CUDA muonlab's also with cold caches (empty TRITON_CACHE_DIR and
MUONLAB_CACHE_DIR: a fresh machine), where the warm row has the caches this run's speed table left.

Matrix sets (every Linear weight of the transformer blocks, or one expert bank):
  1b:    24 x [6144x2048, 2048x2048, 8192x2048, 2048x8192]   (a 1B-like model, 1.2 B Muon parameters)
  gpt2:  12 x [2304x768, 768x768, 3072x768, 768x3072]        (GPT-2 small)
  bank64:  one (64, 1408, 2048) expert bank;  bank128: one (128, 768, 2048) expert bank
torch.optim.Muon takes 2-D parameters only, so a bank is given to it as its E matrices.

Speed: each configuration has its own copy of the parameters and the same fixed gradients; after
warm-up (which also pays Triton's autotuning, CUDA graph capture and backend="auto"'s measurement),
every round steps every configuration once in a rotating order, timed around ``step()`` with the
device synchronised; the table gives medians. A bf16 matmul (GPU 8192^3, CPU 1024^3) is timed in the
same rounds, and each step's plain-form Newton-Schulz FLOPs (5 iterations, ``plain_flops_per_iter``)
over the whole step time give an achieved rate, a lower bound on the Newton-Schulz rate itself.
The speed-up ceiling puts a configuration's own Newton-Schulz FLOPs (its plan's: the gram form
runs fewer than the plain form) at that matmul rate, with nothing else in the step: the most any
step doing those products could gain over torch.optim.Muon's measured step.

Memory, on a GPU: resident (params + grads + state after the first step) and the peak during a step,
from torch.cuda's allocator. On a CPU: each configuration in a fresh process, the memory a step adds
(state + transient) = peak RSS over three steps (VmHWM, reset through /proc/self/clear_refs) minus
the RSS with parameters and gradients only, after the same configuration has stepped twice on tiny
matrices: that warm-up pays the one-time costs (lazy imports, the math libraries' and thread pool's
start-up, about 10-25 MiB here) which would otherwise count for every configuration and pull every
ratio towards 1. Beside it, the tensor bytes alone (the allocator's view, as the GPU table has it):
the peak of the bytes allocated minus freed over the same three steps, from torch.profiler's memory
events, in another fresh process. RSS also holds what no tensor does, such as the math library's
cache of per-shape matmul kernels.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import load  # noqa: E402
from _report import md_table, results_path, text_table, write_report  # noqa: E402

import muonlab  # noqa: E402
from muonlab.kernels.forms.plain import plain_flops_per_iter  # noqa: E402
from muonlab.kernels.runner import default_budget  # noqa: E402

SETS = {
    "1b": [(6144, 2048), (2048, 2048), (8192, 2048), (2048, 8192)] * 24,
    "gpt2": [(2304, 768), (768, 768), (3072, 768), (768, 3072)] * 12,
    "bank64": [(64, 1408, 2048)],
    "bank128": [(128, 768, 2048)],
}
LR, MOMENTUM = 0.02, 0.95


PEERS_DIR = Path(__file__).resolve().parent / "_peers"
DION_EAGER, DION_GRAPH = "dion eager", "dion + CudaGraphOptimizer"


def dion_available() -> str:
    """'' when benchmarks/_peers/dion is there, else why not."""
    if (PEERS_DIR / "dion" / "muon.py").exists() and (PEERS_DIR / "dion" / "cuda_graph.py").exists():
        return ""
    return ("no benchmarks/_peers/dion (bench_peers.py copies it from a git mirror; on a machine without one, "
            "carry the folder there)")


def _dion_classes():
    """Dion's Muon and CudaGraphOptimizer, imported with torch.compile off (its decorators read
    TORCHDYNAMO_DISABLE when the module is imported)."""
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    torch._dynamo.config.disable = True
    if str(PEERS_DIR) not in sys.path:
        sys.path.insert(0, str(PEERS_DIR))
    from dion.cuda_graph import CudaGraphOptimizer
    from dion.muon import Muon as DionMuon
    return DionMuon, CudaGraphOptimizer


def dion_opt(graph: bool):
    """A factory for Dion's Muon on one device (no mesh), with torch.optim.Muon's iteration and
    momentum settings; ``graph``: wrapped in its CudaGraphOptimizer, captured after one eager step."""
    def make(ps):
        from _peers_workers import keller_ns

        DionMuon, CudaGraphOptimizer = _dion_classes()
        opt = DionMuon(ps, lr=LR, mu=MOMENTUM, nesterov=True, epsilon=1e-7, newton_schulz_func=keller_ns)
        return CudaGraphOptimizer(opt, warmup_steps=1) if graph else opt
    return make


def configs(cuda: bool, peers: bool = False) -> dict:
    """label -> factory(params); params of a bank are one 3-D tensor (torch.optim.Muon: its matrices).
    ``peers``: Dion's rows too, when benchmarks/_peers has it (the graph row only on CUDA)."""
    def muonlab_opt(**kw):
        return lambda ps: muonlab.Muon(ps, lr=LR, momentum=MOMENTUM, nonfinite="ignore", **kw)

    out = {
        "torch.optim.Muon": None,  # built from the per-matrix copy, see make_run
        "muonlab defaults": muonlab_opt(),
        "muonlab torch plain": muonlab_opt(ns_backend="torch", ns_form="plain"),
        "muonlab torch gram": muonlab_opt(ns_backend="torch", ns_form="gram"),
        "muonlab fp32 momentum": muonlab_opt(momentum_dtype=torch.float32),
        # the non-finite check on (the rows above turn it off): read on the host, or decided on the device
        "muonlab check, host decision": lambda ps: muonlab.Muon(ps, lr=LR, momentum=MOMENTUM),
        "muonlab check, device decision": lambda ps: muonlab.Muon(ps, lr=LR, momentum=MOMENTUM,
                                                                  nonfinite_decision="device"),
    }
    if cuda:
        out["muonlab triton plain"] = muonlab_opt(ns_backend="triton", ns_form="plain")
        out["muonlab triton gram"] = muonlab_opt(ns_backend="triton", ns_form="gram")
        out["muonlab torch plain + graphs"] = muonlab_opt(ns_backend="torch", ns_form="plain", ns_graphs=True)
        out["muonlab triton plain + graphs"] = muonlab_opt(ns_backend="triton", ns_form="plain", ns_graphs=True)
        # the whole step in one CUDA graph (muonlab.optim.step_graph; captured at the second warm-up step),
        # lr a device tensor as its recipe says
        out["muonlab whole step captured"] = lambda ps: muonlab.Muon(
            ps, lr=torch.tensor(LR, device=ps[0].device), momentum=MOMENTUM, nonfinite="ignore", capture_after=1)
        out["muonlab check, device decision, captured"] = lambda ps: muonlab.Muon(
            ps, lr=torch.tensor(LR, device=ps[0].device), momentum=MOMENTUM, nonfinite_decision="device",
            capture_after=1)
    if peers and not dion_available():
        out[DION_EAGER] = dion_opt(graph=False)
        if cuda:
            out[DION_GRAPH] = dion_opt(graph=True)
    return out


FIRST_DEFAULTS = "muonlab defaults (safety checks on)"


def first_step_factories(peers: bool = True) -> dict:
    """The first-step table's configurations: torch.optim.Muon, muonlab with every default (its
    non-finite check on: the speed table's muonlab rows turn it off), and Dion eager."""
    out = {"torch.optim.Muon": None,
           FIRST_DEFAULTS: lambda ps: muonlab.Muon(ps, lr=LR, momentum=MOMENTUM)}
    if peers and not dion_available():
        out[DION_EAGER] = dion_opt(graph=False)
    return out


def budget_label(mib: float) -> str:
    return f"muonlab workspace {mib:g} MiB"


def factory_of(label: str):
    """The optimizer factory of a configuration label, budget sweep labels included."""
    if label.startswith("muonlab workspace "):
        mib = float(label.split()[2])
        return lambda ps: muonlab.Muon(ps, lr=LR, momentum=MOMENTUM, nonfinite="ignore",
                                       workspace_bytes=int(mib * 2**20))
    if label in (DION_EAGER, DION_GRAPH):
        return dion_opt(graph=label == DION_GRAPH)
    if label == FIRST_DEFAULTS:
        return first_step_factories()[label]
    return configs(False)[label]


def scaled(shapes, factor: int):
    return [tuple(s[:-2]) + (max(1, s[-2] // factor), max(1, s[-1] // factor)) for s in shapes]


def plain_flops(shapes) -> int:
    total = 0
    for s in shapes:
        batch = s[0] if len(s) == 3 else 1
        m, n = sorted(s[-2:])
        total += batch * 5 * plain_flops_per_iter(m, n)
    return total


def make_params(shapes, dtype, device, seed=0):
    """The same values for every configuration: drawn on the device itself (a billion normals
    drawn on the host would take longer than the benchmark)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    params = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(s, generator=gen, device=device, dtype=dtype).mul_(0.02))
        p.grad = torch.randn(s, generator=gen, device=device, dtype=dtype).mul_(1e-3)
        params.append(p)
    return params


def make_optimizer(label, factory, shapes, dtype, device):
    params = make_params(shapes, dtype, device)
    if factory is None:  # torch.optim.Muon: 2-D only, a bank as its matrices
        flat = []
        for p in params:
            pairs = zip(p.detach().unbind(0), p.grad.unbind(0)) if p.ndim == 3 else [(p.detach(), p.grad)]
            for mat, grad in pairs:
                q = torch.nn.Parameter(mat.clone())
                q.grad = grad.clone()
                flat.append(q)
        params = flat
        opt = torch.optim.Muon(params, lr=LR, momentum=MOMENTUM, adjust_lr_fn="original")
    else:
        opt = factory(params)
    return params, opt


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def matmul_ms(device, n) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    sync(device)
    t0 = time.perf_counter()
    a @ a
    sync(device)
    return (time.perf_counter() - t0) * 1e3


# ---------------------------------------------------------------------------- speed (+ GPU memory)

def _timed_steps(opt, device, repeats) -> list[float]:
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        opt.step()
        sync(device)
        times.append(time.perf_counter() - t0)
    return times


def newton_schulz_ran(opt) -> str:
    """What muonlab's Newton-Schulz ran, per (form, backend, dtype), with its number of plan
    batches: what "auto" chose on this device ("-" for the peers, which run their own)."""
    if not hasattr(opt, "resolved_choices"):
        return "-"
    ran = collections.Counter((c["form"], c["backend"], c["dtype"].replace("torch.", ""))
                              for c in opt.resolved_choices())
    return ", ".join(f"{' '.join(k)}: {n}" for k, n in sorted(ran.items()))


def speed_table(set_name, shapes, dtype, device, args, factories=None):
    """On CPU every round steps every configuration once in a rotating order (load hits them
    alike); on a GPU, where a 1B set of fp32 parameters per configuration would not all fit, each
    configuration is built, measured (memory, then time) and freed in turn."""
    factories = factories or configs(device.type == "cuda", peers=True)
    n = 8192 if device.type == "cuda" else 1024
    probe, runs = [], []
    for label, factory in factories.items():
        if device.type == "cuda":
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
        try:
            params, opt = make_optimizer(label, factory, shapes, dtype, device)
            for _ in range(args.warmup):
                opt.step()
            sync(device)
        except Exception as e:  # a configuration this machine can't run (e.g. no triton) is reported, not fatal
            print(f"  {label}: skipped ({type(e).__name__}: {e})")
            continue
        # the Newton-Schulz FLOPs this configuration runs (its plan's: the gram form runs fewer)
        # (torch.optim.Muon and Dion: the plain form of the shapes, as their iteration is)
        ns_flops_run = sum(sum(b.flops) for b in opt.plan()) if hasattr(opt, "plan") else plain_flops(shapes)
        run = dict(label=label, params=params, opt=opt, times=[], ns_flops=ns_flops_run, ran=newton_schulz_ran(opt))
        if device.type == "cuda":
            run["resident"] = torch.cuda.memory_allocated() - base
            torch.cuda.reset_peak_memory_stats()
            opt.step()
            sync(device)
            run["peak"] = torch.cuda.max_memory_allocated() - base
            probe.append(matmul_ms(device, n))
            run["times"] = _timed_steps(opt, device, args.repeats)
            run["opt"] = run["params"] = None
            del opt, params
        runs.append(run)
    if device.type != "cuda":
        for r in range(args.repeats):
            probe.append(matmul_ms(device, n))
            for run in runs[r % len(runs):] + runs[:r % len(runs)]:
                run["times"] += _timed_steps(run["opt"], device, 1)
    matmul_rate = 2 * n**3 / (statistics.median(probe) / 1e3) / 1e12
    flops = plain_flops(shapes)
    base = statistics.median(runs[0]["times"]) if runs and runs[0]["label"] == "torch.optim.Muon" else None
    rows = []
    for run in runs:
        med = statistics.median(run["times"])
        rate = flops / med / 1e12
        floor_s = run["ns_flops"] / (matmul_rate * 1e12)  # its products alone, at the measured matmul rate
        row = [set_name, str(dtype).replace("torch.", ""), run["label"], f"{1e3 * med:.2f}",
               f"{base / med:.2f}x" if base else "", f"{rate:.1f}", f"{rate / matmul_rate:.2f}",
               f"{run['ns_flops'] / 1e9:.1f}", f"{base / floor_s:.2f}x" if base else ""]
        if device.type == "cuda":
            ref = runs[0]
            row += [f"{run['resident'] / 2**30:.2f}", f"{run['peak'] / 2**30:.2f}",
                    f"{(run['peak'] - run['resident']) / 2**30:.3f}", f"{run['peak'] / ref['peak']:.2f}x"]
        row.append(run["ran"])
        rows.append(row)
        run["opt"] = run["params"] = None
    return rows, matmul_rate


# ---------------------------------------------------------------------------- CPU memory, one process per config

def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _settle() -> int:
    """Free what Python and the allocator hold but don't use, then the RSS in KiB: pages freed
    while building the parameters would otherwise be reused by the state silently."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS to the current RSS
    return _rss_kib("VmRSS")


def _tensor_peak_bytes(run) -> int:
    """The most tensor bytes live at once during ``run()`` beyond those live before it: the running
    sum of torch.profiler's allocation (+) and free (-) events, in time order."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def memory_child(set_name: str, label: str, dtype_name: str, factor: int, view: str) -> None:
    """One fresh process: ``view`` "rss" prints the peak RSS three steps add (KiB), "tensors" the
    peak tensor bytes they add. Both after two warm-up steps of the same configuration on tiny matrices
    of the set's kinds (2-D, 3-D), so one-time costs don't count."""
    torch.set_num_threads(1)
    dtype = getattr(torch, dtype_name)
    cpu = torch.device("cpu")
    # two of each, tall and wide, so the warm-up runs the batched products a step of the set runs
    kinds = {len(s) for s in SETS[set_name]}
    tiny = ([(64, 32), (64, 32), (32, 64), (32, 64)] if 2 in kinds else []) + \
        ([(2, 64, 32), (2, 32, 64)] if 3 in kinds else [])
    warm_params, warm_opt = make_optimizer(label, factory_of(label), tiny, dtype, cpu)
    warm_opt.step()
    warm_opt.step()  # the second step runs the paths of a step with state
    del warm_params, warm_opt
    params, opt = make_optimizer(label, factory_of(label), scaled(SETS[set_name], factor), dtype, cpu)

    def three_steps():
        for _ in range(3):
            opt.step()

    if view == "tensors":
        print(json.dumps(dict(added_kib=_tensor_peak_bytes(three_steps) / 1024)))
        return
    before = _settle()
    three_steps()
    print(json.dumps(dict(added_kib=_rss_kib("VmHWM") - before)))


def memory_added(set_name, label, args, view="rss", env=None) -> float:
    """Bytes a step adds, the median of ``args.memory_runs`` fresh processes (the RSS peak moves by
    a few MiB from run to run with what the allocator keeps; the tensor bytes don't move: one run).
    ``env``: variables set for the child processes."""
    runs = []
    for _ in range(args.memory_runs if view == "rss" else 1):
        out = subprocess.run([sys.executable, __file__, "--memory-child", set_name, label, "bfloat16",
                              str(args.factor), view], capture_output=True, text=True, check=True,
                             env=None if env is None else {**os.environ, **env})
        runs.append(json.loads(out.stdout.strip().splitlines()[-1])["added_kib"] * 1024)
    return statistics.median(runs)


# ---------------------------------------------------------------------------- first step, one process per config

def first_step_child(set_name: str, label: str, dtype_name: str, factor: int, threads: int) -> None:
    """One fresh process: build the parameters, then the optimizer (timed), then its first and
    second ``step()`` (each timed, the device synchronised around it); prints JSON seconds."""
    torch.set_num_threads(threads)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    shapes = scaled(SETS[set_name], factor)
    params = make_params(shapes, getattr(torch, dtype_name), device)
    if label in (DION_EAGER, DION_GRAPH):
        _dion_classes()  # its import is not its construction
    sync(device)
    t0 = time.perf_counter()
    factory = factory_of(label)
    if factory is None:  # torch.optim.Muon: 2-D only, a bank as its matrices (as make_optimizer does)
        params = [torch.nn.Parameter(m.clone()) for p in params for m in (p.detach().unbind(0) if p.ndim == 3
                                                                          else [p.detach()])]
        for q in params:
            q.grad = torch.randn_like(q).mul_(1e-3)
        t0 = time.perf_counter()
        opt = torch.optim.Muon(params, lr=LR, momentum=MOMENTUM, adjust_lr_fn="original")
    else:
        opt = factory(params)
    t1 = time.perf_counter()
    opt.step()
    sync(device)
    t2 = time.perf_counter()
    opt.step()
    sync(device)
    t3 = time.perf_counter()
    print(json.dumps(dict(construct_s=t1 - t0, first_s=t2 - t1, second_s=t3 - t2)))


def first_step_rows(set_names, dtype_name: str, args, cuda: bool) -> list[list]:
    """Rows of FIRST_HEAD: per set and configuration, one fresh process each; on CUDA muonlab's
    defaults also with empty Triton and muonlab caches (a fresh machine)."""
    import tempfile

    rows = []
    for set_name in set_names:
        runs = [(label, None) for label in first_step_factories()]
        if cuda:
            runs.insert(2, (FIRST_DEFAULTS, "cold"))
        for label, cold in runs:
            env = dict(os.environ)
            with tempfile.TemporaryDirectory() as tmp:
                if cold:
                    env.update(TRITON_CACHE_DIR=f"{tmp}/triton", MUONLAB_CACHE_DIR=f"{tmp}/muonlab")
                t0 = time.perf_counter()
                out = subprocess.run([sys.executable, __file__, "--first-step-child", set_name, label, dtype_name,
                                      str(args.factor), str(args.threads)], capture_output=True, text=True, env=env)
                wall = time.perf_counter() - t0
            name = label + (" (cold caches)" if cold else "")
            if out.returncode != 0:
                why = (out.stderr.strip().splitlines() or ["?"])[-1]
                print(f"  first step {set_name} {name}: failed ({why})")
                rows.append([set_name, name, "failed", why, "", "", ""])
                continue
            got = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append([set_name, name, f"{1e3 * got['construct_s']:.1f}", f"{1e3 * got['first_s']:.1f}",
                         f"{1e3 * got['second_s']:.1f}", f"{got['first_s'] / got['second_s']:.1f}x", f"{wall:.1f}"])
            print(f"  first step {set_name} {name}: {rows[-1][2:]}", flush=True)
    return rows


FIRST_HEAD = ["set", "configuration", "construct ms", "first step() ms", "second step() ms",
              "first / second", "process wall s"]


MEMORY_HEAD = ["set", "configuration", "param MiB (bf16)", "RSS a step adds MiB (state + transient)",
               "vs torch.optim.Muon", "tensor bytes a step adds MiB", "vs torch.optim.Muon"]


def cpu_memory_rows(set_names, args, labels=None):
    """Rows of ``MEMORY_HEAD``: per set and configuration, the RSS and the tensor bytes a step adds."""
    rows = []
    for set_name in set_names:
        param_bytes = sum(torch.Size(s).numel() for s in scaled(SETS[set_name], args.factor)) * 2
        labels_here = labels or configs(False)
        rss = {label: memory_added(set_name, label, args) for label in labels_here}
        tensors = {label: memory_added(set_name, label, args, "tensors") for label in labels_here}
        for label in labels_here:
            rows.append([set_name, label, f"{param_bytes / 2**20:.1f}",
                         f"{rss[label] / 2**20:.1f}", f"{rss[label] / rss['torch.optim.Muon']:.2f}x",
                         f"{tensors[label] / 2**20:.1f}", f"{tensors[label] / tensors['torch.optim.Muon']:.2f}x"])
    return rows


def kernel_cache_note(args) -> str:
    """The 1b set's RSS with oneDNN's primitive cache (its per-shape matmul kernels) off, for
    torch.optim.Muon and the defaults: how much of the RSS beyond the tensor bytes that cache is."""
    off = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0"}
    ref, ours = (memory_added("1b", label, args, env=off) for label in ("torch.optim.Muon", "muonlab defaults"))
    return (f"With oneDNN's primitive cache off (`ONEDNN_PRIMITIVE_CACHE_CAPACITY=0`: no per-shape matmul "
            f"kernels kept), the 1b set's steps add {ref / 2**20:.1f} MiB of RSS with torch.optim.Muon and "
            f"{ours / 2**20:.1f} MiB with muonlab's defaults ({ours / ref:.2f}x), against the table's RSS "
            "with it on: the cache is a cost per distinct product shape, not per parameter byte. What RSS "
            "holds beyond that and the tensor bytes is what the C allocator keeps; it moves by a few MiB "
            "from run to run.\n")


def budget_sweep(args, set_name: str, dtype=torch.bfloat16):
    """CPU: the workspace budget's trade-off on one set: speed (rotating rounds with
    torch.optim.Muon) and the memory a step adds, per budget."""
    labels = ["torch.optim.Muon"] + [budget_label(float(b)) for b in args.budgets.split(",")]
    factories = {label: (None if label == "torch.optim.Muon" else factory_of(label)) for label in labels}
    speed, _ = speed_table(set_name, scaled(SETS[set_name], args.factor), dtype, torch.device("cpu"), args, factories)
    memory = cpu_memory_rows([set_name], args, labels)
    head = ["set", "configuration", "median step ms", "speed-up vs torch.optim.Muon",
            "RSS a step adds MiB", "RSS vs torch.optim.Muon", "tensor bytes a step adds MiB", "tensors vs torch.optim.Muon"]
    return head, [[s[0], s[2], s[3], s[4], *m[3:]] for s, m in zip(speed, memory)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sets", default="1b,gpt2,bank64,bank128")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--factor", type=int, default=None, help="divide every matrix side (default: 1 on GPU, 8 on CPU)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--memory-only", action="store_true", help="CPU: only the memory table (it is not load-sensitive)")
    ap.add_argument("--no-memory", action="store_true", help="CPU: no memory tables, no budget sweep (they take most of the run)")
    ap.add_argument("--memory-runs", type=int, default=3, help="CPU: fresh processes per memory figure (median)")
    ap.add_argument("--budgets", default="2,4,8,16,32",
                    help="CPU: workspace budgets (MiB) for the trade-off table; '' for none")
    ap.add_argument("--sweep-sets", default="1b,bank64", help="CPU: the sets of the trade-off table")
    ap.add_argument("--first-step-sets", default=None,
                    help="sets of the first-step table, bf16 (default: gpt2,1b on GPU, gpt2 on CPU); '' for none")
    ap.add_argument("--memory-child", nargs=5, help=argparse.SUPPRESS)
    ap.add_argument("--first-step-child", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.memory_child:
        set_name, label, dtype_name, factor, view = args.memory_child
        return memory_child(set_name, label, dtype_name, int(factor), view)
    if args.first_step_child:
        set_name, label, dtype_name, factor, threads = args.first_step_child
        return first_step_child(set_name, label, dtype_name, int(factor), int(threads))
    torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    args.factor = args.factor or (1 if cuda else 8)
    set_names = args.sets.split(",")
    t_start, load_start = time.perf_counter(), load()
    head = ["set", "param dtype", "configuration", "median step ms", "speed-up vs torch.optim.Muon",
            "plain-FLOP TFLOP/s (whole step)", "of bf16 matmul rate", "Newton-Schulz GFLOP run",
            "speed-up ceiling (those FLOPs at the matmul rate)"]
    if cuda:
        head += ["resident GiB", "peak GiB", "transient GiB", "peak vs torch.optim.Muon"]
    head.append("Newton-Schulz run (form backend dtype: batches)")
    rows, rates = [], []
    for set_name in ([] if args.memory_only and not cuda else set_names):
        shapes = scaled(SETS[set_name], args.factor)
        for dtype_name in args.dtypes.split(","):
            print(f"{set_name} {dtype_name} ...", flush=True)
            got, rate = speed_table(set_name, shapes, getattr(torch, dtype_name), device, args)
            rows += got
            rates.append(rate)
            print(text_table(head, got), flush=True)
    body = [f"Shapes divided by {args.factor} per side." if args.factor > 1 else "Full shapes."]
    if rows:
        body += [f"bf16 matmul measured in the same rounds: median {statistics.median(rates):.1f} TFLOP/s.", "",
                 "## Step time" + (" and GPU memory" if cuda else ""), "", md_table(head, rows)]
    if not cuda and not args.no_memory:
        mem_rows = cpu_memory_rows(set_names, args)
        print(text_table(MEMORY_HEAD, mem_rows))
        body += ["", "## Memory a step adds on this CPU (bf16 parameters, a fresh process per configuration, "
                 f"median of {args.memory_runs})", "", md_table(MEMORY_HEAD, mem_rows)]
        if "1b" in set_names:
            body += ["", kernel_cache_note(args)]
        if args.budgets and not args.memory_only:
            sweep_rows = []
            for set_name in args.sweep_sets.split(","):
                sweep_head, got = budget_sweep(args, set_name)
                sweep_rows += got
            print(text_table(sweep_head, sweep_rows))
            body += ["", "## The workspace budget's trade-off on this CPU (bf16 parameters)", "",
                     "`workspace_bytes` caps a step's transient memory; more matrices per batched call run "
                     "faster on this CPU and cost memory. The defaults' budget here is "
                     f"{default_budget(0, 'cpu') / 2**20:g} MiB (the CPU floor; 5% of parameter bytes above "
                     "it).", "", md_table(sweep_head, sweep_rows)]
    first_sets = [x for x in (args.first_step_sets if args.first_step_sets is not None
                              else ("gpt2,1b" if cuda else "gpt2")).split(",") if x]
    if first_sets and not args.memory_only:
        first_rows = first_step_rows(first_sets, "bfloat16", args, cuda)
        print(text_table(FIRST_HEAD, first_rows))
        body += ["", "## The first step (a fresh process per configuration, bf16 parameters)", "",
                 "The very first `step()` of a fresh optimizer in a fresh process (the device synchronised around "
                 "it), its construction timed apart (with any lazy import the constructor triggers; Dion's module "
                 "import excluded), and the second step beside it: what a run pays once before the steps the "
                 "table above times. muonlab's row has every default on, its non-finite check "
                 "included (the speed table's muonlab rows run with `nonfinite=\"ignore\"`)"
                 + ("; its cold row starts with empty Triton and muonlab caches (TRITON_CACHE_DIR, "
                    "MUONLAB_CACHE_DIR), as on a fresh machine, the warm one with the caches this run's speed "
                    "table left. Dion under its CudaGraphOptimizer has no row: its first step is the eager "
                    "step (the capture is the second)." if cuda else
                    ". No GPU here: no Triton, no CUDA graphs, so no cold-cache row."),
                 "", md_table(FIRST_HEAD, first_rows)]
    why = dion_available()
    body += ["", "Dion (`microsoft/dion@0a059a4542e5`, dion/muon.py on one device, torch.compile off, torch.optim.Muon's "
             "5-step Keller iteration in bf16 via `newton_schulz_func`, Nesterov, momentum 0.95): "
             + (f"skipped: {why}." if why else
                "'dion eager' rows above" + ("; 'dion + CudaGraphOptimizer' wraps it in dion/cuda_graph.py's "
                                             "CudaGraphOptimizer (one eager step, then captured and replayed)."
                                             if cuda else "; 'dion + CudaGraphOptimizer' is GPU-only (CUDA graphs) "
                                             "and has no row on this CPU."))]
    note = (f"GPU: {torch.cuda.get_device_name()}." if cuda else "No GPU: the CPU proxy.") + \
        f" Load average {load_start} at the start, {load()} at the end; {time.perf_counter() - t_start:.0f} s."
    out = args.out or results_path("gpu_step" if cuda else "gpu_step_cpu_proxy")
    write_report(out, "One Muon step: muonlab vs torch.optim.Muon", "\n".join(body), script=__file__, argv=argv,
                 machine_note=note)


if __name__ == "__main__":
    main()
