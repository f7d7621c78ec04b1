"""GPU-true spans on one CUDA device (skipped without CUDA).

A Muon step over 24 bf16 matrices of 1024x4096 (one process: the local path, Newton-Schulz in
torch kernels) is checked for what muonlab.trace promises on CUDA:

(a) the step never synchronises: it runs under ``torch.cuda.set_sync_debug_mode("error")``, and
    behind a GPU sleep longer than the step's host time every span still lies after step()
    returned (host launch times would lie inside the sleep);
(b) the newton_schulz spans measure the GPU's Newton-Schulz work: their total is within 10% of the
    device time torch.profiler (CUPTI) records for the kernels launched inside the Newton-Schulz
    call. The call is labelled with ``record_function`` (a wrapper around the optimizer's runner,
    in this test only), and the profiler attributes to the label every kernel its ops launched, so
    the comparison covers exactly the Newton-Schulz kernels, no name guessing. A span runs from
    the compute stream reaching the first of them to its passing the last, so it exceeds the kernel
    sum only by the gaps between them: with kernels of about 0.1 ms and launches of about 10 us
    the host stays ahead and the gaps are a few percent at most;
(c) the spans of the compute lane follow each other without overlap, in recording order, and lie
    on the host clock: inside the step's host window widened by the GPU's lag.

Run on a GPU node: ``PYTHONPATH=$PWD python3 -m pytest -q tests/unit/test_gpu_spans.py -rs``.
"""

from __future__ import annotations

import time

import pytest
import torch

from muonlab import Muon
from muonlab.trace import Tracer
from muonlab.trace.spans import LANES, GpuMark

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU: on CUDA spans are timed by CUDA events (run this file on a GPU node)")

NUM_MATRICES, SHAPE = 24, (1024, 4096)
CLOCK_TOLERANCE = 2e-3
"""Seconds: the anchor is read right after the GPU finished; allow for scheduling on the host."""


def _warm_opt() -> Muon:
    torch.manual_seed(0)
    device = torch.device("cuda")
    params = [torch.nn.Parameter(torch.randn(SHAPE, device=device, dtype=torch.bfloat16))
              for _ in range(NUM_MATRICES)]
    for p in params:
        p.grad = torch.randn_like(p)
    # nonfinite="ignore": the skip policy reads its flags (a synchronisation of its own, not the
    # tracer's); backend "torch": no Triton autotuning, and the profiler sees aten kernels
    opt = Muon(params, nonfinite="ignore", ns_backend="torch", ns_graphs=False)
    opt.step()  # warm-up: allocator, cuBLAS handles and heuristics, the tracer's event pool
    opt.last_step_stats()
    torch.cuda.synchronize()
    return opt


def _sleep_cycles(seconds: float) -> int:
    """GPU clock cycles that torch.cuda._sleep spins for about ``seconds``."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 10_000_000
    torch.cuda._sleep(cycles)  # the first sleep also raises the GPU's clock from idle: not timed
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return int(cycles * seconds / (start.elapsed_time(end) / 1e3))


def test_tracer_times_gpu_work_not_its_launch():
    tracer = Tracer(device="cuda")
    cycles = _sleep_cycles(0.05)
    torch.cuda.synchronize()
    start = tracer.mark()
    torch.cuda._sleep(cycles)
    end = tracer.mark()
    assert isinstance(start, GpuMark) and isinstance(end, GpuMark)
    launch = end.host - start.host
    tracer.add("newton_schulz", start, end)
    (span,) = tracer.spans
    assert span.duration == pytest.approx(0.05, rel=0.2)
    assert launch < 0.2 * span.duration, (launch, span.duration)
    # an event completes after the host recorded it: the anchor never places it earlier
    assert span.start >= start.host - 1e-4 and span.end >= end.host


def test_step_does_not_synchronise_and_spans_time_the_gpu():
    opt = _warm_opt()
    t0 = time.time()
    opt.step()
    host_step = time.time() - t0
    opt.last_step_stats()
    torch.cuda.synchronize()
    sleep = max(0.2, 20 * host_step)  # the GPU is still asleep when step() returns
    cycles = _sleep_cycles(sleep)
    torch.cuda.synchronize()

    torch.cuda._sleep(cycles)
    asleep = torch.cuda.Event()
    asleep.record()
    torch.cuda.set_sync_debug_mode("error")  # a synchronising call in the step raises
    try:
        opt.step()
        returned = time.time()
        still_asleep = not asleep.query()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert still_asleep, f"the GPU finished a {sleep:.3f} s sleep before step() returned: the step synchronised"
    spans = opt.last_step_spans()  # resolves: the one synchronisation
    assert {"momentum", "newton_schulz", "update"} <= {s.name for s in spans}
    first = min(s.start for s in spans)
    assert first > returned, f"a span starts {returned - first:.4f} s before step() returned: a host time"


def test_newton_schulz_spans_match_profiler_kernel_time():
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    opt = _warm_opt()
    runner = opt._ns_runner()
    label = "test_gpu_spans.newton_schulz"

    class Labelled:
        """The optimizer's runner, each call under the label; the rest (its health counts, what
        it ran) read from the runner itself."""

        def __call__(self, mats, cfg):
            with record_function(label):
                return runner(mats, cfg)

        def __getattr__(self, name):
            return getattr(runner, name)

    labelled = Labelled()
    opt._ns_runner = lambda: labelled
    t0 = time.time()
    opt.step()
    host_step = time.time() - t0
    opt.last_step_stats()
    # The whole step queues behind a GPU sleep, so its kernels run back to back: a span then
    # measures GPU work, which is what the profiler's kernel times add up. (Without the sleep, a
    # host-bound step leaves the GPU idle between launches, and a span rightly includes those gaps.)
    cycles = _sleep_cycles(max(0.2, 20 * host_step))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda._sleep(cycles)
        opt.step()
        torch.cuda.synchronize()
    spans = [s for s in opt.last_step_spans() if s.name == "newton_schulz"]
    span_seconds = sum(s.duration for s in spans)
    ranges = [e for e in prof.events() if e.name == label and e.device_type == DeviceType.CPU]
    assert len(ranges) == len(spans) >= 1

    def device_us(event):
        total = getattr(event, "device_time_total", None)
        return event.cuda_time_total if total is None else total

    kernel_seconds = sum(device_us(e) for e in ranges) / 1e6
    assert kernel_seconds > 0, "the profiler attributed no kernels to the Newton-Schulz calls"
    assert opt.last_step_stats()["seconds"]["newton_schulz"] == pytest.approx(span_seconds, rel=1e-9)
    print(f"\nNewton-Schulz: spans {span_seconds * 1e3:.3f} ms, profiler kernels {kernel_seconds * 1e3:.3f} ms "
          f"({len(spans)} batch(es), ratio {span_seconds / kernel_seconds:.3f})")
    assert span_seconds == pytest.approx(kernel_seconds, rel=0.10), (span_seconds, kernel_seconds)


def test_spans_are_ordered_on_the_compute_lane_and_lie_on_the_host_clock():
    opt = _warm_opt()
    t0 = time.time()
    opt.step()
    torch.cuda.synchronize()  # the GPU's lag: the step's work ends before t1
    t1 = time.time()
    spans = opt.last_step_spans()
    stats = opt.last_step_stats()
    assert all(s.start <= s.end for s in spans)
    compute = [s for s in spans if LANES[s.name] == "compute"]
    assert [s.name for s in compute].count("newton_schulz") == len(opt.plan())
    # recorded in order on one stream: each compute span starts where or after the previous ended
    ordered = sorted(compute, key=lambda s: s.start)
    assert [id(s) for s in ordered] == [id(s) for s in compute]
    for a, b in zip(compute, compute[1:]):
        assert b.start >= a.end - 1e-6, (a, b)
    assert t0 - CLOCK_TOLERANCE <= min(s.start for s in spans)
    assert max(s.end for s in spans) <= t1 + CLOCK_TOLERANCE
    seconds = stats["seconds"]
    assert set(seconds) == {"momentum", "communication", "newton_schulz", "update", "adamw"}
    assert sum(seconds.values()) <= (t1 - t0) + CLOCK_TOLERANCE
    assert seconds["newton_schulz"] > 0.5 * sum(seconds.values())  # the step's GPU work is mostly NS
