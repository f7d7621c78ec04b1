"""Benchmark the Triton Newton-Schulz backend against a torch.compile'd torch loop.

On a CUDA GPU: medians from ``triton.testing.do_bench`` for 5 Keller iterations on square,
rectangular and expert-batched shapes, as milliseconds, as effective TFLOP/s (the PLAIN
iteration's 4 m^2 n + 2 m^3 FLOPs over the measured time, so the columns compare directly; the
Triton backend does only 3 m^2 n + m^3 of them) and as a fraction of this device's measured bf16
matmul rate (torch.matmul, 8192^3).

Also on a GPU: host microseconds per launch (public launcher, the autotuner path it replaced,
the cached direct launch, the cached JIT launch, torch.bmm/baddbmm) and the eager and CUDA-graph
time of 5 Keller iterations, Triton vs the torch path, at the shapes the launch cache was made for.
``--launch-only`` runs just those two tables (no torch.compile).

Without CUDA: the Triton interpreter's correctness sweep only (small shapes, each coefficient set,
max abs error against a float64 torch loop); interpreter timings mean nothing and are not shown.

    python benchmarks/bench_newton_schulz_triton.py [--quick] [--launch-only]

Writes benchmarks/results/newton_schulz_triton.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernel module is imported

from muonlab.kernels.triton_newton_schulz import TRITON_AVAILABLE, newton_schulz_triton  # noqa: E402
import muonlab.kernels.triton_newton_schulz as tns  # noqa: E402

from muonlab.kernels.coefficients import PRESETS, resolve_coefficients  # noqa: E402
from muonlab.kernels.forms.plain import plain_flops_per_iter, symmetric_flops_per_iter  # noqa: E402
from muonlab.kernels.forms.plain import plain_iterations as torch_plain_iterations  # noqa: E402
from muonlab.kernels.reference import plain_iterations  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import md_table, results_path, write_report  # noqa: E402

COEFFICIENTS = {name: resolve_coefficients(name, 5) for name in PRESETS}

# (batch, m, n) with m <= n, the layout newton_schulz hands to the backend.
GPU_SHAPES = [
    (1, 512, 512),
    (1, 1024, 1024),
    (1, 2048, 2048),
    (1, 4096, 4096),
    (1, 8192, 8192),
    (1, 512, 2048),
    (1, 1024, 4096),
    (1, 2048, 8192),
    (1, 4096, 8192),
    (8, 1024, 4096),
    (16, 512, 2048),
    (8, 2048, 8192),
]
QUICK_GPU_SHAPES = [(1, 1024, 1024), (1, 4096, 4096), (1, 1024, 4096), (8, 1024, 4096)]

# (batch, m, n, transposed view)
CPU_SHAPES = [(1, 127, 300, False), (3, 127, 300, True), (1, 1, 64, False), (2, 130, 130, True)]


def normalised(batch: int, m: int, n: int, dtype: torch.dtype, device: str, transposed: bool = False, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(batch, n, m, generator=g).mT if transposed else torch.randn(batch, m, n, generator=g)
    X = X / X.norm(dim=(-2, -1), keepdim=True)
    return X.to(device=device, dtype=dtype)


def cpu_sweep():
    header = ["shape (B, m, n)", "input", "dtype", "coefficients", "max abs err vs fp64", "status"]
    rows = []
    for batch, m, n, transposed in CPU_SHAPES:
        for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-2)):
            names = sorted(COEFFICIENTS) if dtype == torch.float32 else ["keller"]
            for name in names:
                X = normalised(batch, m, n, dtype, "cpu", transposed)
                Y = newton_schulz_triton(X, COEFFICIENTS[name])
                err = (Y.double() - plain_iterations(X.double(), COEFFICIENTS[name])).abs().max().item()
                rows.append(
                    [
                        f"({batch}, {m}, {n})",
                        "transposed view" if transposed else "contiguous",
                        str(dtype).replace("torch.", ""),
                        name,
                        f"{err:.2e}",
                        "OK" if err < tol else f"FAIL (tol {tol:g})",
                    ]
                )
                print(" | ".join(rows[-1]), flush=True)
    return header, rows


def gpu_bench(quick: bool):
    from triton.testing import do_bench

    big = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    peak_ms = do_bench(lambda: big @ big, return_mode="median")
    peak_tflops = 2 * 8192**3 / peak_ms / 1e9
    print(f"torch.matmul bf16 8192^3: {peak_ms:.3f} ms = {peak_tflops:.1f} TFLOP/s", flush=True)
    big = None  # frees it (not `del`: the lambda above reads the name)

    coefficients = COEFFICIENTS["keller"]
    # One static-shape graph per (shape, dtype); the default limit would fall back to eager.
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    compiled = torch.compile(plain_iterations, dynamic=False)
    header = [
        "shape (B, m, n)",
        "impl",
        "ms",
        "eff. TFLOP/s",
        "of bf16 peak",
        "speedup vs torch bf16",
    ]
    rows = []
    for batch, m, n in QUICK_GPU_SHAPES if quick else GPU_SHAPES:
        plain = batch * len(coefficients) * plain_flops_per_iter(m, n)
        timings = {}
        for dtype in (torch.bfloat16, torch.float32):
            X = normalised(batch, m, n, dtype, "cuda")
            tag = "bf16" if dtype == torch.bfloat16 else "fp32"
            timings[f"triton {tag}"] = do_bench(lambda: newton_schulz_triton(X, coefficients), return_mode="median")
            timings[f"torch.compile {tag}"] = do_bench(lambda: compiled(X, coefficients), return_mode="median")
            X = None  # frees it (not `del`: the lambdas above read the name)
        base = timings["torch.compile bf16"]
        for impl, ms in timings.items():
            tflops = plain / ms / 1e9
            rows.append(
                [
                    f"({batch}, {m}, {n})",
                    impl,
                    f"{ms:.3f}",
                    f"{tflops:.1f}",
                    f"{tflops / peak_tflops:.2f}",
                    f"{base / ms:.2f}x",
                ]
            )
            print(" | ".join(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    note = (
        f"bf16 matmul rate of this device (torch.matmul 8192^3, median): {peak_tflops:.1f} TFLOP/s.\n"
        "Effective TFLOP/s count the plain iteration's 4 m^2 n + 2 m^3 FLOPs for every implementation; "
        "the Triton backend executes 3 m^2 n + m^3 of them (ratio "
        f"{symmetric_flops_per_iter(4096, 4096) / plain_flops_per_iter(4096, 4096):.2f} for square), "
        "so it can exceed the matmul rate. fp32 uses torch's float32 matmul precision setting "
        f"({torch.get_float32_matmul_precision()!r}) in both implementations."
    )
    return header, rows, note


# Shapes of the host-overhead study (H100, bf16): below width 4096 both paths were host-bound.
LAUNCH_SHAPES = [
    (1, 768, 768),
    (1, 768, 3072),
    (1, 1024, 4096),
    (1, 2048, 2048),
    (1, 2048, 8192),
    (1, 4096, 4096),
    (16, 512, 1408),
    (24, 2048, 8192),
]
QUICK_LAUNCH_SHAPES = [(1, 768, 3072), (1, 4096, 4096), (16, 512, 1408)]


def host_us_per_launch(fn, launches: int = 200, repeats: int = 7) -> float:
    """Median host time of one call, from wall clock around ``launches`` calls with no sync between.

    The kernels are small enough that the GPU drains the queue faster than the host fills it, so
    this is the launch cost itself (the queue holds about 1000 launches before calls block).
    """
    import statistics
    import time

    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(launches):
            fn()
        samples.append((time.perf_counter() - start) / launches * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)


def launch_bench():
    # Small operands: the time measured is the host's, not the GPU's.
    X = normalised(1, 256, 512, torch.bfloat16, "cuda")
    G = torch.empty(1, 256, 256, device="cuda", dtype=torch.bfloat16)
    Y = torch.empty_like(X)
    dot_fp32, precision = tns._dot_flags(X.dtype)
    cases = [
        ("sym_matmul(X, out=G): public, checks + launch cache", "direct", lambda: tns.sym_matmul(X, out=G)),
        ("sym_matmul(X, out=G): public, autotuner on every call (before the cache)", "autotune",
         lambda: tns.sym_matmul(X, out=G)),
        ("X X^T: internal, cached direct launch (no checks)", "direct",
         lambda: tns._sym_matmul_unchecked(X, None, G, 1.0, 1.0, dot_fp32, precision)),
        ("X X^T: internal, cached JITFunction[grid] launch", "jit",
         lambda: tns._sym_matmul_unchecked(X, None, G, 1.0, 1.0, dot_fp32, precision)),
        ("torch.bmm(X, X^T, out=G)", None, lambda: torch.bmm(X, X.mT, out=G)),
        ("batched_matmul_add(G, X, X, out=Y): public, checks + launch cache", "direct",
         lambda: tns.batched_matmul_add(G, X, X, beta=2.0, out=Y)),
        ("batched_matmul_add: public, autotuner on every call", "autotune",
         lambda: tns.batched_matmul_add(G, X, X, beta=2.0, out=Y)),
        ("G X + 2 X: internal, cached direct launch (no checks)", "direct",
         lambda: tns._matmul_unchecked(G, X, X, Y, 1.0, 2.0, dot_fp32, precision)),
        ("torch.baddbmm(X, G, X, beta=2, out=Y)", None, lambda: torch.baddbmm(X, G, X, beta=2.0, out=Y)),
    ]
    header = ["launch (X (1, 256, 512) bf16)", "host us per launch"]
    rows = []
    for label, mode, fn in cases:
        with tns.launch_mode(mode or "direct"):
            us = host_us_per_launch(fn)
        rows.append([label, f"{us:.1f}"])
        print(" | ".join(rows[-1]), flush=True)
    info = tns.launch_cache_info()
    note = (
        f"Direct launch verified per kernel: {info['direct_api_ok']} (False or missing means every cached launch "
        "took the JITFunction[grid] path). Host time: wall clock around 200 calls without a sync, median of 7."
    )
    return header, rows, note


def _graph_ms(fn, do_bench):
    """do_bench median of replaying ``fn`` captured in a CUDA graph (fn warmed up first)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return do_bench(graph.replay, return_mode="median")


def eager_bench(quick: bool):
    from triton.testing import do_bench

    coefficients = COEFFICIENTS["keller"]
    header = ["shape (B, m, n)", "triton ms", "triton + workspace ms", "torch ms", "triton/torch",
              "triton graph ms", "torch graph ms", "max |triton - torch|"]
    rows = []
    for batch, m, n in QUICK_LAUNCH_SHAPES if quick else LAUNCH_SHAPES:
        X = normalised(batch, m, n, torch.bfloat16, "cuda")
        ws = tns.NSWorkspace.like(X)
        # muonlab's torch path as a step runs it: the iterate copied into its workspace, then
        # bmm / baddbmm into preallocated buffers
        work_x, spare = torch.empty_like(X), torch.empty_like(X)
        gram, poly = torch.empty(batch, m, m, device=X.device, dtype=X.dtype), torch.empty(batch, m, m, device=X.device, dtype=X.dtype)

        def torch_chain():
            return torch_plain_iterations(work_x.copy_(X), spare, coefficients, gram, poly)
        t_plain = do_bench(lambda: newton_schulz_triton(X, coefficients), return_mode="median")
        t_ws = do_bench(lambda: newton_schulz_triton(X, coefficients, workspace=ws), return_mode="median")
        t_torch = do_bench(torch_chain, return_mode="median")
        diff = (newton_schulz_triton(X, coefficients).float() - torch_chain().float())
        try:
            g_triton = f"{_graph_ms(lambda: newton_schulz_triton(X, coefficients, workspace=ws), do_bench):.3f}"
            g_torch = f"{_graph_ms(torch_chain, do_bench):.3f}"
        except RuntimeError as err:  # report, don't hide the eager numbers
            g_triton = g_torch = f"failed: {str(err).splitlines()[0][:60]}"
        rows.append([f"({batch}, {m}, {n})", f"{t_plain:.3f}", f"{t_ws:.3f}", f"{t_torch:.3f}",
                     f"{t_plain / t_torch:.2f}", g_triton, g_torch, f"{diff.abs().max().item():.2e}"])
        print(" | ".join(rows[-1]), flush=True)
        X = ws = diff = None  # frees them (not `del`: torch_chain and the lambdas above read the names)
        torch.cuda.empty_cache()
    note = (
        "5 Keller iterations in bf16 on normalised inputs, do_bench medians (ms, wall time between CUDA events, so "
        "host-bound chains show their host time). torch = the torch path of newton_schulz (bmm/baddbmm). Graph "
        "columns replay the chain captured in a CUDA graph (triton with its workspace). The last column is "
        "bf16 rounding, not an error bound."
    )
    return header, rows, note

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer GPU shapes")
    parser.add_argument("--launch-only", action="store_true",
                        help="GPU: only the host-launch and eager/graph tables (skips the torch.compile table)")
    args = parser.parse_args()
    if not TRITON_AVAILABLE:
        print("triton is not installed: nothing to benchmark")
        return 1
    sections = []
    if HAS_CUDA:
        print("host time per launch", flush=True)
        l_header, l_rows, l_note = launch_bench()
        sections.append(f"## Host time per launch\n\n{md_table(l_header, l_rows)}\n\n{l_note}")
        print("eager and graph time, 5 Keller iterations, triton vs torch", flush=True)
        e_header, e_rows, e_note = eager_bench(args.quick)
        sections.append(f"## 5 Keller iterations, bf16: Triton vs torch, eager and in a CUDA graph\n\n"
                        f"{md_table(e_header, e_rows)}\n\n{e_note}")
    if HAS_CUDA and args.launch_only:
        header, rows, note = None, [], ""
    elif HAS_CUDA:
        header, rows, note = gpu_bench(args.quick)
        title = "GPU timings, 5 Keller iterations (do_bench medians)"
    else:
        print("no CUDA GPU: host-launch and eager timing tables need one and are skipped", flush=True)
        print("no CUDA GPU: running the Triton interpreter correctness sweep only (no timings)", flush=True)
        header, rows = cpu_sweep()
        note = (
            "No CUDA GPU on this machine: TRITON_INTERPRET=1 correctness sweep only; speed has to be "
            "measured on a GPU with the same command. Tolerances: fp32 1e-5, fp16 2e-2 (fp16 intermediates)."
        )
        title = "Interpreter correctness sweep (newton_schulz_triton vs float64 torch loop)"
    if header is not None:
        print(f"\n{note}")
        sections.append(f"## {title}\n\n{md_table(header, rows)}\n\n{note}")
    import triton  # optional dependency: only here, once TRITON_AVAILABLE said it is installed

    gpu = torch.cuda.get_device_name() if HAS_CUDA else "none"
    write_report(results_path("newton_schulz_triton"), "Newton-Schulz: Triton symmetric kernels vs torch",
                 "\n\n".join(sections), script=__file__,
                 machine_note=f"GPU: {gpu}; triton {triton.__version__}; platform {platform.platform()}.")
    failures = [r for r in rows if r[-1].startswith("FAIL")]
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
